"""Horovod's Keras API for Keras 3, on the TensorFlow and PyTorch backends.

    import hvdkit.keras as hvd   # was: import horovod.tensorflow.keras as hvd
                                 #  or: import horovod.keras as hvd

Set ``KERAS_BACKEND`` (``tensorflow`` or ``torch``) before the first ``import keras``; the
matching Horovod ops serve it. Models must be compiled with ``jit_compile=False`` on the
TensorFlow backend: Horovod's ops have no XLA kernels (:func:`setup` sees to it).

Every rank must take the same number of optimizer steps per epoch (each step is an
allreduce all ranks join): give each rank an equal share, e.g. with :func:`shard`.

Module set. ``hvdkit.keras`` and ``hvdkit.torch`` share four modules with the same roles:
``__init__`` (Horovod's API), ``adapter`` (the six-step hooks of :class:`hvdkit.core.Adapter`),
``optimizer`` (``DistributedOptimizer``) and ``session`` (``setup()`` and its ``Session``).
The rest follows what each Horovod module offers, not a common template (STYLE.md's "same file
set" is an example here, not a rule): Keras adds ``callbacks``, ``lr`` and ``metrics`` (the
``fit()`` side), ``collectives`` and ``layers``, and ``backend`` with ``backends/`` (one module
per Keras backend behind an abstract base, because Keras 3 runs on two frameworks); torch adds
``functions`` and ``sync_batch_norm``.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvdkit import core
from hvdkit.compression import with_bf16
from hvdkit.keras import backend, callbacks, collectives
from hvdkit.keras import elastic as elastic  # hvd.elastic, as in horovod.tensorflow.keras
from hvdkit.keras.collectives import allgather, allreduce, alltoall, broadcast, reducescatter
from hvdkit.keras.layers import SyncBatchNormalization
from hvdkit.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdkit.keras.session import Session, setup
from hvdkit.profile import recorder as profile_recorder


def _hvd() -> Any:
    return backend.horovod()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Horovod's ``init`` (``comm``: an MPI communicator or list of ranks; ``process_sets``:
    static ``ProcessSet``s, or ``"dynamic"``) for the active Keras backend, and pin this
    process to one GPU by local rank (on CPU: its share of the cores). Idempotent. On the
    TensorFlow backend call it before building a model: TensorFlow fixes its devices at its
    first op."""
    core.start(functools.partial(backend.init, comm, process_sets), backend.pin_device)
    profile_recorder.get()  # under --profile: its hooks in place before the first step


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


def load_model(
    filepath: str | Path,
    custom_optimizers: list[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = None,
    legacy_opts: bool = False,
    **kwargs: Any,
) -> keras.Model:
    """``keras.saving.load_model`` with the saved optimizer wrapped in
    :func:`DistributedOptimizer`, ready to go on training on every rank (Horovod's
    signature: ``custom_optimizers`` are optimizer classes the file may name)."""
    if legacy_opts:
        raise ValueError(
            "load_model(legacy_opts=True) loads Keras 2 (tf_keras) legacy optimizers, which "
            "hvdkit.keras does not serve. Fix: re-save the model with Keras 3 and load it with "
            "legacy_opts=False"
        )
    objects = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    model = keras.saving.load_model(filepath, custom_objects=objects or None, **kwargs)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model


def shard(*arrays: Any, pad: bool = True) -> tuple[Any, ...] | Any:
    """This rank's share of each array (rows ``rank, rank + size, ...``). With ``pad`` every
    rank gets ``ceil(n / size)`` rows, the short shards repeating their first rows, so all
    ranks take the same number of steps; use ``pad=False`` for evaluation (each row once)."""
    me, world = _hvd().rank(), _hvd().size()
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError(f"shard: arrays differ in length: {[len(a) for a in arrays]}")
    rows = np.arange(me, n, world)
    if pad and len(rows) < math.ceil(n / world):
        rows = np.resize(rows, math.ceil(n / world))
    out = tuple(a[rows] for a in arrays)
    return out if len(out) > 1 else out[0]


def __getattr__(name: str) -> Any:
    # Queries, process sets, ops and Compression come from the backend's Horovod module, so
    # importing hvdkit.keras loads only the Horovod module of the active backend, and lazily.
    if name == "Compression":  # Horovod's, with bf16 (hvdkit.compression)
        return with_bf16(_hvd().Compression)
    if name in collectives.DELEGATED:
        return getattr(_hvd(), name)
    raise AttributeError(f"module 'hvdkit.keras' has no attribute {name!r}")


__all__ = [
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "Session",
    "SyncBatchNormalization",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_global_variables",
    "callbacks",
    "cross_rank",
    "init",
    "load_model",
    "reducescatter",
    "local_rank",
    "local_size",
    "rank",
    "setup",
    "shard",
    "size",
]
