"""Where a process computes: its share of the host's cores, and the one-GPU-per-process rule.
Used by step 2 of both adapters and by the bench."""

from __future__ import annotations

import os
from collections.abc import Callable

from hvdkit.core import Topology


def cores_per_process(processes: int) -> int:
    """This host's cores shared out among ``processes`` (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def threads_per_rank(topology: Topology) -> int:
    """CPU threads for one process: its share of this host's cores, so the ranks on a host do
    not all fight for every core."""
    return cores_per_process(topology.local_size)


def require_gpu_per_rank(topology: Topology, visible_gpus: int) -> None:
    """Raise when this host runs more processes than it has GPUs: NCCL refuses two ranks on
    one GPU, and sharing one would be slow anyway."""
    if topology.local_rank >= visible_gpus:
        raise RuntimeError(
            f"rank {topology.rank}: this host runs {topology.local_size} processes but only "
            f"{visible_gpus} GPU(s) are visible; one GPU per process is required. Fix: start at "
            f"most {visible_gpus} processes per host (slots in the hostfile / -np), or check "
            "CUDA_VISIBLE_DEVICES."
        )


def pin(
    topology: Topology,
    gpus: int,
    use_gpu: Callable[[int], None],
    set_cpu_threads: Callable[[int], None],
) -> bool:
    """Step 2 for any framework: with ``gpus`` visible, take GPU ``local_rank`` (one per
    process, or the error that says so); without, compute with this process's share of the
    cores. Returns whether a GPU was taken."""
    if gpus:
        require_gpu_per_rank(topology, gpus)
        use_gpu(topology.local_rank)
        return True
    set_cpu_threads(threads_per_rank(topology))
    return False
