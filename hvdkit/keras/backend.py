"""Horovod's tensor ops for the active Keras 3 backend: ``horovod.tensorflow`` under
``KERAS_BACKEND=tensorflow``, ``horovod.torch`` under ``KERAS_BACKEND=torch``.

Everything in :mod:`hvdkit.keras` talks to Horovod through these few functions, so the
optimizer and callbacks are written once for both backends.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import keras

SUPPORTED = ("tensorflow", "torch")


@functools.cache
def horovod() -> ModuleType:
    """The Horovod module that serves the active Keras backend."""
    name = keras.config.backend()
    if name == "tensorflow":
        import horovod.tensorflow as hvd
    elif name == "torch":
        import horovod.torch as hvd
    else:
        raise RuntimeError(
            f"Keras backend {name!r} is not served by Horovod. Fix: set KERAS_BACKEND=tensorflow "
            "or KERAS_BACKEND=torch before importing keras."
        )
    return hvd


def reduce_op(name: str) -> Any:
    ops = {"average": horovod().Average, "sum": horovod().Sum}
    if name not in ops:
        raise ValueError(f"op={name!r}: use one of {', '.join(ops)}")
    return ops[name]


def allreduce_list(
    tensors: list[Any], op: str = "average", name: str = "hvdkit.grads", fp16: bool = False
) -> list[Any]:
    """One grouped (fused) allreduce of the tensors; None entries are passed through."""
    hvd = horovod()
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return list(tensors)
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    reduced = hvd.grouped_allreduce(
        [tensors[i] for i in present], op=reduce_op(op), name=name, compression=compression
    )
    out = list(tensors)
    for i, tensor in zip(present, reduced, strict=True):
        out[i] = tensor
    return out


def broadcast_variables(variables: list[keras.Variable], root_rank: int = 0) -> None:
    """Assign rank 0's value to each Keras variable, in place."""
    hvd = horovod()
    for i, variable in enumerate(variables):
        value = keras.ops.convert_to_tensor(variable.value)
        if keras.config.backend() == "torch":
            value = value.detach().clone().contiguous()
        variable.assign(hvd.broadcast(value, root_rank, name=f"hvdkit.var.{i}"))
