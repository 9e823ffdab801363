"""A job whose data set reads slowly: the seed article's lesson, measured with --profile.

    hvdkit run -np 2 --profile -- python examples/pytorch_slow_input.py --workers 0
    hvdkit run -np 2 --profile -- python examples/pytorch_slow_input.py --workers 2

Each sample costs ``--latency-ms`` of waiting, as reading a file from a network file system or
an object store does (a sleep: the CPU is free meanwhile, as it is while I/O is in flight).
Loaded in the training process (``--workers 0``) every step waits for its batch, and
``--profile`` says input-bound; loaded by loader worker processes, the batches are ready when
the step wants them. Prints the throughput at the end. ``--slow-rank R`` makes one rank compute
longer each step, as a slower or shared host would: ``--profile`` names it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import hvdkit.torch as hvd
from hvdkit.models import mlp


class SlowDigits(Dataset):
    """Random 28x28 "images" whose every read waits ``latency`` seconds."""

    def __init__(self, count: int, latency: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 1, 28, 28, generator=generator)
        self.y = torch.randint(0, 10, (count,), generator=generator)
        self.latency = latency

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.latency)  # the read
        return self.x[index], self.y[index]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes")
    parser.add_argument("--latency-ms", type=float, default=1.0, help="per sample read")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=None, help="a rank that computes longer")
    parser.add_argument("--slow-ms", type=float, default=20.0, help="its extra time per step")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = mlp()
    session = hvd.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = SlowDigits(args.samples, args.latency_ms / 1000)
    loader = session.shard(data, batch_size=args.batch_size, num_workers=args.workers)
    started, seen = time.perf_counter(), 0
    for _ in session.epochs(args.epochs):
        for x, y in loader:
            if session.rank == args.slow_rank:  # a slower host, or one shared with another job
                time.sleep(args.slow_ms / 1000)
            session.optimizer.zero_grad(set_to_none=True)
            session.backward_and_step(F.cross_entropy(session.model(x), y))
            seen += len(y) * session.size
    rate = seen / (time.perf_counter() - started)
    session.print(f"{args.workers} loader workers: {rate:.0f} samples/s over {session.size} ranks")
    return rate


if __name__ == "__main__":
    main()
