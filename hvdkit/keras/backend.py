"""Horovod's tensor ops for the active Keras 3 backend: ``horovod.tensorflow`` under
``KERAS_BACKEND=tensorflow``, ``horovod.torch`` under ``KERAS_BACKEND=torch`` and, with JAX
arrays in and out, under ``KERAS_BACKEND=jax`` (:mod:`hvdkit.keras.backends.jax`).

Everything in :mod:`hvdkit.keras` talks to Horovod through these few functions, so the
optimizer and callbacks are written once for both backends; what differs between backends is
in :mod:`hvdkit.keras.backends`, one module each.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import keras
import numpy as np

from hvdkit import elastic_restart, hang
from hvdkit.core import ReduceOp, Topology
from hvdkit.devices import pin
from hvdkit.keras.backends import current
from hvdkit.launch import direct


def horovod() -> ModuleType:
    """The Horovod module that serves the active Keras backend."""
    return current().horovod()


def require_keras3(optimizer: Any) -> None:
    """Stop with a clear message when given a Keras 2 (tf_keras) or other non-Keras-3
    optimizer: hooking it would silently do nothing."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return
    module = type(optimizer).__module__
    if module.startswith("tf_keras") or ".legacy" in module:
        raise TypeError(
            f"{type(optimizer).__name__} is a Keras 2 (tf_keras) optimizer: with "
            "TF_USE_LEGACY_KERAS=1, tf.keras is the legacy Keras 2, which hvdkit.keras does not "
            "serve (nor does Horovod 0.28.1's own Keras layer on TensorFlow 2.21: its callbacks "
            "fail). Fix: unset TF_USE_LEGACY_KERAS and build the model and optimizer with "
            "`import keras` (Keras 3)."
        )
    raise TypeError(
        f"expected a Keras 3 optimizer (keras.optimizers.Optimizer), got {module}."
        f"{type(optimizer).__name__}"
    )


def reduce_op(name: str) -> Any:
    ops = {"average": horovod().Average, "sum": horovod().Sum, "adasum": horovod().Adasum}
    if name not in ops:
        raise ValueError(f"op={name!r}: use one of {', '.join(ops)}")
    return ops[name]


def allreduce_list(
    tensors: list[Any],
    op: ReduceOp = "average",
    name: str = "hvdkit.grads",
    fp16: bool = False,
    *,
    bf16: bool = False,
    predivide: float = 1.0,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    groups: list[list[int]] | None = None,
    device_dense: str = "",
    device_sparse: str = "",
) -> list[Any]:
    """Reduce gradients over the ranks: the dense ones in grouped (fused) allreduces, one per
    entry of ``groups`` (lists of indices into ``tensors``; a dense tensor in no group goes
    alone; default: all in one), each sparse one (TensorFlow ``IndexedSlices``, e.g. an
    ``Embedding``'s) on its own, as Horovod does (an allgather of values and indices);
    ``sparse_as_dense`` makes them dense first. ``predivide`` splits an average into a
    division before the sum and the rest after (Horovod's ``gradient_predivide_factor``).
    ``bf16``: the dense ones travel as bf16 (:mod:`hvdkit.compression`).
    ``device_dense``/``device_sparse`` place the ops on the TensorFlow backend, as Horovod's
    ``tf.device`` does (the torch backend's ops run on the tensor's device). None entries are
    passed through. A rank outside ``process_set``, or a set of one, keeps its own tensors
    (Horovod's rule for gradients)."""
    keras_backend = current()
    hvd = keras_backend.horovod()
    kwargs: dict[str, Any] = {} if process_set is None else {"process_set": process_set}
    out = keras_backend.densify(tensors) if sparse_as_dense else list(tensors)
    if process_set is not None and not (process_set.included() and process_set.size() > 1):
        return out
    sparse = [i for i, t in enumerate(out) if keras_backend.is_sparse(t)]
    dense = [i for i, t in enumerate(out) if t is not None and i not in sparse]
    reduction = reduce_op(op)
    scale = {}
    if predivide != 1.0:
        if op != "average":
            raise ValueError("gradient_predivide_factor needs op=Average")
        scale = {"prescale_factor": 1.0 / predivide, "postscale_factor": predivide}
    if bf16 and (op not in ("average", "sum") or scale):
        raise ValueError(
            "Compression.bf16 takes op=Average or op=Sum, without gradient_predivide_factor"
        )
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    for g, group in enumerate(dense_groups(dense, groups)):
        group_name = name if g == 0 else f"{name}.group{g}"
        if bf16:
            with keras_backend.device_scope(device_dense):
                reduced = keras_backend.bf16_allreduce(
                    [out[i] for i in group], op == "average", group_name,
                    process_set or hvd.global_process_set,
                )  # fmt: skip
            for i, tensor in zip(group, reduced, strict=True):
                out[i] = tensor
            continue
        with keras_backend.device_scope(device_dense):
            reduced = hvd.grouped_allreduce(
                [out[i] for i in group], op=reduction, compression=compression,
                name=group_name, **scale, **kwargs,
            )  # fmt: skip
        for i, tensor in zip(group, reduced, strict=True):
            out[i] = tensor
    for i in sparse:
        if op == "adasum" or scale:
            raise ValueError(
                "a sparse gradient (tf.IndexedSlices, e.g. from an Embedding) cannot be reduced "
                "with Adasum or gradient_predivide_factor. Fix: DistributedOptimizer(..., "
                "sparse_as_dense=True)"
            )
        with keras_backend.device_scope(device_sparse):
            out[i] = hvd.allreduce(out[i], op=reduction, name=f"{name}.sparse.{i}", **kwargs)
    return out


