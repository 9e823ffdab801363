"""Horovod's PyTorch API for today's PyTorch, plus :func:`setup` (the six steps in one call).

A Horovod script runs with only its import changed::

    import hvdkit.torch as hvd   # was: import horovod.torch as hvd

What differs from ``horovod.torch``: ``broadcast_parameters`` handles non-contiguous
(channels_last) tensors; ``broadcast_optimizer_state`` takes no spurious step on a fresh
optimizer; ``DistributedOptimizer.zero_grad(set_to_none=...)`` works; and
:func:`backward_and_step` is the one pattern for AMP and clipping.
"""

from horovod.torch import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    grouped_allreduce,
    grouped_allreduce_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    nccl_built,
    poll,
    rank,
    shutdown,
    size,
    synchronize,
)

from hvdkit.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hvdkit.torch.optimizer import DistributedOptimizer, backward_and_step
from hvdkit.torch.session import Session, setup

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "Session",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "backward_and_step",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "gloo_built",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "nccl_built",
    "poll",
    "rank",
    "setup",
    "shutdown",
    "size",
    "synchronize",
]
