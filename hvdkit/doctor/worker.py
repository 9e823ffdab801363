"""Run by ``hvdkit doctor`` under ``horovodrun -np 2``: one real allreduce and broadcast with
the named framework's Horovod ops, checked against the values they must produce.

Usage: ``python -m hvdkit.doctor.worker torch|tensorflow|jax``. ``jax``: JAX's runtime started
over Horovod's world (:mod:`hvdkit.jax_world`), and the sum and broadcast computed by XLA in one
compiled program over every process's device, the path Keras's gradients take on JAX.
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


def _jax() -> tuple[int, int, list[float], list[float]]:
    import horovod.torch as hvd
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hvdkit import jax_world

    hvd.init()
    jax_world.start(hvd)
    mesh = Mesh(np.array(jax_world.devices()), ("ranks",))
    by_rank = NamedSharding(mesh, PartitionSpec("ranks"))
    everywhere = NamedSharding(mesh, PartitionSpec())

    def stacked(value: float) -> jax.Array:  # row r: rank r's value
        row = np.full((1, 4), value, np.float32)
        parts = [jax.device_put(row, device) for device in by_rank.addressable_devices]
        return jax.make_array_from_single_device_arrays((hvd.size(), 4), by_rank, parts)

    summed = jax.jit(lambda a: a.sum(0), out_shardings=everywhere)(stacked(hvd.rank() + 1.0))
    got = jax.jit(lambda a: a[0], out_shardings=everywhere)(stacked(hvd.rank() * 10 + 7.0))
    total, root = (np.asarray(x.addressable_data(0)).tolist() for x in (summed, got))
    return hvd.rank(), hvd.size(), total, root


def main(argv: list[str] | None = None) -> int:
    framework = (argv if argv is not None else sys.argv[1:] or ["torch"])[0]
    run = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}[framework]
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
