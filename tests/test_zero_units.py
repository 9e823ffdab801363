"""hvdkit.torch.zero's layout (pure): flat buffers padded to the world size, each rank an equal
slice, a single large tensor split across ranks."""

from __future__ import annotations

import pytest

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
        [(0, 0, 253)], [(0, 253, 506)], [(0, 506, 759)], [(0, 759, 1000), (1, 0, 10)]
    ]


def test_buckets_are_whole_parameters_last_first_and_splits_follow_ownership():
    layout = Layout((128, 16, 48, 3), 2)  # 195 elements, padded to 196: 98 a rank
    assert layout.buckets(40) == [(144, 196), (0, 144)]  # 3 + 48 >= 40, then 16 + 128
    assert layout.buckets(1) == [(192, 196), (144, 192), (128, 144), (0, 128)]
    assert layout.buckets(10**6) == [(0, 196)]
    assert layout.splits(144, 196) == [0, 52] and layout.splits(0, 144) == [98, 46]
    assert sum(sum(layout.splits(lo, hi)) for lo, hi in layout.buckets(7)) == layout.total



def test_the_cost_model_of_zero_stage_1():
    """Reduce-scatter plus all-gather is the ring allreduce, step for step and byte for byte;
    sharding divides only Adam's state, so 16 bytes a parameter in fp32 become 8 + 8/N."""
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
