"""Horovod's TensorFlow collectives, taking Keras 3 variables too.

Horovod's ops are fine on ``tf.Tensor``s and ``tf.Variable``s, but a Keras 3 variable is
neither: Horovod's compression reads ``tensor.dtype.is_floating`` (a Keras dtype is a string)
and ``broadcast_variables`` assigns through a symbolic tensor. Each function here is
Horovod's, given the ``tf.Variable`` under each Keras 3 variable; same signature, same result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import horovod.tensorflow as _hvd
import keras
import tensorflow as tf
from horovod.tensorflow import global_process_set

F = TypeVar("F", bound=Callable[..., Any])


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


def _first_unwrapped(horovod_fn: F) -> F:
    @functools.wraps(horovod_fn)
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return horovod_fn(tf_variables(tensor), *args, **kwargs)

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
