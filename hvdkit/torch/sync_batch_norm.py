"""``SyncBatchNorm`` on CPU too: Horovod's runs on GPUs only (``SyncBatchNorm expected input
tensor to be on GPU``); on a CPU the statistics of the global batch are computed here from one
differentiable allreduce of each rank's per-channel counts, means and spreads."""

from __future__ import annotations

import horovod.torch as hvd
import torch
from horovod.torch.sync_batch_norm import SyncBatchNorm as _HorovodSyncBatchNorm
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_HorovodSyncBatchNorm):
    """Horovod's ``SyncBatchNorm`` (same arguments): in training, batch statistics over the
    global batch (every rank's rows), so N ranks with B rows each normalise as one process with
    N * B rows. CUDA inputs take Horovod's kernel; CPU inputs (contiguous or channels_last,
    which stays channels_last) a differentiable allreduce. With one process it is torch's
    ``BatchNorm`` (``momentum=None`` included)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        if input.is_cuda:
            return super().forward(input)
        self._check_input_dim(input)
        if hvd.size() == 1 or (not self.training and self.track_running_stats):
            return _BatchNorm.forward(self, input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1  # type: ignore[has-type]
        # Half and bfloat16 inputs: statistics in float32, as torch's CPU kernel does.
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        mean, var, n = _global_moments(x)
        if self.training and self.track_running_stats:
            momentum = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
            with torch.no_grad():
                unbiased = var * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.to(self.running_mean))
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased.to(self.running_var))
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape).to(x.dtype) + self.bias.view(shape).to(x.dtype)
        return out.to(input.dtype)


def _global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-channel mean and (biased) variance over every rank's rows, and the row count.

    Each rank contributes its count n_i, its sum n_i * m_i, its spread M2_i = n_i * var_i
    (from torch's own ``var_mean``) and n_i * m_i^2; one allreduce in float64 sums them and
    M2 = sum M2_i + (sum n_i m_i^2 - n * mean^2) (Chan et al.). Unlike E[x^2] - mean^2 in the
    input's precision, this does not lose the variance when the mean is large next to the
    spread (float32 inputs around 300 with std 0.5 lost 6% of the normalised output so).
    Differentiable: the allreduce's gradient is again a sum over ranks (``_SumOverRanks``)."""
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    rows = x.numel() // c if c else 0
    if rows:
        var_i, mean_i = torch.var_mean(x, dim=dims, correction=0)
    else:  # this rank has no rows: it contributes nothing (but still takes part)
        mean_i = var_i = x.sum(dims)
    n_i = torch.full((1,), float(rows), dtype=torch.float64)
    mean_i, var_i = mean_i.double(), var_i.double()
    local = torch.cat([mean_i * rows, var_i * rows, mean_i * mean_i * rows, n_i])
    total = _SumOverRanks.apply(local)
    n = total[-1]
    mean = total[:c] / n
    m2 = total[c : 2 * c] + (total[2 * c : 3 * c] - n * mean * mean)
    var = (m2 / n).clamp_min(0.0)
    return mean.to(x.dtype), var.to(x.dtype), float(n.detach())


class _SumOverRanks(torch.autograd.Function):
    """Sum over ranks, whose gradient is the sum over ranks of the gradients: Horovod's
    ``allreduce`` autograd, but with the backward op *named*. Horovod names an unnamed op after
    its handle number, a per-process counter, so once the ranks have made different numbers of
    Horovod calls (a rank that did one more step before ``join()``, an op in a process set of
    some ranks only) an unnamed op gets a different name on each rank and waits forever.
    The ops are synchronous, one at a time, so fixed names are safe (Horovod's own CUDA
    ``SyncBatchNorm`` uses fixed names too)."""

    @staticmethod
    def forward(ctx: object, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Sum, name="hvdkit.sync_bn.stats")

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum, name="hvdkit.sync_bn.stats_grad")
