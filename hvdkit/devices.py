"""Where a process computes: its share of the host's cores, and the one-GPU-per-process rule.
Used by step 2 of both adapters and by the bench."""

from __future__ import annotations

import os
from collections.abc import Callable

from hvdkit.core import Topology
from hvdkit.gpus import shared_gpu_problem


def cores_per_process(processes: int) -> int:
    """This host's cores shared out among ``processes`` (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def threads_per_rank(topology: Topology) -> int:
    """CPU threads for one process: its share of this host's cores, so the ranks on a host do
    not all fight for every core."""
    return cores_per_process(topology.local_size)


def gpu_for(topology: Topology, visible_gpus: int, nccl: bool) -> int:
    """This process's GPU: ``local_rank``, one GPU each. With more processes than GPUs the
    ranks share them round-robin, unless Horovod reduces with NCCL, which refuses two ranks
    on one GPU: then the error that says so (:func:`hvdkit.gpus.shared_gpu_problem`)."""
    problem = shared_gpu_problem(topology.local_size, visible_gpus, nccl)
    if problem:
        raise RuntimeError(f"rank {topology.rank}: {problem}")
    return topology.local_rank % visible_gpus


def pin(
    topology: Topology,
    gpus: int,
    use_gpu: Callable[[int], None],
    set_cpu_threads: Callable[[int], None],
    nccl: bool = True,
) -> int | None:
    """Step 2 for any framework: with ``gpus`` visible, take GPU ``local_rank`` (one per
    process; shared when there are fewer and Horovod has no NCCL, ``nccl``); without, compute
    with this process's share of the cores. Returns the GPU taken, or None."""
    if gpus:
        index = gpu_for(topology, gpus, nccl)
        use_gpu(index)
        return index
    set_cpu_threads(threads_per_rank(topology))
    return None
