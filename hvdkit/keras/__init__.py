"""Horovod's Keras API for Keras 3, on the TensorFlow and PyTorch backends.

    import hvdkit.keras as hvd   # was: import horovod.tensorflow.keras as hvd

Set ``KERAS_BACKEND`` (``tensorflow`` or ``torch``) before the first ``import keras``; the
matching Horovod ops serve it. Models must be compiled with ``jit_compile=False`` on the
TensorFlow backend: Horovod's ops have no XLA kernels.
"""

from __future__ import annotations

from typing import Any

import keras

from hvdkit.keras import backend, callbacks
from hvdkit.keras.optimizer import DistributedOptimizer


def _hvd() -> Any:
    return backend.horovod()


def init(*args: Any, **kwargs: Any) -> None:
    """Initialise Horovod for the active Keras backend."""
    _hvd().init(*args, **kwargs)


def size() -> int:
    return _hvd().size()


def rank() -> int:
    return _hvd().rank()


def local_rank() -> int:
    return _hvd().local_rank()


def local_size() -> int:
    return _hvd().local_size()


def cross_rank() -> int:
    return _hvd().cross_rank()


def allreduce(value: Any, name: str | None = None, average: bool = True) -> Any:
    """Average (or sum) a tensor or number over all ranks."""
    tensor = keras.ops.convert_to_tensor(value)
    op = _hvd().Average if average else _hvd().Sum
    return _hvd().allreduce(tensor, op=op, name=name)


def broadcast_global_variables(root_rank: int = 0, model: keras.Model | None = None) -> None:
    """Broadcast ``model``'s variables from ``root_rank`` (Keras 3 has no global collection, so
    the model is required)."""
    if model is None:
        raise ValueError(
            "Keras 3 has no global variable collection: pass the model, "
            "broadcast_global_variables(0, model=model), or use "
            "callbacks.BroadcastGlobalVariablesCallback(0) in fit()"
        )
    backend.broadcast_variables(list(model.variables), root_rank)


def __getattr__(name: str) -> Any:
    # Average, Sum, Compression, ... come from the backend's Horovod module.
    if name in ("Average", "Sum", "Adasum", "Compression"):
        return getattr(_hvd(), name)
    raise AttributeError(f"module 'hvdkit.keras' has no attribute {name!r}")


__all__ = [
    "DistributedOptimizer",
    "allreduce",
    "broadcast_global_variables",
    "callbacks",
    "cross_rank",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "size",
]
