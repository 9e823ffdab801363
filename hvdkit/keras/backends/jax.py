"""Keras on JAX: gradients averaged by XLA inside the compiled step; Horovod for the rest.

Horovod's ops cannot run inside a compiled JAX step, so on this backend the work is split:

- **The world** is Horovod's, as on the other backends (``hvdkit run``, the allocations,
  ``mpirun``): ``init()`` starts Horovod's torch binding, then JAX's distributed runtime from it
  (rank 0 opens the coordinator's port and broadcasts its address) unless it already runs.
- **The gradients** are averaged by XLA: ``init()`` sets a Keras ``DataParallel`` over every
  process's device, so the compiled step sees the global batch (each rank's batch side by
  side) and XLA all-reduces the gradients inside it. ``DistributedOptimizer`` adds no
  reduction of its own there.
- **Collectives called by the script** (``hvd.allreduce``, ``broadcast``, ``*_object``...) go
  through Horovod on host copies and return JAX arrays of the input's dtype (64-bit ones too,
  without JAX's x64), or refuse a dtype Horovod does not take, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import numpy as np

from hvdkit import jax_world
from hvdkit.devices import cores_per_process
from hvdkit.keras.backends.base import KerasBackend

_OURS = "HVDKIT_PJRT_NPROC"  # the PJRT_NPROC hvdkit set (an elastic restart inherits it)

# Horovod's tensor ops; each takes and gives JAX arrays here (host copies in between).
TENSOR_OPS = (
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter",
)  # fmt: skip
# Ops that only move bytes; the others reduce.
MOVES = ("broadcast", "allgather", "grouped_allgather", "alltoall")
# The dtypes Horovod's torch binding (0.28.1) reduces, and the ones it moves.
REDUCED = ("int32", "int64", "float16", "float32", "float64")
MOVED = ("uint8", "int8", "int16", *REDUCED)
# For the moves, dtypes the binding lacks travel as same-width ones it has (Keras's seed state
# is uint32; bool as on TensorFlow, whose Horovod moves it).
CARRIERS = {
    "uint16": np.int16, "uint32": np.int32, "uint64": np.int64, "bfloat16": np.int16,
    "bool": np.uint8,
}  # fmt: skip


def host_value(value: Any) -> np.ndarray:
    """``value`` as a host array, its dtype kept: a numpy or JAX array's own (JAX would make an
    int64 int32 without x64); Python numbers and lists typed as Keras types them on TensorFlow
    and torch (int32, or int64 where a value needs it; ``floatx`` for floats)."""
    if hasattr(value, "dtype"):
        import jax

        if isinstance(value, jax.core.Tracer):
            raise TypeError(
                "a Horovod collective got a traced JAX value (inside jax.jit, or Keras's "
                "compiled step): Horovod's collectives run on the host, on concrete values. "
                "Call it outside the compiled function, or compile the model with "
                "jit_compile=False."
            )
        return np.array(value)
    import keras

    array = np.array(value)
    small = np.iinfo(np.int32)
    if array.dtype == np.int64 and np.all((array >= small.min) & (array <= small.max)):
        return array.astype(np.int32)
    if array.dtype == np.float64:
        return array.astype(keras.config.floatx())
    return array


def _refuse(name: str, dtype: np.dtype, move: bool) -> None:
    """A clear error for a dtype Horovod cannot take here, naming it and the fix."""
    taken = sorted({*MOVED, *CARRIERS} if move else REDUCED)
    if dtype.name in taken:
        return
    what = "move" if move else "reduce"
    raise TypeError(
        f"hvd.{name}: Horovod does not {what} {dtype.name} tensors on KERAS_BACKEND=jax (its "
        f"ops take {', '.join(taken)}; as on TensorFlow and torch, hvdkit does not cast "
        f"silently). Fix: cast it to one of them first, e.g. x.astype('int32') or "
        f"x.astype('float32')"
    )


def _to_torch(name: str, value: Any, move: bool) -> tuple[Any, Any]:
    """A torch copy of ``value`` (torch may write into it), and the dtype to view the result
    as (None: as it comes)."""
    import torch

    array = np.array(value)
    dtype = array.dtype
    _refuse(name, dtype, move)
    if move and dtype.name in CARRIERS:
        return torch.from_numpy(array.view(CARRIERS[dtype.name])), dtype
    return torch.from_numpy(array), None


def _jax_array(array: np.ndarray) -> Any:
    """``array`` as a JAX array of its own dtype and value: a 64-bit one stays 64-bit when JAX
    runs without x64 (its default, where an int64 would become int32, wrapping its values, and
    a float64 float32)."""
    import jax

    with jax.enable_x64(True):
        return jax.device_put(array)  # no compiled op per shape, as jnp.asarray has


def _to_jax(value: Any, dtype: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        array = value.numpy()
        return _jax_array(array if dtype is None else array.view(dtype))
    if isinstance(value, list):
        return [_to_jax(v, dtype) for v in value]
    if isinstance(value, tuple):  # alltoall: (received, splits received)
        return (_to_jax(value[0], dtype), *[_to_jax(v, None) for v in value[1:]])
    return value


def _tensor_op(name: str, op: Any) -> Any:
    move = name in MOVES

    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, (list, tuple)):
            pairs = [_to_torch(name, t, move) for t in tensor]
            inputs: Any = [t for t, _ in pairs]
            dtypes = {d for _, d in pairs}
            if len(dtypes) > 1:
                raise TypeError(f"hvd.{name}: give the tensors of one call one dtype")
            dtype = dtypes.pop() if dtypes else None
        else:
            inputs, dtype = _to_torch(name, tensor, move)
        if kwargs.get("splits") is not None:
            splits = np.asarray(kwargs["splits"], dtype=np.int32)
            kwargs["splits"] = _to_torch(name, splits, False)[0]
        return _to_jax(op(inputs, *args, **kwargs), dtype)

    call.__name__ = name
    call.__doc__ = op.__doc__
    return call


class HorovodOnJax:
    """``horovod.torch``'s API with JAX arrays in and out: what ``hvdkit.keras`` calls
    Horovod on this backend. Queries, process sets and ``*_object`` ops are Horovod's own;
    the async ops are not offered (a JAX array cannot be written in place)."""

    def __init__(self, hvd: ModuleType) -> None:
        self._hvd = hvd
        for name in TENSOR_OPS:
            setattr(self, name, _tensor_op(name, getattr(hvd, name)))

    def init(self, comm: Any = None, process_sets: Any = None) -> None:
        self._hvd.init(comm=comm, process_sets=process_sets)

    def __getattr__(self, name: str) -> Any:
        if name.endswith(("_async", "_")) or name in ("synchronize", "poll"):
            op = name.removesuffix("_async").rstrip("_")
            raise AttributeError(
                f"hvd.{name} is not offered on Keras's JAX backend: a JAX array is not reduced "
                f"in place or in the background. Fix: use the result of hvd.{op}(...)"
            )
        return getattr(self._hvd, name)


def _bootstrap_horovod() -> ModuleType:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(
            "hvdkit.keras on KERAS_BACKEND=jax forms its world with Horovod's torch binding, "
            f"which does not import here ({exc}). Fix: install hvdkit's stack (make setup), "
            "or a Horovod built with torch (hvdkit build-horovod --frameworks torch)"
        ) from exc
    return hvd


def start_jax(hvd: ModuleType) -> None:
    """JAX's distributed runtime over Horovod's world (once), and Keras's ``DataParallel``
    over every process's device. Must run before the first JAX array or Keras model exists."""
    import keras

    jax_world.start(hvd)
    if hvd.size() > 1 and keras.distribution.distribution() is None:
        distribution = keras.distribution.DataParallel(devices=jax_world.devices())
        distribution.auto_shard_dataset = False  # each rank feeds its own shard, as in Horovod
        keras.distribution.set_distribution(distribution)
        _place_as_horovod_does()
        _check_equal_batches(hvd)
        _predict_own_rows()


