"""Horovod's Keras collectives and queries, for the active Keras backend: each takes numpy
arrays, Python numbers or the backend's tensors and returns the backend's tensor (a
``tf.Tensor`` on TensorFlow, as Horovod's Keras layer does in eager mode; a ``torch.Tensor``
on torch; a JAX array on JAX) of the input's dtype, or refuses a dtype Horovod does not take.
``process_set=`` (Horovod's ``ProcessSet``) restricts an op to a set of ranks."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from hvdkit.first_axis import zero_d_error
from hvdkit.keras import backend


def _tensor(value: Any) -> Any:
    """``value`` as the backend's Horovod takes it, its dtype kept."""
    current = backend.current()
    if isinstance(value, np.generic):
        # Keras on torch reads a numpy float64 scalar as a Python float (float32); as a 0-d
        # array it keeps its dtype.
        value = np.asarray(value)
    if getattr(current, "takes_host_values", False):
        return current.for_horovod(value)
    return current.for_horovod(keras.ops.convert_to_tensor(value))


def _split_tensor(op: str, value: Any) -> Any:
    """``value`` for an op that splits or joins along the first axis: a 0-d one has none, and
    Horovod would crash the process (``alltoall``) or fail obscurely (``allgather`` on torch)."""
    tensor = _tensor(value)
    if getattr(tensor, "ndim", None) == 0:
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        raise zero_d_error(op, dtype, "keras.ops.reshape({x}, [1])")
    return tensor


def _set(process_set: Any) -> dict[str, Any]:
    return {} if process_set is None else {"process_set": process_set}


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = None,
    *,
    process_set: Any = None,
) -> Any:
    """Reduce ``value`` over all ranks: ``op`` ``Average`` (default, or ``average=True``) or
    ``Sum`` (``average=False``), ``Min``, ``Max``, ``Product``; scaled by ``prescale_factor``
    before and ``postscale_factor`` after."""
    hvd = backend.horovod()
    if op is None:
        op = hvd.Sum if average is False else hvd.Average
    elif average is not None:
        raise ValueError("allreduce: give op= or average=, not both")
    kwargs = {"compression": compression} if compression is not None else {}
    return hvd.allreduce(
        _tensor(value), op=op, name=name, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, **kwargs, **_set(process_set),
    )  # fmt: skip


def allgather(value: Any, name: str | None = None, *, process_set: Any = None) -> Any:
    """Every rank's ``value`` concatenated along the first axis (its length may differ)."""
    tensor = _split_tensor("allgather", value)
    return backend.horovod().allgather(tensor, name=name, **_set(process_set))


def broadcast(
    value: Any, root_rank: int, name: str | None = None, *, process_set: Any = None
) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    return backend.horovod().broadcast(_tensor(value), root_rank, name=name, **_set(process_set))


def reducescatter(value: Any, name: str | None = None, op: Any = None, *,
                  process_set: Any = None) -> Any:  # fmt: skip
    """Reduce ``value`` over the ranks (``Average`` by default, or ``Sum``) and give each rank
    its slice of the first axis (rank r gets rows r*n/size ... as Horovod splits them)."""
    hvd = backend.horovod()
    tensor = _split_tensor("reducescatter", value)
    op = hvd.Average if op is None else op
    return hvd.reducescatter(tensor, name=name, op=op, **_set(process_set))


def alltoall(value: Any, splits: Any = None, name: str | None = None, *,
             process_set: Any = None) -> Any:  # fmt: skip
    """Send slice i of ``value`` (first axis, ``splits`` rows each, equal by default) to rank
    i; returns what this rank received and the splits received, as Horovod's ``alltoall``."""
    kwargs: dict[str, Any] = {} if splits is None else {"splits": _tensor(splits)}
    tensor = _split_tensor("alltoall", value)
    return backend.horovod().alltoall(tensor, name=name, **kwargs, **_set(process_set))


# Queries and process sets: Horovod's own, from the backend's Horovod module.
DELEGATED = (
    "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
    "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "start_timeline", "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
)  # fmt: skip
