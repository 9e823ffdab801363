"""Horovod's PyTorch API for today's PyTorch, plus :func:`setup` (the six steps in one call).

A Horovod script runs with only its import changed::

    import hvdkit.torch as hvd   # was: import horovod.torch as hvd

What differs from ``horovod.torch``: ``broadcast_parameters`` handles non-contiguous
(channels_last) tensors; ``broadcast_optimizer_state`` takes no spurious step on a fresh
optimizer; ``DistributedOptimizer.zero_grad(set_to_none=...)`` works; and
:func:`backward_and_step` is the one pattern for AMP and clipping; ``SyncBatchNorm`` also
works on CPU (Horovod's needs a GPU); ``allgather``, ``alltoall`` (and their grouped and async
forms) refuse a 0-d tensor with the fix, where Horovod's crash the process or fail obscurely.

Module set: ``adapter``, ``optimizer`` and ``session`` play the same roles as in
:mod:`hvdkit.keras` (see its docstring); ``functions`` (broadcasts of parameters, optimizer
state and objects), ``collectives`` (the 0-d refusals) and ``sync_batch_norm`` are the parts
of ``horovod.torch`` that hvdkit rewrites.
"""

from horovod.torch import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    ccl_built,
    check_extension,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)

from hvdkit.torch import elastic as elastic  # hvd.elastic, as in horovod.torch
from hvdkit.torch.bf16 import Compression
from hvdkit.torch.collectives import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
)
from hvdkit.torch.functions import broadcast_optimizer_state, broadcast_parameters, init
from hvdkit.torch.optimizer import DistributedOptimizer, backward_and_step
from hvdkit.torch.session import Session, setup
from hvdkit.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "Average",
    "backward_and_step",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "check_extension",
    "Compression",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "DistributedOptimizer",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "HorovodInternalError",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "Max",
    "Min",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "ProcessSet",
    "Product",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "Session",
    "setup",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "Sum",
    "SyncBatchNorm",
    "synchronize",
]
