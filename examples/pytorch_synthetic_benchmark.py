"""Synthetic-data training throughput with hvdkit.torch: images/s per rank and in total.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py \\
        --model resnet18 --image-size 32 --batch-size 32

``--compare`` times hvdkit.torch.setup() against the same model wired by hand with
horovod.torch (DistributedOptimizer + broadcasts), interleaved in one run, and prints the ratio.
On a GPU: ``--model resnet50 --batch-size 256 --amp --channels-last``.
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as horovod
import torch
import torch.nn.functional as F

import hvdkit.torch as hvd
from hvdkit.models import MODELS
from hvdkit.rank_zero import print0


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {} if args.model == "mlp" else {"classes": 1000 if args.model == "resnet50" else 10}
    model = MODELS[args.model](**kwargs).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (
        (args.batch_size, 1, 28, 28)
        if args.model == "mlp"
        else (args.batch_size, 3, args.image_size, args.image_size)
    )
    x = torch.randn(shape, device=device)
    if args.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    classes = 1000 if args.model == "resnet50" else 10
    return x, torch.randint(0, classes, (args.batch_size,), device=device)


class Runner:
    """One model + optimizer and how to take a training step with it."""

    def __init__(self, args: argparse.Namespace, kind: str, device: torch.device) -> None:
        self.args, self.kind = args, kind
        model = build(args, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if kind == "hvdkit":
            # hvdkit step 1: init Horovod; step 2: pin the GPU (or the CPU threads);
            # hvdkit step 3: wrap the optimizer; step 6: scale the LR by size (no warmup);
            # hvdkit step 4: broadcast from rank 0; step 5: none (a benchmark saves nothing).
            self.session = hvd.setup(model, optimizer)
            self.model, self.optimizer = self.session.model, self.session.optimizer
        else:
            # The same steps wired by hand with horovod.torch, as its examples do.
            horovod.init()  # hvdkit step 1 (step 2: the device main() chose)
            for group in optimizer.param_groups:
                group["lr"] *= horovod.size()  # hvdkit step 6
            optimizer = horovod.DistributedOptimizer(  # hvdkit step 3
                optimizer, named_parameters=model.named_parameters()
            )
            # hvdkit step 4 (step 5: none). Horovod's broadcast refuses channels_last tensors.
            if not args.channels_last:
                horovod.broadcast_parameters(model.state_dict(), root_rank=0)
                horovod.broadcast_optimizer_state(optimizer, root_rank=0)
            self.model, self.optimizer = model, optimizer
        self.data = batch(args, device)
        self.device = device

    def step(self) -> None:
        x, y = self.data
        self.optimizer.zero_grad()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.amp):
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def images_per_second(self, batches: int) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batches):
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self.args.batch_size * batches / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also time hand-written horovod.torch, interleaved, and print the ratio",
    )
    args = parser.parse_args(argv)

    hvd.init()  # hvdkit step 1, here already: the device below needs the local rank
    # hvdkit step 2 for both runners: one GPU per process by local rank.
    device = (
        torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    )
    kinds = ["hvdkit", "horovod"] if args.compare else ["hvdkit"]
    runners = {kind: Runner(args, kind, device) for kind in kinds}
    print0(
        f"model {args.model}, batch {args.batch_size} per rank, {hvd.size()} ranks, "
        f"device {device.type}, amp {args.amp}, channels_last {args.channels_last}"
    )
    for runner in runners.values():
        runner.images_per_second(args.num_warmup_batches)
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.num_iters):
        for kind, runner in runners.items():  # interleaved, so drift hits both alike
            rates[kind].append(runner.images_per_second(args.num_batches_per_iter))
    result = {}
    for kind, values in rates.items():
        per_rank = sum(values) / len(values)
        total = hvd.allreduce(torch.tensor(per_rank), op=hvd.Sum, name=f"bench.{kind}").item()
        result[kind] = total
        print0(f"{kind}: {per_rank:.1f} images/s per rank, {total:.1f} images/s total")
    if args.compare:
        print0(f"ratio hvdkit / hand-written horovod: {result['hvdkit'] / result['horovod']:.3f}")
    return result


if __name__ == "__main__":
    main()
