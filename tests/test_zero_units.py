"""hvdkit.torch.zero's layout (pure): flat buffers padded to the world size, each rank an equal
slice, a single large tensor split across ranks."""

from __future__ import annotations

import pytest
import torch

from hvdkit.torch import zero
from hvdkit.torch.zero import Layout


@pytest.mark.parametrize("size", [1, 2, 3, 8])
@pytest.mark.parametrize("numels", [(128, 8, 24, 3), (1,), (1000,), (5, 0, 7)])
def test_every_element_is_owned_by_exactly_one_rank(numels, size):
    layout = Layout(numels, size)
    assert layout.total % size == 0 and layout.total >= sum(numels)
    assert layout.total - sum(numels) < size or sum(numels) == 0  # the least padding
    seen = {i: [0] * n for i, n in enumerate(numels)}
    for rank in range(size):
        start, end = layout.owned(rank)
        assert end - start == layout.shard
        at = start
        for i, lo, hi in layout.pieces(rank):
            assert layout.offsets[i] + lo == at  # the pieces are the slice, in order
            at += hi - lo
            for k in range(lo, hi):
                seen[i][k] += 1
        assert at <= end
    assert all(count == 1 for counts in seen.values() for count in counts)


def test_one_large_tensor_is_split_across_the_ranks():
    layout = Layout((1000, 10), 4)
    assert [layout.pieces(r) for r in range(4)] == [
        [(0, 0, 253)],
        [(0, 253, 506)],
        [(0, 506, 759)],
        [(0, 759, 1000), (1, 0, 10)],
    ]


def test_buckets_are_whole_parameters_last_first_and_splits_follow_ownership():
    layout = Layout((128, 16, 48, 3), 2)  # 195 elements, padded to 196: 98 a rank
    assert layout.buckets(64) == [(144, 196), (128, 144), (64, 128), (0, 64)]  # 128: cut
    assert layout.buckets(52) == [(144, 196), (128, 144), (76, 128), (24, 76), (0, 24)]
    assert layout.buckets(10**6) == [(0, 196)]
    assert layout.splits(144, 196) == [0, 52] and layout.splits(0, 144) == [98, 46]
    assert sum(sum(layout.splits(lo, hi)) for lo, hi in layout.buckets(7)) == layout.total


@pytest.mark.parametrize("limit", [1, 5, 16, 40, 129, 10**6])
@pytest.mark.parametrize("numels", [(128, 16, 48, 3), (1000,), (0, 7, 0, 300, 2), (), (3,) * 50])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_buckets_are_bounded_cover_the_buffer_and_cut_only_a_parameter_that_is_too_large(
    numels, size, limit
):
    """What a bucket's reduce-scatter receives is N copies of this rank's piece of it: a
    bucket of at most ``limit`` elements keeps that bounded however large one tensor is."""
    layout = Layout(numels, size)
    buckets = layout.buckets(limit)
    assert buckets[0][1] == layout.total and buckets[-1][0] == 0  # last first, contiguous
    assert all(prev[0] == nxt[1] for prev, nxt in zip(buckets, buckets[1:], strict=False))
    assert all(0 < hi - lo <= limit for lo, hi in buckets) or buckets == [(0, layout.total)]
    edges = {lo for lo, _ in buckets[:-1]}
    starts = set(layout.offsets)
    # A cut inside a parameter (not at its start, nor in the padding): only a large one.
    for edge in edges - starts - set(range(sum(numels), layout.total)):
        inside = [n for o, n in zip(layout.offsets, layout.numels, strict=True) if o < edge < o + n]
        assert inside and inside[0] > limit, (edge, buckets)


def test_the_cost_model_of_zero_stage_1():
    """Reduce-scatter plus all-gather is the ring allreduce, step for step and byte for byte;
    sharding divides only Adam's state, so 16 bytes a parameter in fp32 become 8 + 8/N; fixed
    buffers come off the memory."""
    from hvdkit.bench import costmodel

    link = costmodel.AlphaBeta(alpha=20e-6, beta=1e-9)
    for n in (2, 8, 512):
        ring = costmodel.predict(link, "ring", n, 4e8)
        assert costmodel.sharded_step(link, n, 4e8, 4e8) == pytest.approx(ring)
        assert costmodel.sharded_step(link, n, 2e8, 4e8) < ring  # bf16 gradients
    assert costmodel.bytes_per_param("fp32") == 16
    assert costmodel.bytes_per_param("fp32", 8, sharded=True) == 9
    assert costmodel.bytes_per_param("bf16", 4, sharded=True) == 7
    gib80 = 80 * 2**30
    assert costmodel.largest_model(gib80, "fp32", 64, True) / costmodel.largest_model(
        gib80, "fp32", 64, False
    ) == pytest.approx(16 / 8.125)
    assert costmodel.largest_model(gib80, "fp32", 8, False, fixed_bytes=2**30) == pytest.approx(
        79 * 2**30 / 16
    )
    plain = costmodel.rank_memory(1000, "fp32", 2, False, zero_buffers=64, transient=10)
    assert (plain.state, plain.buffers, plain.total) == (8000, 4000, 20010)
    sharded = costmodel.rank_memory(1000, "fp32", 4, True, zero_buffers=64, transient=10)
    assert (sharded.state, sharded.buffers) == (2000, 64)
    # ZeRO's pieces in flight are freed before the optimizer's temporaries exist
    assert sharded.total == 4000 + 4000 + 2000 + 64
    # beside them, autograd's new gradient before it is added into the kept one
    assert costmodel.rank_memory(1000, "fp32", 4, True, zero_buffers=64,
                                 largest_param=40).buffers == 64 + 40  # fmt: skip
    # Stage 2: the gradients are the slice's; its buffers add the inputs in flight (1/N of the
    # outputs) and the largest gradient autograd makes before it is copied
    stage2 = costmodel.rank_memory(1000, "fp32", 4, True, zero_buffers=64, gradients=True,
                                   largest_param=40)  # fmt: skip
    assert (stage2.grads, stage2.state, stage2.buffers) == (1000, 2000, 64 * 1.25 + 40)
    assert costmodel.bytes_per_param("fp32", 8, sharded=True, gradients=True) == 5.5
    one = costmodel.rank_memory(1000, "fp32", 1, True, zero_buffers=64)
    assert (one.state, one.buffers, one.total) == (8000, 0, 16000)


