"""``SyncBatchNorm`` on CPU too: Horovod's runs on GPUs only (``SyncBatchNorm expected input
tensor to be on GPU``); on a CPU the statistics of the global batch are computed here from one
differentiable allreduce of each rank's per-channel sums, sums of squares and counts."""

from __future__ import annotations

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from horovod.torch.sync_batch_norm import SyncBatchNorm as _HorovodSyncBatchNorm


class SyncBatchNorm(_HorovodSyncBatchNorm):
    """Horovod's ``SyncBatchNorm`` (same arguments): in training, batch statistics over the
    global batch (every rank's rows), so N ranks with B rows each normalise as one process with
    N * B rows. CUDA inputs take Horovod's kernel; CPU inputs (contiguous or channels_last) a
    differentiable allreduce of per-channel sums."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        if input.is_cuda or hvd.size() == 1:
            return super().forward(input) if input.is_cuda else self._run_bn(input)
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return self._run_bn(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = hvd.allreduce(local, op=hvd.Sum, name="hvdkit.sync_bn")
        c = self.num_features
        n = total[-1]
        mean = total[:c] / n
        var = total[c : 2 * c] / n - mean * mean
        if self.training and self.track_running_stats:
            momentum = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
            with torch.no_grad():
                unbiased = var * (n / max(float(n) - 1.0, 1.0))
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