def _place_as_horovod_does() -> None:
    """Each rank's own value becomes its copy of a replicated variable, unchecked.

    Keras checks, with a collective, that every process assigns the same value to a
    replicated variable. Horovod scripts do not: each rank builds its model from its own seed
    and the broadcast from rank 0 makes them equal, and only rank 0 reads a checkpoint before
    broadcasting it. Placing the local value as it is gives Horovod's behaviour for both
    (and no collective per assignment)."""
    import jax
    from keras.src.backend.jax import distribution_lib

    original = distribution_lib.distribute_tensor
    if getattr(original, "hvdkit", False):
        return

    def distribute_tensor(tensor: Any, layout: Any) -> Any:
        sharding = getattr(layout, "backend_layout", layout)
        replicated = (
            isinstance(sharding, jax.sharding.NamedSharding)
            and sharding.is_fully_replicated
            and not sharding.is_fully_addressable
        )
        local = not isinstance(tensor, jax.Array) or tensor.is_fully_addressable
        if not replicated or not local or isinstance(tensor, jax.core.Tracer):
            return original(tensor, layout)
        value = np.asarray(tensor)
        shards = [jax.device_put(value, device) for device in sharding.addressable_devices]
        return jax.make_array_from_single_device_arrays(value.shape, sharding, shards)

    distribute_tensor.hvdkit = True  # type: ignore[attr-defined]
    distribution_lib.distribute_tensor = distribute_tensor


def batch_plan(adapter: Any) -> tuple[Any, ...]:
    """What must be equal on every rank for the ranks' steps to be one program: the rows
    and batch size of array input, else the batch count (None: unknown)."""
    rows = getattr(adapter, "_num_samples", None)
    if rows is not None:
        return ("rows", int(rows), "batch size", int(adapter._batch_size))
    return ("batches", adapter.num_batches)


def unequal_batches_message(plans: list[tuple[Any, ...]]) -> str | None:
    """The error for ranks whose inputs differ (``plans[r]``: rank r's :func:`batch_plan`)."""
    if all(plan == plans[0] for plan in plans):
        return None
    shown = "; ".join(f"rank {r}: {' '.join(map(str, plan))}" for r, plan in enumerate(plans))
    return (
        f"the ranks' inputs differ ({shown}). On KERAS_BACKEND=jax one compiled step spans "
        "every rank, so each rank's k-th batch must have the same shape as the others' (on "
        "TensorFlow and torch each rank runs its own step). Fix: give every rank as many rows: "
        "hvd.shard(x, y) pads the short shards; to evaluate, where padding would count rows "
        "twice, shard the first len(x) - len(x) % hvd.size() rows"
    )