def test_shard_optimizer_takes_true_or_gradients_and_names_them_otherwise():
    from hvdkit.core import SetupConfig

    assert SetupConfig(shard_optimizer="gradients").shard_optimizer == "gradients"
    with pytest.raises(ValueError, match=r"shard_optimizer='grads': use False, True .*'gradients'"):
        SetupConfig(shard_optimizer="grads")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.LBFGS(ps),
        lambda ps: torch.optim.Adafactor(ps),
        lambda ps: torch.optim.SparseAdam(ps),
    ],
    ids=["LBFGS", "Adafactor", "SparseAdam"],
)
def test_an_optimizer_not_known_to_be_elementwise_is_refused_with_the_fix(make):
    """Issue 49: an update that reads a whole tensor (Adafactor's factored moments, a trust
    ratio per layer) would change its maths over flat slices without a word."""
    optimizer = make([torch.nn.Parameter(torch.zeros(4, 3))])
    with pytest.raises(ValueError, match=r"not known to update each element.*Fix: "
                       r"shard_optimizer=False.*declare_elementwise"):  # fmt: skip
        zero.ShardedOptimizer(optimizer)


def test_a_declared_elementwise_class_and_its_subclasses_are_taken(monkeypatch):
    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    class Yours(Mine):
        pass

    monkeypatch.setattr(zero, "_ELEMENTWISE", zero._ELEMENTWISE)
    with pytest.raises(ValueError, match="Mine"):
        zero.ShardedOptimizer(Mine([torch.nn.Parameter(torch.zeros(2))]))
    zero.declare_elementwise(Mine)
    assert isinstance(zero.ShardedOptimizer(Yours([torch.nn.Parameter(torch.zeros(2))])), Mine)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer class"):
        zero.declare_elementwise(object)


def test_state_a_constructor_makes_is_not_a_step():
    """Adagrad builds its sums at step 0: sharding it is fine; a stepped optimizer is not."""
    p = torch.nn.Parameter(torch.ones(3))
    adagrad = torch.optim.Adagrad([p], lr=0.1, initial_accumulator_value=0.5)
    assert not any(zero._stepped(s) for s in adagrad.state.values())
    p.grad = torch.ones(3)
    adagrad.step()
    assert all(zero._stepped(s) for s in adagrad.state.values())
    momentum = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    momentum.step()  # momentum_buffer, no step count: stepped
    assert all(zero._stepped(s) for s in momentum.state.values())


def test_parameters_whose_state_is_at_another_step_get_buffers_of_their_own():
    """A layer unfrozen mid-training starts its step count at 0 (Adam's bias correction), as
    in a plain optimizer: it goes into a flat buffer apart from the group's others."""
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    state = {a: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(2)},
             c: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(2)}}  # fmt: skip
    assert zero._cohorts([a, b, c], state) == [[a, c], [b]]
    assert zero._cohorts([a, b, c], None) == [[a, b, c]]
    assert zero._cohorts([], state) == [[]]  # an empty group keeps its padding slice


def test_a_capturable_or_fused_step_count_goes_to_the_parameters_device():
    """Issue 49, item 7: torch's rule for ``step`` on load, for state read onto the CPU. The
    meta device stands in for CUDA here (a lent GPU checks the real one)."""
    from hvdkit.torch.functions import load_optimizer_state_

    for flag, expected in (("capturable", "meta"), ("fused", "meta"), (None, "cpu")):
        p = torch.nn.Parameter(torch.zeros(3, device="meta"))
        optimizer = torch.optim.Adam([p], lr=0.1)
        group = {**optimizer.state_dict()["param_groups"][0]}
        group.update({"capturable": flag == "capturable", "fused": flag == "fused"})
        saved = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3),
                               "exp_avg_sq": torch.ones(3)}}, "param_groups": [group]}  # fmt: skip
        load_optimizer_state_(optimizer, saved)
        step = optimizer.state[p]["step"]
        assert (step.device.type, step.dtype) == (expected, torch.float32), flag
