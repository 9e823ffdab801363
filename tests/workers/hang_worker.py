"""Run by tests/test_hang.py under `hvdkit run --stall-timeout`: a Horovod-style torch loop
(the drop-in module, its own DataLoader) in which rank 1 goes wrong one of the usual ways.

- ``fewer``: rank 1 has one batch fewer, then averages its last loss (a collective) while
  rank 0 waits for its last step's gradients;
- ``data``: rank 1's data set never returns its third batch (``slow``: returns it 8 s late);
- ``lock``: rank 1 waits at its third step on a lock another thread never releases;
- ``names``: the ranks average a metric under names of their own (``metric.0``, ``metric.1``);
- ``shapes``, ``dtypes``: the ranks average one tensor in shapes (dtypes) of their own;
- ``killed``: rank 1 is SIGKILLed at its third step; ``long``: 60 steps of 0.25 s, a file
  (argv[2]) made at the third, for a test to take a host away.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own name
from torch.utils.data import DataLoader, Dataset

import hvdkit.torch as hvd

CASE = sys.argv[1]
BATCHES = 4


class Samples(Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 8 * (60 if CASE == "long" else BATCHES - (CASE == "fewer" and self.rank == 1))

    def __getitem__(self, i: int):
        if CASE in ("data", "slow") and self.rank == 1 and i == 16:
            time.sleep(3600 if CASE == "data" else 8)  # a read that never returns, or late
        return torch.full((4,), float(i % 5)), torch.tensor(i % 2)


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    held = threading.Lock()
    if CASE == "lock" and rank == 1:
        threading.Thread(target=held.acquire, daemon=True).start()  # taken, never given back
        time.sleep(0.5)
    loss = torch.zeros(())
    for step, (x, y) in enumerate(DataLoader(Samples(rank), batch_size=8)):
        if CASE == "lock" and rank == 1 and step == 2:
            held.acquire()  # waits for ever
        if CASE == "killed" and rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as a host's loss takes its ranks
        if CASE == "long":  # a job long enough to lose a host in (marker: step 2 reached)
            time.sleep(0.25)
            if step == 2 and len(sys.argv) > 2:
                open(sys.argv[2], "a").close()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    name = f"metric.{rank}" if CASE == "names" else "metric"
    if CASE == "shapes":  # one tensor, a shape of each rank's own
        hvd.allreduce(torch.zeros(rank + 2), name=name)
    if CASE == "dtypes":
        hvd.allreduce(torch.zeros(3, dtype=(torch.float32, torch.float64)[rank]), name=name)
    hvd.allreduce(loss.detach(), name=name)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print("RESULT " + json.dumps({"rank": rank, "digest": digest.hexdigest()}), flush=True)


main()
