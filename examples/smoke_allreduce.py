"""A 2-process smoke test of the stack: each rank holds a different shard of a data set,
and Horovod's allreduce turns the per-rank means into the global mean.

    horovodrun -np 2 -H localhost:2 --gloo python examples/smoke_allreduce.py

(`make run` does exactly this until the training demos land.)
"""

import horovod.torch as hvd
import torch

hvd.init()
data = torch.arange(1000, dtype=torch.float64)
shard = data[hvd.rank() :: hvd.size()]
# Weighting each rank's mean by its sample count gives the true mean even when shards differ.
local = torch.tensor([shard.sum().item(), float(shard.numel())], dtype=torch.float64)
total = hvd.allreduce(local, op=hvd.Sum, name="smoke")
global_mean = (total[0] / total[1]).item()
assert abs(global_mean - data.mean().item()) < 1e-9, (global_mean, data.mean().item())
print(
    f"rank {hvd.rank()}/{hvd.size()}: local mean {shard.mean().item():.2f}, "
    f"global mean {global_mean:.2f} (expected {data.mean().item():.2f})",
    flush=True,
)
hvd.shutdown()
