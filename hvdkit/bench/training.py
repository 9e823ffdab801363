"""Training throughput, one process per rank: ``python -m hvdkit.bench.training``.

The same model and synthetic batch, trained by several variants side by side in the same
processes, in interleaved rounds so the machine's drift hits all of them alike:

- ``plain``: no communication at all, the compute alone (the weak-scaling baseline);
- ``hvdkit``: :func:`hvdkit.torch.setup`, stepping with the session's ``backward_and_step``
  (so its own per-step work is in the measurement);
- ``horovod``: the same steps wired by hand with ``horovod.torch``, as Horovod's examples do;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over torch.distributed gloo;
- with ``--threads-variant-for MODEL``, hvdkit with torch's default thread count instead
  of the per-rank share, paired with hvdkit in rounds of its own: what pinning is worth.

``--amp`` (bf16 autocast) and ``--channels-last`` train every variant that way: on a GPU,
ResNet-50 so is the adapter-against-plain-loop check.

The main variants run with the same threads per rank (``HVDKIT_BENCH_THREADS``). With more
than one rank it also times one allreduce of the model's gradient bytes, for the no-overlap
bound. Rank 0 prints samples/s per rank for each variant and round.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial
from typing import Any

from hvdkit import envvars
from hvdkit.bench.worker import clock, emit, pinned_threads, round_rate, timed_rounds

VARIANTS = ("plain", "hvdkit", "horovod", "ddp")
INPUTS = {"cnn": (1, 28), "mlp": (1, 28), "resnet18": (3, 32), "resnet50": (3, 224)}


class Variant:
    """One copy of the model and optimizer, wired for one variant, and its training step."""

    def __init__(self, kind: str, model_name: str, batch_size: int, device: Any, threads: int,
                 amp: bool = False, channels_last: bool = False) -> None:  # fmt: skip
        import horovod.torch as horovod
        import torch

        import hvdkit.torch as hvdkit_torch
        from hvdkit.models import MODELS

        torch.manual_seed(0)
        channels, side = INPUTS[model_name]
        extra = {} if model_name == "mlp" else {"in_channels": channels}
        model = MODELS[model_name](classes=10, **extra).to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in its stubs
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.session: Any = None  # hvdkit.torch.Session
        if kind.startswith("hvdkit"):
            self.session = hvdkit_torch.setup(model, optimizer)  # the six steps, no checkpoint
            model, optimizer = self.session.model, self.session.optimizer
        elif kind == "horovod":
            for group in optimizer.param_groups:
                group["lr"] *= horovod.size()
            optimizer = horovod.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters()
            )
            horovod.broadcast_parameters(model.state_dict(), root_rank=0)
            horovod.broadcast_optimizer_state(optimizer, root_rank=0)
        elif kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.kind, self.model, self.optimizer, self.threads = kind, model, optimizer, threads
        self.autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=amp)
        generator = torch.Generator().manual_seed(horovod.rank())
        self.x = torch.randn(batch_size, channels, side, side, generator=generator).to(device)
        if channels_last:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (batch_size,), generator=generator).to(device)

    def step(self) -> None:
        import torch.nn.functional as F  # noqa: N812 - torch's own spelling

        self.optimizer.zero_grad()
        with self.autocast():
            loss = F.cross_entropy(self.model(self.x), self.y)
        if self.session is not None:
            self.session.backward_and_step(loss)
            return
        loss.backward()
        self.optimizer.step()

    def samples_per_second(self, steps: int, barrier: Callable[[], Any]) -> float:
        """One round: ``steps`` steps, each timed (see :func:`round_rate`)."""
        import torch

        torch.set_num_threads(self.threads)
        barrier()
        seconds = []
        for _ in range(steps):
            start = clock()
            self.step()
            if self.x.is_cuda:  # a step's time is when its kernels are done
                torch.cuda.synchronize()
            seconds.append(clock() - start)
        return round_rate(len(self.y), seconds)


def gradient_allreduce_seconds(params: int, repeats: int = 5) -> float:
    """One Horovod allreduce of a float32 tensor the size of all gradients (slowest rank)."""
    import horovod.torch as hvd
    import torch

    tensor = torch.ones(params)
    hvd.allreduce_(tensor, name="bench.grads")
    hvd.allreduce(torch.zeros(1), name="bench.barrier")
    start = clock()
    for _ in range(repeats):
        hvd.allreduce_(tensor, name="bench.grads")
    seconds = (clock() - start) / repeats
    return hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="bench.slowest").item()


def parse_spec(text: str) -> tuple[str, int, int, int]:
    """``MODEL:BATCH:STEPS:ROUNDS`` -> its parts."""
    model, batch, steps, rounds = text.split(":")
    if model not in INPUTS:
        raise ValueError(f"unknown model {model!r}")
    return model, int(batch), int(steps), int(rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", action="append", type=parse_spec, required=True,
                        help="MODEL:BATCH:STEPS:ROUNDS, batch per rank (repeatable)")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads-variant-for", default="", metavar="MODEL,...",
                        help="also time hvdkit with torch's default threads")  # fmt: skip
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args(argv)
    if args.channels_last and "horovod" in args.variants.split(","):
        parser.error("--channels-last: Horovod by hand refuses channels_last tensors in its "
                     "broadcast (an edge hvdkit fixes); leave out the horovod variant")  # fmt: skip

    import torch

    default_threads = torch.get_num_threads()
    import horovod.torch as hvd

    hvd.init()
    threads = pinned_threads(hvd.local_size())
    torch.set_num_threads(threads)
    variants = args.variants.split(",")
    if "ddp" in variants:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ[envvars.BENCH_MASTER]}",
            rank=hvd.rank(),
            world_size=hvd.size(),
        )
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank())

    def barrier() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        hvd.allreduce(torch.zeros(1), name="bench.barrier")

    for model, batch_size, steps, rounds in args.spec:
        precision = {"amp": args.amp, "channels_last": args.channels_last}
        runners = {kind: Variant(kind, model, batch_size, device, threads, **precision)
                   for kind in variants}  # fmt: skip
        for runner in runners.values():
            runner.samples_per_second(1, barrier)  # warm-up: allocations, first allreduces
        rates = timed_rounds(
            {kind: partial(r.samples_per_second, steps, barrier) for kind, r in runners.items()},
            rounds,
        )
        threads_pair = None
        if model in args.threads_variant_for.split(",") and "hvdkit" in runners:
            # Paired with hvdkit in rounds of their own: torch's idle OpenMP threads keep
            # spinning for a while after a many-thread step and would slow whichever variant
            # ran next in the main rounds.
            extra = Variant("hvdkit", model, batch_size, device, default_threads, **precision)
            extra.samples_per_second(1, barrier)
            threads_pair = timed_rounds(
                {"hvdkit": partial(runners["hvdkit"].samples_per_second, steps, barrier),
                 "hvdkit-default-threads": partial(extra.samples_per_second, steps, barrier)},
                rounds,
            )  # fmt: skip
        params = sum(p.numel() for p in runners[variants[0]].model.parameters())
        torch.set_num_threads(threads)
        result = {
            "model": model,
            "ranks": hvd.size(),
            "batch_size": batch_size,
            "params": params,
            "threads": threads,
            "default_threads": default_threads,
            "device": device.type,
            **precision,
            "samples_per_s": rates,
            "threads_pair": threads_pair,
            "grad_allreduce_s": gradient_allreduce_seconds(params) if hvd.size() > 1 else 0.0,
        }
        emit(result)
    if "ddp" in variants:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
