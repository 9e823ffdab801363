"""Horovod's TensorFlow collectives, taking Keras 3 variables too, and refusing a 0-d tensor
where the op needs a first axis.

Horovod's ops are fine on ``tf.Tensor``s and ``tf.Variable``s, but a Keras 3 variable is
neither: Horovod's compression reads ``tensor.dtype.is_floating`` (a Keras dtype is a string)
and ``broadcast_variables`` assigns through a symbolic tensor. Each function here is
Horovod's, given the ``tf.Variable`` under each Keras 3 variable; same signature, same result.

A 0-d tensor has no first axis to split or join. Horovod 0.28.1 does not check it:
``alltoall`` crashes the process (a segmentation fault in its op), ``allgather`` and
``grouped_allgather`` fail with a ``FailedPreconditionError`` from the coordinator (eagerly) or
a shape-inference ``ValueError`` (in ``tf.function``). Here those three refuse a tensor of
static rank 0 first, with a ``ValueError`` naming it and the fix, eagerly and while tracing.
(``reducescatter`` refuses a 0-d tensor itself, with a clear error: it is Horovod's.)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import horovod.tensorflow as _hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.tensorflow import global_process_set

from hvdkit.first_axis import check_first, zero_d_error

F = TypeVar("F", bound=Callable[..., Any])

NEEDS_FIRST_AXIS = ("allgather", "grouped_allgather", "alltoall")


def tf_variable(value: Any) -> Any:
    """The ``tf.Variable`` that holds a Keras 3 variable's value (on the TensorFlow backend);
    anything else as it is."""
    if isinstance(value, keras.Variable):
        return value.value
    return value


def tf_variables(values: Any) -> Any:
    """:func:`tf_variable` of ``values``, or of each item of a list or tuple of them."""
    if isinstance(values, (list, tuple)):
        return type(values)(tf_variable(v) for v in values)
    return tf_variable(values)


def refuse_0d(op: str, value: Any, index: int | None = None) -> None:
    """Raise the ``ValueError`` for ``op`` given ``value`` of static rank 0 (``tensors[index]``
    of a grouped op); anything else passes, an unknown rank too."""
    shape = getattr(value, "shape", None)
    rank = tf.TensorShape(shape).rank if shape is not None else np.ndim(value)
    if rank != 0:
        return
    dtype = getattr(getattr(value, "dtype", None), "name", None) or type(value).__name__
    raise zero_d_error(op, dtype, "tf.reshape({x}, [1])", index)


def _first_unwrapped(horovod_fn: F) -> F:
    """``horovod_fn`` given the ``tf.Variable`` of each Keras 3 variable in its first argument
    (``tensor``; ``tensors`` or ``variables`` of the ops that take several), refusing 0-d
    tensors first where the op needs a first axis."""
    op = horovod_fn.__name__
    key = next(iter(inspect.signature(horovod_fn).parameters))  # tensor, tensors, variables

    @functools.wraps(horovod_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (tf_variables(args[0]), *args[1:])
        elif key in kwargs:
            kwargs[key] = tf_variables(kwargs[key])
        if op in NEEDS_FIRST_AXIS:
            check_first(op, args[0] if args else kwargs.get(key), refuse_0d)
        return horovod_fn(*args, **kwargs)

    call.__module__ = __name__
    return call  # type: ignore[return-value]


allreduce = _first_unwrapped(_hvd.allreduce)
grouped_allreduce = _first_unwrapped(_hvd.grouped_allreduce)
allgather = _first_unwrapped(_hvd.allgather)
grouped_allgather = _first_unwrapped(_hvd.grouped_allgather)
broadcast = _first_unwrapped(_hvd.broadcast)
broadcast_ = _first_unwrapped(_hvd.broadcast_)
alltoall = _first_unwrapped(_hvd.alltoall)
reducescatter = _first_unwrapped(_hvd.reducescatter)
grouped_reducescatter = _first_unwrapped(_hvd.grouped_reducescatter)


def broadcast_variables(
    variables: Any, root_rank: int, process_set: Any = global_process_set, inplace: bool = False
) -> Any:
    """Assign rank ``root_rank``'s value to each of ``variables`` (``tf.Variable``s or Keras 3
    variables: a model's ``variables``, an optimizer's once built), on every rank of
    ``process_set``; ``inplace`` broadcasts into the variables' own memory. Works eagerly and
    inside ``tf.function``, as Horovod's."""
    return _hvd.broadcast_variables(
        [tf_variable(v) for v in variables], root_rank, process_set=process_set, inplace=inplace
    )


def barrier(process_set: Any = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called it (``horovod.torch.barrier``;
    Horovod's TensorFlow module has none): a one-number allreduce."""
    _hvd.allreduce(
        tf.constant(0, tf.int32), op=_hvd.Sum, name="hvdkit.barrier", process_set=process_set
    )
