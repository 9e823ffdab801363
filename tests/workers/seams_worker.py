"""One job of the seam matrix (tests/test_seams.py): hvdkit.torch's documented session loop with
the features the command line turns on, for comparison with tests/seams.py's oracle.

Every rank appends the sample indices of each micro-batch it trains to ``--log/rank<R>.jsonl``
(so coverage can be checked across a preempted run and its resume) and, when it finishes,
prints a RESULT line: the flattened weights, the LR in force for the next step, the
scheduler's LR, the optimizer steps and the position.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch.utils.data import Dataset

import hvdkit.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the oracle's table
from seams import OPTIMIZERS

SAMPLES, FEATURES, CLASSES = 96, 8, 3


class Indexed(Dataset):
    """``SAMPLES`` rows made from a fixed seed, with their index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--checkpoint")
    parser.add_argument("--preempt-at", type=int, default=0, help="SIGUSR1 after this step")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--plain-loop", action="store_true", help="for epoch in range(n)")
    parser.add_argument("--rank0-saves", action="store_true", help="save under rank == 0")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast, clip to norm 1")
    parser.add_argument("--scaler", action="store_true",
                        help="fp16 autocast with a GradScaler that starts too high, clip to 1")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--op", default="average")
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--commit", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=0, help="elastic: SIGKILL at this step")
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--marker", help="elastic: the file that says the kill happened")
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    parser.add_argument("--shard-optimizer", nargs="?", const=True, default=False,
                        help="ZeRO stage 1; 'gradients': stage 2")  # fmt: skip
    parser.add_argument("--bucket", type=int, help="ZeRO's bucket size, in elements")
    parser.add_argument("--log", required=True)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    """The job on this rank (Horovod started or not), and what its RESULT line reports. Also
    called inside the ranks of one job (tests/ranked/test_zero_oracle.py)."""
    if args.bucket:  # several buckets for this small model, each sent during the backward pass
        from hvdkit.torch import zero

        zero.BUCKET = args.bucket
    model = make_model()
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), 0.05)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if args.scheduler
        else None
    )
    session = hvd.setup(
        model,
        optimizer,
        scheduler=scheduler,
        checkpoint=args.checkpoint,
        warmup_steps=args.warmup_steps,
        backward_passes_per_step=args.accumulate,
        compression=args.compression,
        op=args.op,
        lr_scaling="none" if args.op == "sum" else "size",
        elastic=args.elastic,
        commit_every=args.commit,
        shard_optimizer=args.shard_optimizer,
    )
    step_options: dict = {"clip_grad_norm": 1.0} if args.amp or args.scaler else {}
    scaler = None
    if args.scaler:  # overflows at first: steps skipped, the scale backed off, then grown
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)
        step_options["scaler"] = scaler
    amp_dtype = torch.float16 if args.scaler else torch.bfloat16
    resets: list[list[int]] = []  # elastic: [step, size] after each reset
    generation = 0
    loader = session.shard(Indexed(), batch_size=args.batch)
    log = Path(args.log) / f"rank{session.rank}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    epochs = range(args.epochs) if args.plain_loop else session.epochs(args.epochs)
    for _ in epochs:
        for xb, yb, index in loader:
            if args.elastic and session._elastic.generation != generation:  # reset before it
                generation = session._elastic.generation
                resets.append([session.step_count, session.size])
            if (
                args.kill_at
                and session.step_count == args.kill_at
                and session.position.micro_step == 0
            ):
                marker = Path(args.marker)
                if os.environ.get("HOROVOD_HOSTNAME") == args.kill_host and not marker.exists():
                    marker.write_text(json.dumps({"time": time.time(), "step": args.kill_at}))
                    os.kill(os.getpid(), signal.SIGKILL)
            # Logged before the step: a preemption stops the job right after it.
            with log.open("a") as fh:
                fh.write(json.dumps({"epoch": session.epoch, "size": session.size,
                                     "indices": index.tolist()}) + "\n")  # fmt: skip
            session.optimizer.zero_grad()  # the documented loop, accumulation or not
            with torch.autocast("cpu", dtype=amp_dtype, enabled=args.amp or args.scaler):
                loss = F.cross_entropy(session.model(xb), yb)
            session.backward_and_step(loss, **step_options)
            if args.preempt_at and session.step_count == args.preempt_at and session.rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler's warning to one rank
            time.sleep(args.step_delay)
        if scheduler is not None:
            scheduler.step()
        if args.rank0_saves:
            if session.rank == 0:  # a Horovod habit: save() is collective in hvdkit
                session.save()
        elif args.checkpoint and not args.plain_loop:
            session.save()
    weights = torch.cat([p.detach().reshape(-1) for p in session.model.state_dict().values()])
    return {
        "rank": session.rank, "size": session.size, "steps": session.step_count,
        "weights": [float(f"{w:.9g}") for w in weights.tolist()],
        "lr_in_force": session.optimizer.param_groups[0]["lr"] * session.lr_multiplier(),
        "scheduler_lr": scheduler.get_last_lr()[0] if scheduler is not None else None,
        "position": getattr(session, "position", None) and session.position.state_dict(),
        "resets": resets, "scale": scaler.get_scale() if scaler is not None else None,
    }  # fmt: skip


def main() -> None:
    print("RESULT " + json.dumps(train(parse())), flush=True)


if __name__ == "__main__":
    main()
