"""An elastic six-step session for tests/test_elastic.py: ``hvdkit.torch.setup(...,
elastic=True)`` and the plain session loop, nothing else changed.

The worker on host ``--kill-host`` SIGKILLs itself before optimizer step ``--kill-at`` (once:
a marker file remembers it). Every rank that finishes prints a RESULT line: its step count,
the steps this process executed, the world sizes it saw, the LR multiplier in force, a digest
of its weights, when its first step after each reset ended, and, for the last epoch, every
sample index the ranks trained on (gathered) if this rank saw only one world size in it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

import hvdkit.torch as hvd


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--commit", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=17)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--sleep", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(int(os.environ.get("HOROVOD_RANK", "0")))  # the first sync equalises
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    # A scheduler across the recovery (issue 38): a restore must leave it driving the LR.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    session = hvd.setup(
        model, optimizer, scheduler=scheduler, elastic=True, commit_every=args.commit
    )
    loader = session.shard(Indexed(args.samples), batch_size=8)
    marker = Path(args.marker)
    seen = {"executed": 0, "sizes": [session.size], "recovered": []}
    generation = 0
    last_epoch: dict[str, list] = {"indices": [], "sizes": []}

    for epoch in session.epochs(args.epochs):
        last_epoch = {"indices": [], "sizes": [session.size]}
        for xb, yb, index in loader:
            if (
                session.step_count == args.kill_at
                and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host
                and not marker.exists()
            ):
                marker.write_text(json.dumps({"time": time.time(), "step": session.step_count}))
                os.kill(os.getpid(), signal.SIGKILL)
            before = session.step_count
            session.optimizer.zero_grad()
            session.backward_and_step(torch.nn.functional.mse_loss(session.model(xb), yb))
            if session.step_count == before + 1:  # else a worker was lost: batch dropped
                seen["executed"] += 1
                last_epoch["indices"] += index.tolist()
                if seen.pop("pending", False):
                    seen["recovered"].append(time.time())
            if session._elastic.generation != generation:  # the session was reset
                generation = session._elastic.generation
                seen["sizes"].append(session.size)
                last_epoch["sizes"].append(session.size)
                seen["pending"] = True
            time.sleep(args.sleep)
        scheduler.step()

    gathered = hvd.allgather_object(last_epoch["indices"], name="test.indices")
    flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
    print("RESULT " + json.dumps({
        "rank": session.rank, "size": session.size, "steps": session.step_count,
        "executed": seen["executed"], "sizes": seen["sizes"], "recovered": seen["recovered"],
        "multiplier": session.lr_multiplier(), "epoch": session.epoch,
        "lr_in_force": session.optimizer.param_groups[0]["lr"],
        "scheduler_lr": scheduler.get_last_lr()[0],
        "last_epoch_sizes": last_epoch["sizes"], "last_epoch_indices": gathered,
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
