"""An elastic training job for tests/test_elastic.py: ``hvdkit run --min-np ...`` starts it.

The worker on host ``--kill-host`` SIGKILLs itself before step ``--kill-at`` (once: a marker
file remembers it), so the survivors must restore the last commit and go on. Every rank that
finishes prints a RESULT line: its final step, how many steps this process executed (the
excess over ``--steps`` on a rank that ran from the start is what the kill cost), the world
sizes it saw, a digest of its weights, and when its first step after each reset ended.
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
from torch.utils.data import DataLoader, TensorDataset

import hvdkit.torch as hvd
from hvdkit.torch import elastic


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--commit", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=17)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--signal", default="SIGKILL")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--print-netns", action="store_true", help="add the network namespace")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(hvd.rank())  # different on purpose: the first sync must equalise them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    dataset = TensorDataset(x, x.sum(1, keepdim=True).sin())
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    state = elastic.TorchState(model, optimizer, scheduler=scheduler, sampler=sampler, step=0)
    seen = {"executed": 0, "sizes": [], "recovered": [], "pending": False}
    state.register_reset_callbacks([lambda: seen.update(pending=True)])
    marker = Path(args.marker)

    @elastic.run
    def train(state):
        seen["sizes"].append(hvd.size())
        while state.step < args.steps:
            for batch, (xb, yb) in enumerate(loader):
                if state.step >= args.steps:
                    break
                if (
                    state.step == args.kill_at
                    and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host
                    and not marker.exists()
                ):
                    marker.write_text(json.dumps({"time": time.time(), "step": state.step}))
                    os.kill(os.getpid(), getattr(signal, args.signal))
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                optimizer.step()
                scheduler.step()
                seen["executed"] += 1
                state.step += 1
                sampler.record_batch(batch, loader.batch_size)
                if seen["pending"]:  # the first step after a reset has ended
                    seen["recovered"].append(time.time())
                    seen["pending"] = False
                time.sleep(args.sleep)
                if state.step % args.commit == 0:
                    state.commit()
            else:
                sampler.set_epoch(sampler.epoch + 1)
                state.commit()

    train(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
    emit(
        size=hvd.size(),
        step=state.step,
        executed=seen["executed"],
        sizes=seen["sizes"],
        recovered=seen["recovered"],
        lr=optimizer.param_groups[0]["lr"],
        digest=hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
        **({"netns": os.readlink("/proc/self/ns/net")} if args.print_netns else {}),
    )


if __name__ == "__main__":
    main()
