"""Run by tests/test_zero.py: Horovod's own loop with ``Compression.bf16`` through the drop-in
module. Each rank's gradient is chosen so that rounding to bf16 matters; one SGD step with
LR 1 leaves each parameter at minus the reduced gradient, which the test computes itself."""

from __future__ import annotations

import json

import torch

import hvdkit.torch as hvd

hvd.init()
weight = torch.nn.Parameter(torch.zeros(1001))  # odd: padded to the world size
bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # restored to float64
unused = torch.nn.Parameter(torch.zeros(2))  # no gradient on any rank: zeros, as Horovod
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD([weight, bias, unused], lr=1.0),
    named_parameters=[("weight", weight), ("bias", bias), ("unused", unused)],
    compression=hvd.Compression.bf16,
)
g = torch.Generator().manual_seed(hvd.rank())
target_w = torch.randn(1001, generator=g) * 10 ** torch.randint(-6, 3, (1001,), generator=g)
target_b = torch.randn(3, generator=g, dtype=torch.float64)
optimizer.zero_grad()
((weight * target_w).sum() + (bias * target_b).sum()).backward()
optimizer.step()
print("RESULT " + json.dumps({
    "rank": hvd.rank(), "weight": weight.detach().tolist(), "bias": bias.detach().tolist(),
    "unused": unused.detach().tolist(), "dtypes": [str(weight.dtype), str(bias.dtype)],
}), flush=True)  # fmt: skip
