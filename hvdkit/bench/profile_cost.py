"""What ``hvdkit run --profile`` and the hang doctor cost: ``python -m
hvdkit.bench.profile_cost [--what hang]`` under a launcher.

A Horovod-style torch loop (hvdkit's drop-in ``DistributedOptimizer``, a ``DataLoader``) with
the profiler's hooks (``--what hang``: the hang doctor's rank side, :mod:`hvdkit.hang`, which
every ``hvdkit run`` job has unless ``--stall-timeout 0``) on and off in alternating rounds of
one run, on the same model and optimizer (put on and taken off between rounds). Prints the
median of the per-round throughput ratios (on / off), each round's rate at its median step;
the target is >= 0.99.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--what", choices=("profile", "hang"), default="profile")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F  # noqa: N812 - torch's own name
    from torch.utils.data import DataLoader, TensorDataset

    import hvdkit.torch as hvd
    from hvdkit import envvars, hang
    from hvdkit.bench.worker import emit, round_rate
    from hvdkit.devices import cores_per_process
    from hvdkit.models import cnn
    from hvdkit.profile import recorder as profile_recorder
    from hvdkit.torch.optimizer import _profile

    hvd.init()
    torch.set_num_threads(cores_per_process(hvd.local_size()))
    generator = torch.Generator().manual_seed(0)
    count = args.batch_size * args.steps
    data = TensorDataset(torch.randn(count, 1, 28, 28, generator=generator),
                         torch.randint(0, 10, (count,), generator=generator))  # fmt: skip
    recorder = profile_recorder.Recorder()

    torch.manual_seed(0)
    model = cnn()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )

    def hooks_on() -> Any:
        """The profiler's hooks on this one optimizer and every loader; returns the undo. One
        model and optimizer for both variants: two (measured) differ by 1-2% by themselves."""
        own = {
            name: vars(optimizer)[name]
            for name in ("synchronize", "step")
            if name in vars(optimizer)
        }
        _profile(optimizer, recorder)
        undo_loaders = profile_recorder.time_data_loaders(recorder)

        def undo() -> None:
            undo_loaders()
            for name in ("synchronize", "step"):
                if name in own:
                    setattr(optimizer, name, own[name])
                else:
                    delattr(optimizer, name)

        return undo

    def doctor_on() -> Any:
        """The hang doctor's rank side (noting each collective, the watcher thread)."""
        hang.install()
        return hang.stop

    if args.what == "hang":
        os.environ[envvars.HANG_DIR] = tempfile.mkdtemp(prefix="hvdkit-bench-hang-")
        hang.stop()  # off until a round puts it on (hvdkit run's ranks start with it)

    def timed_round(profiled: bool) -> float:
        on = doctor_on if args.what == "hang" else hooks_on
        undo = on() if profiled else (lambda: None)
        try:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")
            # Each step from one batch's arrival to the next's, so the loader's (profiled)
            # wait is in it; the first batch's fetch, the loader's start, is not.
            stamps = []
            for x, y in DataLoader(data, batch_size=args.batch_size):
                stamps.append(time.perf_counter())
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            stamps.append(time.perf_counter())
            return round_rate(args.batch_size, [b - a for a, b in itertools.pairwise(stamps)])
        finally:
            undo()

    timed_round(False), timed_round(True)  # warm-up: connections, allocator
    ratios = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 else (False, True)
        rates = {profiled: timed_round(profiled) for profiled in order}
        ratios.append(rates[True] / rates[False])
    if hvd.rank() == 0:
        emit({"ranks": hvd.size(), "rounds": args.rounds, "steps": args.steps, "what": args.what,
              "ratio": statistics.median(ratios), "recorded": len(recorder.steps)})  # fmt: skip


if __name__ == "__main__":
    main()
