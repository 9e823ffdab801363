"""Allreduce timing, one process per rank: ``python -m hvdkit.bench.allreduce``.

Started by ``hvdkit bench`` under horovodrun. Times Horovod's allreduce (through whichever
controller horovodrun chose) and, in the same processes over the same float32 messages, with
``--torch-dist`` torch.distributed's gloo allreduce, with ``--mpi4py`` MPI's own Allreduce
(what Horovod's MPI controller could at best reach). Each time is the slowest rank's mean over
its iterations, after a barrier; rank 0 prints the result.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

from hvdkit import envvars
from hvdkit.bench.worker import clock, emit


def iterations(nbytes: int, quick: bool) -> int:
    """Enough repeats that small messages average out, few for the large ones."""
    target = (16 if quick else 64) * 1024 * 1024
    return max(2 if quick else 3, min(20 if quick else 50, target // nbytes))


def _mpi_allreduce(comm: Any, send: Any, recv: Any) -> None:
    comm.Allreduce(send, recv)


def _time(
    op: Callable[[Any], Any],
    tensor: Any,
    iters: int,
    barrier: Callable[[], Any],
    slowest: Callable[[float], float],
) -> float:
    op(tensor)  # warm-up: allocates buffers, negotiates the tensor name
    barrier()
    start = clock()
    for _ in range(iters):
        op(tensor)
    return slowest((clock() - start) / iters)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument("--torch-dist", action="store_true", help="also time torch.distributed")
    parser.add_argument("--mpi4py", action="store_true",
                        help="also time MPI's Allreduce (MPI controller)")  # fmt: skip
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)  # reductions are memory-bound; one thread per rank, as Horovod's

    def hvd_slowest(seconds: float) -> float:
        return hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="bench.slowest").item()

    def hvd_barrier() -> None:
        hvd.allreduce(torch.zeros(1), op=hvd.Sum, name="bench.barrier")

    timings: dict[str, list[float]] = {"horovod": []}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        name = f"bench.{nbytes}"
        reduce = functools.partial(hvd.allreduce_, op=hvd.Sum, name=name)
        timings["horovod"].append(
            _time(reduce, tensor, iterations(nbytes, args.quick), hvd_barrier, hvd_slowest)
        )
    if args.torch_dist:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ[envvars.BENCH_MASTER]}",
            rank=hvd.rank(),
            world_size=hvd.size(),
        )

        def dist_slowest(seconds: float) -> float:
            t = torch.tensor(seconds)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        timings["torch.distributed"] = [
            _time(dist.all_reduce, torch.ones(nbytes // 4), iterations(nbytes, args.quick),
                  dist.barrier, dist_slowest)
            for nbytes in sizes
        ]  # fmt: skip
        dist.destroy_process_group()
    if args.mpi4py:
        # Horovod has initialised MPI; mpi4py uses the same library and world.
        import numpy as np
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

        def mpi_slowest(seconds: float) -> float:
            return comm.allreduce(seconds, op=MPI.MAX)

        timings["mpi4py"] = []
        for nbytes in sizes:
            send, recv = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
            mpi = functools.partial(_mpi_allreduce, comm, recv=recv)
            timings["mpi4py"].append(
                _time(mpi, send, iterations(nbytes, args.quick), comm.Barrier, mpi_slowest)
            )
    emit({"ranks": hvd.size(), "sizes": sizes, "seconds": timings})


if __name__ == "__main__":
    main()
