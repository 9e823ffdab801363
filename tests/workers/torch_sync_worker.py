"""Run under horovodrun by tests/test_torch_sync.py: the sync guard and lazy modules."""

from __future__ import annotations

import json
import sys

import torch

import hvdkit.torch as hvd
from hvdkit import rank_zero


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def diverge() -> None:
    """Ranks start from different seeds (setup broadcasts rank 0's), then rank 1 is pushed
    off after epoch 1: the guard stops the job at that epoch's end."""
    torch.manual_seed(rank_zero.rank())
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    session = hvd.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    for epoch in session.epochs(2):
        session.optimizer.zero_grad()
        session.backward_and_step(session.model(x).pow(2).mean())
        emit(epoch=epoch, passed_first_check=True)
        if hvd.rank() == 1:
            with torch.no_grad():
                session.model[2].weight.add_(0.5)


if __name__ == "__main__":
    {"diverge": diverge}[sys.argv[1]]()