def densify(tensors: list[Any]) -> list[Any]:
    """``tensors`` with each sparse one (TensorFlow ``IndexedSlices``) made dense."""
    return current().densify(tensors)


def dense_groups(dense: list[int], groups: list[list[int]] | None) -> list[list[int]]:
    """The fused groups for the dense indices ``dense``: ``groups`` with the indices that are
    not dense dropped, then each dense index in no group alone (Horovod's rule for groups of
    variables); all in one group when ``groups`` is None. Empty groups are left out."""
    if groups is None:
        return [dense] if dense else []
    wanted = set(dense)
    placed: set[int] = set()
    out = []
    for group in groups:
        members = []
        for i in group:
            if i in wanted and i not in placed:
                placed.add(i)
                members.append(i)
        if members:
            out.append(members)
    return out + [[i] for i in dense if i not in placed]


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` runs whose lengths differ by at most one, the longer ones
    first (Horovod's ``num_groups``/``groups=N`` split)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(items[start:end])
        start = end
    return [run for run in out if run]


def allgather_numpy(array: np.ndarray, name: str) -> np.ndarray:
    """Every rank's ``array`` stacked along a new first axis (same shape on every rank)."""
    hvd = horovod()
    local = current().from_host(np.asarray(array)[None])
    return np.asarray(keras.ops.convert_to_numpy(hvd.allgather(local, name=name)))


def broadcast_variables(variables: list[keras.Variable], root_rank: int = 0) -> None:
    """Assign rank 0's value to each Keras variable, in place."""
    hvd = horovod()
    for i, variable in enumerate(variables):
        value = current().for_horovod(keras.ops.convert_to_tensor(variable.value), copy=True)
        variable.assign(hvd.broadcast(value, root_rank, name=f"hvdkit.var.{i}"))


def write_back(model: keras.Model) -> None:
    """Put the live training state into ``model``'s variables. Mid-epoch on JAX, Keras's
    trainer holds the values and has emptied the variables until asked (as ``Callback.model``
    does); elsewhere the variables are always live."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def broadcast_object(obj: Any, root_rank: int = 0, name: str = "hvdkit.object") -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank."""
    return horovod().broadcast_object(obj, root_rank=root_rank, name=name)


def init(comm: Any = None, process_sets: Any = None) -> Topology:
    """Initialise Horovod (idempotent) and return where this process sits."""
    hvd = horovod()
    if not hvd.is_initialized():
        direct.check(bool(hvd.mpi_built()))
        hang.install(torch=getattr(hvd, "__name__", "") == "horovod.torch")  # the hang doctor
        elastic_restart.rejoin()  # a worker restarted at an elastic reset: its new place
        hvd.init(comm=comm, process_sets=process_sets)
    current().after_init(hvd)
    return Topology.of(hvd)


def set_cpu_threads(threads: int) -> None:
    """Compute on CPU with ``threads`` threads on the active backend (every pool it has).
    TensorFlow fixes its pools at its first op: call this before."""
    current().set_cpu_threads(threads)


def pin_device(topology: Topology) -> None:
    """One GPU per process by local rank, for the active backend; on CPU, a share of the
    cores per process."""
    backend = current()

    def set_threads(threads: int) -> None:
        try:
            backend.set_cpu_threads(threads)
        except RuntimeError:
            # TensorFlow fixes its thread pools at its first op; a process that ran one
            # before init keeps the pools it has.
            pass

    pin(
        topology,
        backend.gpu_count(),
        lambda index: backend.use_gpu(index, topology.rank),
        set_threads,
        nccl=bool(backend.horovod().nccl_built()),
    )
