"""The PyTorch session's in-process checks, run inside the ranks of one job
(tests/in_ranks.py): each against one process on the global batch, and ranks against each
other. Moved from tests/test_torch_adapter.py, where each started its own job."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from ranked.conftest import same_on_every_rank
from workers.torch_worker import data, digest, flat, make_model, one_step_models


def test_one_step_np2_equals_np1_with_double_batch(horovod):
    """np=2 with per-rank batch B and LR scaled by size == np=1 with batch 2B and LR x 2."""
    model, ref = one_step_models()
    assert (flat(model) - flat(make_model(0))).abs().max().item() > 1e-3  # it moved
    assert (flat(model) - flat(ref)).abs().max().item() < 1e-6
    assert same_on_every_rank(horovod, digest(model))


def test_gradient_accumulation_matches_one_big_step(horovod):
    """backward_passes_per_step=2: two micro-batches per rank, one reduced step, equal to one
    single-process step over all four micro-batches (sum of per-micro-batch mean losses,
    averaged over ranks)."""
    hvd, b, lr = horovod, 4, 0.1
    x, y = data(2 * b * hvd.size(), seed=11)
    model = make_model(0)
    session = hvd.setup(
        model, torch.optim.SGD(model.parameters(), lr=lr), backward_passes_per_step=2
    )
    session.optimizer.zero_grad()
    for m in range(2):
        part = slice((2 * hvd.rank() + m) * b, (2 * hvd.rank() + m + 1) * b)
        F.cross_entropy(session.model(x[part]), y[part]).backward()
    session.optimizer.step()
    ref = make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr * hvd.size())
    parts = [slice(i * b, (i + 1) * b) for i in range(2 * hvd.size())]
    (sum(F.cross_entropy(ref(x[p]), y[p]) for p in parts) / hvd.size()).backward()
    ref_opt.step()
    assert (flat(session.model) - flat(ref)).abs().max().item() < 1e-6
    assert same_on_every_rank(hvd, digest(session.model))


def test_sharp_edges_fixed(horovod):
    """channels_last broadcast, fresh AdamW broadcast, zero_grad(set_to_none), AMP + clip."""
    hvd = horovod
    torch.manual_seed(hvd.rank())
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    hvd.broadcast_parameters(conv.state_dict(), root_rank=0)
    assert same_on_every_rank(hvd, conv.weight.detach().sum().item())  # channels_last worked

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    before = flat(lin).clone()
    adamw = torch.optim.AdamW(lin.parameters(), lr=0.1, weight_decay=0.5)
    hvd.broadcast_optimizer_state(adamw, root_rank=0)
    assert (flat(lin) - before).abs().max().item() == 0.0  # a fresh AdamW takes no step

    # Optimizer state that is channels_last (AdamW moments of the conv), broadcast from rank 0.
    opt = hvd.DistributedOptimizer(
        torch.optim.AdamW(conv.parameters(), lr=0.01), named_parameters=conv.named_parameters()
    )
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last) * (hvd.rank() + 1)
    conv(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in conv.parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    exp_avg = hashlib.sha256(
        b"".join(s["exp_avg"].contiguous().numpy().tobytes() for s in opt.state.values())
    ).hexdigest()
    assert same_on_every_rank(hvd, exp_avg)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = conv(x).float().square().mean() * 1e3
    norm = hvd.backward_and_step(loss, opt, scaler=scaler, clip_grad_norm=0.5)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in conv.parameters()]).item()
    assert clipped <= 0.5 + 1e-4 and float(norm) > 0.5
    assert same_on_every_rank(hvd, digest(conv))  # the AMP + clip step averaged across ranks


@pytest.mark.parametrize("when", ["before", "after"])
def test_warmup_reaches_size_times_lr_and_composes_with_scheduler(horovod, when):
    """Effective LR per step, read off SGD's update of a weight whose gradient is 1, with a
    scheduler made before setup() and given to it, and one made after it on the session's
    optimizer (which used to crash in torch's step check)."""
    hvd = horovod
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(w.weight)
        opt = torch.optim.SGD(w.parameters(), lr=0.1)
        if when == "before":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            session = hvd.setup(w, opt, scheduler=sched, warmup_steps=4)
        else:
            session = hvd.setup(w, opt, warmup_steps=4)
            sched = torch.optim.lr_scheduler.StepLR(session.optimizer, 3, gamma=0.5)
        lrs = []
        for _ in range(7):
            before = w.weight.item()
            session.optimizer.zero_grad()
            session.backward_and_step(w.weight.sum())
            sched.step()
            lrs.append(before - w.weight.item())
    # base LR 0.1 halved every 3 steps by StepLR; multiplier 1 -> size over 4 warmup steps.
    base = [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025]
    ramp = [1 + (hvd.size() - 1) * min(i / 4, 1) for i in range(7)]
    assert lrs == pytest.approx([b * m for b, m in zip(base, ramp, strict=True)])
    # Outside the step the group shows the scheduler's single-process LR.
    assert session.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    # torch's "lr_scheduler.step() before optimizer.step()" check sees the steps.
    assert [str(c.message) for c in caught if "lr_scheduler" in str(c.message)] == []


def test_metric_average_is_exact_on_unequal_shards(horovod):
    """Rank r holds r + 1 samples of value 10 * (r + 1): the mean weighs by samples."""
    hvd = horovod
    n = hvd.rank() + 1
    lin = torch.nn.Linear(1, 1)
    session = hvd.setup(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    want = sum(10.0 * (r + 1) * (r + 1) for r in range(hvd.size())) / sum(
        r + 1 for r in range(hvd.size())
    )
    assert session.average(10.0 * n * n, n) == pytest.approx(want)


def test_lazy_modules_get_a_clear_error_on_every_rank(horovod):
    torch.manual_seed(horovod.rank())
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError) as caught:
        horovod.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "uninitialized parameters of a lazy module" in str(caught.value)
    assert "run one forward pass" in str(caught.value)
    assert same_on_every_rank(horovod, True)  # every rank was told, none left waiting


def test_zero_with_buckets_summed_during_the_pass_equals_plain_and_refuses_a_pass_too_many(
    horovod, monkeypatch
):
    """ZeRO's buckets, many and at most one received at a time (each summed over the rank's
    own gradient as the next is sent), give the plain optimizer's step; a backward pass more
    than ``backward_passes_per_step`` would add onto a summed slice, and is refused with the
    fix on every rank (plain Horovod refuses it too)."""
    from hvdkit.torch import zero

    monkeypatch.setattr(zero, "BUCKET", 16)
    monkeypatch.setattr(zero, "IN_FLIGHT", 1)
    high = {"in": 0, "out": 0}  # elements sent and received in flight, at most
    send = zero._Group.send

    def watched(group: zero._Group, bucket: int) -> None:
        send(group, bucket)
        sent = sum(hi - lo for lo, hi in (group.buckets[b] for b in group.pending))
        high["in"] = max(high["in"], sent)
        high["out"] = max(high["out"], sum(out.numel() for _, out in group.pending.values()))

    monkeypatch.setattr(zero._Group, "send", watched)

    def trained(shard: bool | str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        session = horovod.setup(model, opt, shard_optimizer=shard, lr_scaling="none")
        gen = torch.Generator().manual_seed(10 + horovod.rank())
        for _ in range(3):
            session.optimizer.zero_grad()
            model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
            session.optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = trained(False)
    for stage in (True, "gradients"):  # stage 1, and stage 2 (each gradient let go once sent)
        for a, b in zip(trained(stage), plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # One bucket's worth each way, on every rank: also on one that owns none of a bucket
    # (it receives nothing, and once sent every bucket of the pass ahead of a slow peer).
    assert 0 < high["in"] <= 16 // horovod.size() and high["out"] <= 16, high

    for stage in (True, "gradients"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        horovod.setup(model, torch.optim.Adam(model.parameters()), shard_optimizer=stage)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        with pytest.raises(RuntimeError) as caught:
            model(torch.randn(4, 6)).pow(2).mean().backward()
        assert "backward_passes_per_step=" in str(caught.value)
        assert same_on_every_rank(horovod, True)
