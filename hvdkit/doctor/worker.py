"""Run by ``hvdkit doctor`` under ``horovodrun -np 2``: one real allreduce and broadcast with
the named framework's Horovod ops, checked against the values they must produce.

Usage: ``python -m hvdkit.doctor.worker torch|tensorflow``
"""

from __future__ import annotations

import sys

PREFIX = "hvdkit-doctor"


def _torch() -> tuple[int, int, list[float], list[float]]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    summed = hvd.allreduce(torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum, name="doctor.sum")
    sent = torch.full((4,), float(hvd.rank() * 10 + 7))
    got = hvd.broadcast(sent, root_rank=0, name="doctor.bcast")
    return hvd.rank(), hvd.size(), summed.tolist(), got.tolist()


def _tensorflow() -> tuple[int, int, list[float], list[float]]:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    summed = hvd.allreduce(tf.fill([4], float(hvd.rank() + 1)), op=hvd.Sum, name="doctor.sum")
    got = hvd.broadcast(tf.fill([4], float(hvd.rank() * 10 + 7)), root_rank=0, name="doctor.bc")
    return hvd.rank(), hvd.size(), summed.numpy().tolist(), got.numpy().tolist()


def main(argv: list[str] | None = None) -> int:
    framework = (argv if argv is not None else sys.argv[1:] or ["torch"])[0]
    run = {"torch": _torch, "tensorflow": _tensorflow}[framework]
    rank, size, summed, broadcast = run()
    want_sum = float(size * (size + 1) // 2)
    ok = all(v == want_sum for v in summed) and all(v == 7.0 for v in broadcast)
    status = "ok" if ok else "WRONG"
    print(
        f"{PREFIX} {framework} rank {rank}/{size} {status} sum={summed[0]} "
        f"(want {want_sum}) broadcast={broadcast[0]} (want 7.0)",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