def _check_equal_batches(hvd: ModuleType) -> None:
    """Make each epoch of ``fit``/``evaluate``/``predict`` first check, once, that the
    ranks' inputs agree; unequal inputs would give every rank another program and silently
    wrong results."""
    from keras.src.backend.jax import trainer

    original = trainer.JAXEpochIterator._get_distributed_iterator
    if getattr(original, "hvdkit", False):
        return

    def _get_distributed_iterator(self: Any, distribution: Any) -> Any:
        plans = hvd.allgather_object(batch_plan(self.data_adapter), name="hvdkit.jax.batches")
        message = unequal_batches_message(plans)
        if message:
            raise ValueError(message)
        yield from original(self, distribution)

    _get_distributed_iterator.hvdkit = True  # type: ignore[attr-defined]
    trainer.JAXEpochIterator._get_distributed_iterator = _get_distributed_iterator


def _predict_own_rows() -> None:
    """``predict`` gives each rank the predictions of its own rows, as in Horovod: the
    compiled step's outputs span every rank, and Keras cannot read such an array."""
    import jax
    from keras.src import tree
    from keras.src.backend.jax import trainer

    def own_rows(value: Any) -> Any:
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return value.addressable_shards[0].data  # one device per process
        return value

    original = trainer.JAXTrainer.make_predict_function
    if getattr(original, "hvdkit", False):
        return

    def make_predict_function(self: Any, force: bool = False) -> Any:
        original(self, force)
        step = self.predict_function
        if not getattr(step, "hvdkit", False):

            def predict_function(state: Any, iterator: Any) -> Any:
                outputs, state = step(state, iterator)
                return tree.map_structure(own_rows, outputs), state

            predict_function.hvdkit = True  # type: ignore[attr-defined]
            self.predict_function = predict_function
        return self.predict_function

    make_predict_function.hvdkit = True  # type: ignore[attr-defined]
    trainer.JAXTrainer.make_predict_function = make_predict_function


class JaxBackend(KerasBackend):
    #: The compiled step averages the gradients (XLA), not the optimizer.
    reduces_in_step = True

    def horovod(self) -> Any:
        return _wrapper()

    #: Collectives take numpy, JAX and Python values as they are (:func:`host_value`): Keras's
    #: conversion would make a JAX array, which is 32-bit without x64.
    takes_host_values = True

    def for_horovod(self, tensor: Any, *, copy: bool = False) -> Any:
        return host_value(tensor)

    def holds_global_batch(self, tensor: Any) -> bool:
        # Keras's data-parallel distribution hands the step the global batch, sharded over the
        # processes: traced inside the compiled step, or spanning processes when run eagerly.
        import jax

        return isinstance(tensor, jax.core.Tracer) or not getattr(
            tensor, "is_fully_addressable", True
        )

    def from_host(self, array: Any) -> Any:
        # hvdkit's JAX collectives take host arrays as they are; Keras's convert_to_tensor
        # would make float64 float32 (x64 is off).
        return array

    def bf16_allreduce(
        self, tensors: list[Any], average: bool, name: str, process_set: Any
    ) -> list[Any]:
        raise NotImplementedError("on JAX the gradients are reduced by XLA in the step")

    def set_cpu_threads(self, threads: int) -> None:
        # XLA's CPU client sizes its thread pool from PJRT_NPROC when JAX starts its backends.
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "JAX has started: XLA's CPU threads are fixed. Fix: set PJRT_NPROC, or call "
                "this before the first JAX array"
            )
        os.environ["PJRT_NPROC"] = os.environ[_OURS] = str(threads)

    def gpu_count(self) -> int:
        import jax

        return len(jax.local_devices()) if jax.default_backend() == "gpu" else 0

    def use_gpu(self, index: int, rank: int) -> None:
        # Taken when JAX's runtime started (local_device_ids): this process sees one GPU.
        pass

    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def densify(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def is_sparse(self, tensor: Any) -> bool:
        return False

    def after_init(self, hvd: Any) -> None:
        from jax._src import xla_bridge

        # Step 2's share of the cores must reach XLA before start_jax makes the devices.
        if not threads_chosen(os.environ) and not xla_bridge.backends_are_initialized():
            self.set_cpu_threads(cores_per_process(hvd.local_size()))
        start_jax(hvd._hvd)


def threads_chosen(env: Any) -> bool:
    """Whether the user chose XLA's CPU threads (``NPROC``, or a ``PJRT_NPROC`` that is not
    the one hvdkit set, which a restarted elastic worker inherits)."""
    return "NPROC" in env or env.get("PJRT_NPROC", env.get(_OURS)) != env.get(_OURS)


@functools.cache
def _wrapper() -> HorovodOnJax:
    return HorovodOnJax(_bootstrap_horovod())
