"""The seam matrix's oracle: tests/workers/seams_worker.py's job computed in one process, plain
torch, from the job's definition alone (the data, the model, the epochs' orders, where a run
stopped and at which world size it went on). No hvdkit code computes it.

One process reproduces R ranks exactly where the arithmetic allows: each rank's micro-batch
loss is the mean over its rows, Horovod averages the ranks' gradients, and accumulation sums
the passes; so the step's gradient is the sum over passes of the mean over ranks, which one
process gets by back-propagating ``sum(rank means) / R`` pass after pass. The LR in force is
the scheduler's times the warmup multiplier towards R (``lr_scaling="size"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling


@dataclass(frozen=True)
class Segment:
    """A run at ``size`` ranks, until it stopped after optimizer step ``until`` (None: to the
    end of training)."""

    size: int
    until: int | None = None


@dataclass
class Job:
    epochs: int = 2
    batch: int = 8
    accumulate: int = 1
    scheduler: bool = False
    warmup_steps: int = 0
    segments: list[Segment] = field(default_factory=lambda: [Segment(2)])
    lr: float = 0.05
    amp: bool = False  # bf16 autocast for the forward pass, gradients clipped to norm 1
    compression: str = "none"  # "fp16"/"bf16": each rank's gradient and their mean in it
    op: str = "average"  # "sum": the ranks' gradients summed, the LR not scaled
    elastic: bool = False
    optimizer: str = "sgd"  # "adam", "adamw": see OPTIMIZERS


OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
}
"""The job's optimizer by name: the worker builds the same one."""


def order(length: int, epoch: int, seed: int = 0) -> list[int]:
    """``DistributedSampler``'s shuffled order of an epoch (``seed + epoch``)."""
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def split(rest: list[int], size: int) -> list[list[int]]:
    """Each rank's rows of what is left of an epoch, padded to the same count."""
    if len(rest) % size:
        rest = rest + (rest * size)[: size - len(rest) % size]
    return [rest[r::size] for r in range(size)]


def multiplier(step: int, factor: int, warmup: int) -> float:
    """Linear warmup from 1x to ``factor``x over ``warmup`` steps (reached at step ``warmup``)."""
    return float(factor) if not warmup else 1 + (factor - 1) * min(1.0, step / warmup)


def run(job: Job, dataset, model: torch.nn.Module) -> dict:
    """Train ``model`` as the job's ranks would; the final weights (flat), LR in force, steps,
    and for each epoch every sample index trained (with multiplicity)."""
    opt = OPTIMIZERS[job.optimizer](model.parameters(), job.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if job.scheduler else None
    params = list(model.parameters())
    segments = list(job.segments)
    step = micro = 0
    trained: dict[int, list[int]] = {}
    # Each rank's gradient, summed over the passes of the step (Horovod accumulates locally).
    accumulated: list[list[torch.Tensor]] = []

    def factor() -> int:
        return 1 if job.op == "sum" else segments[0].size

    def optimizer_step() -> None:
        nonlocal step, micro
        # Horovod's optimizer reduces nothing at size 1 (it registers no hooks there, so its
        # synchronize() has no parameters to send) unless the job is elastic.
        compress = job.compression != "none" and (len(accumulated) > 1 or job.elastic)
        dtype = torch.bfloat16 if job.compression == "bf16" else torch.float16
        wire = [[g.to(dtype).float() if compress else g for g in rank] for rank in accumulated]
        for i, p in enumerate(params):
            total = torch.stack([rank[i] for rank in wire]).sum(0)
            if compress and job.compression == "fp16":  # Horovod sums in float16
                total = total.half().float()
            total = total if job.op == "sum" else total / len(wire)
            if compress and job.compression == "bf16":  # hvdkit sums in float32, rounds once
                total = total.bfloat16().float()
            p.grad = total
        if job.amp:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        base = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = base * multiplier(step, factor(), job.warmup_steps)
        opt.step()
        opt.param_groups[0]["lr"] = base
        accumulated.clear()
        step, micro = step + 1, 0

    for epoch in range(job.epochs):
        epoch_order, done = order(len(dataset), epoch), 0
        trained[epoch] = []
        while True:  # a pass: from the epoch's start, or from where a stopped run left it
            size = segments[0].size
            rows = split(epoch_order[done:], size)
            stopped = False
            for k in range(0, len(rows[0]), job.batch):
                if not accumulated:
                    accumulated.extend([torch.zeros_like(p) for p in params] for _ in range(size))
                for r in range(size):
                    batch = rows[r][k : k + job.batch]
                    trained[epoch] += batch
                    x = torch.stack([dataset[i][0] for i in batch])
                    y = torch.stack([dataset[i][1] for i in batch])
                    model.zero_grad()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=job.amp):
                        loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    for acc, p in zip(accumulated[r], params, strict=True):
                        acc += p.grad
                done += job.batch * size
                micro += 1
                if micro == job.accumulate:
                    optimizer_step()
                    if segments[0].until == step:
                        segments.pop(0)
                        stopped = True
                        break
            if not stopped:
                break
        if micro:  # the epoch's last passes step on their own
            optimizer_step()
            if segments[0].until == step:
                segments.pop(0)
        if sched is not None:
            sched.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
    lr = opt.param_groups[0]["lr"] * multiplier(step, factor(), job.warmup_steps)
    return {"weights": weights.tolist(), "lr_in_force": lr, "steps": step, "trained": trained}
