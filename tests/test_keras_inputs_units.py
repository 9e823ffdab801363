"""hvdkit.keras.inputs (with tf_pipeline, torch_loader and shares) in one process: the index
arithmetic, and every input Session.fit cannot shard evenly refused with the fix (before any
rank starts a step)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from hvdkit.keras import inputs, shares, tf_pipeline, torch_loader  # noqa: E402
from hvdkit.keras.inputs import InputError, ShardedPyDataset, shard_input  # noqa: E402


class Numbered(keras.utils.PyDataset):
    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((2, 1), i, "float32"), np.zeros((2, 1), "float32")


def test_each_rank_takes_ceil_n_over_size_batches_interleaved_and_wrapping():
    assert [shares.steps(n, 2) for n in (4, 5, 1)] == [2, 3, 1]
    assert [shares.source_batch(i, 1, 2, 5) for i in range(3)] == [1, 3, 0]
    assert [shares.source_batch(i, 0, 3, None) for i in range(3)] == [0, 3, 6]
    mine = ShardedPyDataset(Numbered(5), rank=1, size=2, steps_per_epoch=None, workers=3)
    assert mine.num_batches == 3 and mine.workers == 3 and not mine.use_multiprocessing
    assert [int(mine[i][0][0, 0]) for i in range(3)] == [1, 3, 0]
    own = ShardedPyDataset(Numbered(5, max_queue_size=7), 0, 2, None)
    assert own.max_queue_size == 7  # the dataset's own loading, unless fit says otherwise


def test_kinds_are_told_apart():
    tf = pytest.importorskip("tensorflow")
    torch_data = pytest.importorskip("torch.utils.data")
    assert inputs.kind_of(np.zeros(3)) == "arrays" and inputs.kind_of([1, 2]) == "arrays"
    assert inputs.kind_of(tf.data.Dataset.range(3)) == "tf.data"
    assert inputs.kind_of(Numbered(2)) == "pydataset"
    assert inputs.kind_of(iter([1])) == "generator" and inputs.kind_of(x for x in []) == "generator"
    data = torch_data.TensorDataset(__import__("torch").zeros(4, 1))
    assert inputs.kind_of(data) == "torch-dataset"
    assert inputs.kind_of(torch_data.DataLoader(data, batch_size=2)) == "torch-loader"


def test_a_dataset_without_an_end_needs_steps_per_epoch():
    tf = pytest.importorskip("tensorflow")
    forever = tf.data.Dataset.range(10).batch(2).repeat()
    with pytest.raises(InputError, match="repeats forever.*Fix: give steps_per_epoch=N"):
        shard_input(forever, None, {}, 0, 2)
    shard_input(forever, None, {"steps_per_epoch": 3}, 0, 2)
    unknown = tf.data.Dataset.range(10).filter(lambda v: v > 2).batch(2)
    with pytest.raises(InputError, match="cannot know.*assert_cardinality"):
        shard_input(unknown, None, {}, 0, 2)
    with pytest.raises(InputError, match="the dataset is empty"):
        shard_input(tf.data.Dataset.range(0).batch(2), None, {}, 0, 2)
    mine = shard_input(tf.data.Dataset.range(5), None, {}, 1, 2).x  # 5 elements, 2 ranks
    assert [int(v) for v in mine] == [1, 3, 0]


def test_inputs_that_cannot_be_sharded_evenly_are_refused_with_the_fix():
    with pytest.raises(InputError, match="generator has no length.*steps_per_epoch=N"):
        shard_input((i for i in range(4)), None, {}, 0, 2)
    with pytest.raises(InputError, match=r"fit\(workers=, use_multiprocessing=\.\.\.\).*arrays"):
        shard_input(np.zeros((4, 1)), None, {"workers": 2, "use_multiprocessing": True}, 0, 2)
    with pytest.raises(InputError, match="give y=None"):
        shard_input(Numbered(4), np.zeros(4), {}, 0, 2)
    with pytest.raises(InputError, match=r"num_batches is None\).*steps_per_epoch"):

        class Endless(Numbered):
            @property
            def num_batches(self):
                return None

        shard_input(Endless(1), None, {}, 0, 2)


def test_torch_inputs_that_a_distributed_sampler_cannot_split_are_refused():
    torch = pytest.importorskip("torch")
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        IterableDataset,
        SequentialSampler,
        TensorDataset,
    )

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    for x in (Stream(), DataLoader(Stream(), batch_size=2)):
        with pytest.raises(InputError, match="IterableDataset.*Fix"):
            shard_input(x, None, {}, 0, 2)
    data = TensorDataset(torch.zeros(8, 1))
    own = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, False))
    with pytest.raises(InputError, match="its own batch_sampler.*Fix: give the DataLoader"):
        shard_input(own, None, {}, 0, 2)
    mine = shard_input(DataLoader(data, batch_size=2, shuffle=True), None, {}, 1, 2)
    assert len(mine.x) == 2 and mine.callbacks  # set_epoch each epoch


def test_rows_indices_and_generator_items_are_padded_to_equal_shares():
    assert [shares.shard_rows(5, r, 2).tolist() for r in (0, 1)] == [[0, 2, 4], [1, 3, 1]]
    assert [shares.shard_rows(1, r, 3).tolist() for r in range(3)] == [[0], [0], [0]]
    assert [shares.rank_indices([7, 8, 9], r, 2) for r in (0, 1)] == [[7, 9], [8, 7]]
    assert shares.rank_indices([5], 2, 3) == [5] and shares.rank_indices([], 0, 2) == []
    # A generator's length shows only at its end: the ranks short of an item in the last
    # round take one of the first items, so all run out at the same step (issue 49, item 10).
    split = [list(shares.balanced(iter(range(11)), r, 2)) for r in (0, 1)]
    assert split == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]
    split = [list(shares.balanced(iter(range(4)), r, 3)) for r in range(3)]
    assert split == [[0, 3], [1, 0], [2, 1]]  # as source_batch wraps: 4 % 4 = 0, 5 % 4 = 1
    assert [list(shares.balanced(iter([]), r, 2)) for r in (0, 1)] == [[], []]


def test_arrays_dicts_lists_and_sample_weight_are_sharded_by_the_same_rows():
    """Issue 49, item 11: sample_weight, Python lists and multi-input structures."""
    x = {"a": np.arange(10.0)[:, None], "b": np.arange(10.0)[:, None] * 10}
    weight = np.arange(10.0) / 10
    mine = shard_input(x, list(range(10)), {"sample_weight": weight, "epochs": 2}, 1, 2)
    assert mine.x["a"][:, 0].tolist() == [1, 3, 5, 7, 9] and mine.x["b"][0, 0] == 10
    assert mine.y.tolist() == [1, 3, 5, 7, 9] and isinstance(mine.y, np.ndarray)
    assert mine.kwargs == {"sample_weight": pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9]), "epochs": 2}
    pair = shard_input([x["a"], x["b"]], None, {}, 0, 3)  # a list of inputs, 10 rows: 4 each
    assert isinstance(pair.x, list) and [v[:, 0].tolist() for v in pair.x] == [
        [0, 3, 6, 9],
        [0, 30, 60, 90],
    ]
    rows = shard_input([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], (0, 1, 2), {}, 1, 2)  # Keras 2 lists
    assert rows.x.tolist() == [[2.0, 3.0], [2.0, 3.0]] and rows.y.tolist() == [1, 1]
    with pytest.raises(InputError, match=r"differ in length \(x\['a'\]: 10, x\['b'\]: 10, y: 9"):
        shard_input(x, np.zeros(9), {}, 0, 2)
    with pytest.raises(InputError, match=r"sample_weight: 4\).*one row per sample"):
        shard_input(np.zeros((10, 1)), np.zeros(10), {"sample_weight": np.ones(4)}, 0, 2)


def test_validation_split_holds_out_the_last_rows_of_the_whole_arrays():
    """fit(validation_split=f) split each rank's shard, so a row one process holds out (the
    last f of x, before any shuffle) was trained on some rank: 111 rows, f=0.1, the shards'
    split trained row 99. The whole arrays are split first (Keras's rule, floor(n * (1 - f))
    rows train), then the training part is sharded (padded) and the validation part split
    between the ranks unpadded, so the averaged metrics count each row once."""
    x = {"a": np.arange(111.0)[:, None]}
    given = {"validation_split": 0.1, "sample_weight": np.arange(111.0), "epochs": 1}
    parts = [shard_input(x, np.arange(111), given, r, 2) for r in (0, 1)]
    assert sorted({int(v) for p in parts for v in p.x["a"][:, 0]}) == list(range(99))
    assert [len(p.y) for p in parts] == [50, 50]  # 99 rows: one padding row
    assert all("validation_split" not in p.kwargs and p.kwargs["epochs"] == 1 for p in parts)
    held = [p.kwargs["validation_data"] for p in parts]
    assert sorted(v for h in held for v in h[1].tolist()) == list(range(99, 111))
    assert all(h[0]["a"][:, 0].tolist() == h[1].tolist() == h[2].tolist() for h in held)
    assert shares.validation_rows(1, 1, 2).tolist() == [0]  # too few to split: every rank all
    assert shares.validation_rows(5, 1, 2, everyone=True).tolist() == [0, 1, 2, 3, 4]  # JAX
    own = shard_input(x, None, {"validation_split": 0.5, "validation_data": (x, None)}, 0, 2)
    assert own.kwargs["validation_split"] == 0.5 and len(own.x["a"]) == 56  # Keras ignores it
    with pytest.raises(InputError, match=r"validation_split=0.999\): 111 samples leave 0 to "):
        shard_input(x, None, {"validation_split": 0.999}, 0, 2)
    data = Numbered(4)  # Keras refuses validation_split for what it cannot slice; so it stays
    assert shard_input(data, None, {"validation_split": 0.2}, 0, 2).kwargs["validation_split"]


def pipeline(tf, n, mapped, seed=None):
    """The tf.data guide's pipeline: an expensive map, an unseeded shuffle, batches."""

    def expensive(v):
        mapped.append(int(v))
        return v

    data = tf.data.Dataset.from_tensor_slices(np.arange(n))
    data = data.map(lambda v: tf.py_function(expensive, [v], tf.int64))
    return data.shuffle(n, seed=seed).batch(4)


def test_a_shuffled_tf_data_pipeline_is_sharded_at_its_source():
    """Issue 49, item 9: each rank shuffles differently, so sharding the batches overlapped.
    Sharded at the source, the ranks' shares partition every epoch (the padding: one first
    element more), each reshuffled every epoch, and the map runs on the rank's own share."""
    tf = pytest.importorskip("tensorflow")
    mapped: list[int] = []
    shares = [shard_input(pipeline(tf, 21, mapped), None, {}, r, 2).x for r in (0, 1)]
    assert [int(s.cardinality()) for s in shares] == [3, 3]
    epochs = [[[v for b in share for v in b.numpy().tolist()] for share in shares] for _ in "ab"]
    for ranks in epochs:
        assert sorted(ranks[0] + ranks[1]) == sorted([*range(21), 0])
    assert epochs[0][0] != epochs[1][0]  # reshuffled each epoch (one chance in 11! otherwise)
    assert sorted(mapped) == sorted(2 * [*range(21), 0])  # 2 epochs of each share, no more
    graph, _ = tf_pipeline._graph_of(pipeline(tf, 21, []))
    assert tf_pipeline.shard_cut(graph).op == "TensorSliceDataset"


def test_a_pipeline_below_its_cut_must_run_the_same_on_every_rank():
    """What the shard cannot pass (take, interleave, a file cache) runs whole on every rank:
    an unseeded shuffle or a reordering op there is refused with the fix, as is a part that
    another rank reads with other data (the digests the ranks gather differ)."""
    tf = pytest.importorskip("tensorflow")
    data = tf.data.Dataset.range(10)
    unseeded = data.shuffle(10).take(6).batch(2)  # take counts positions: sharded above it
    with pytest.raises(InputError, match=r"shuffles without a seed.*below take.*seed=S"):
        shard_input(unseeded, None, {}, 0, 2)
    seeded = [
        shard_input(data.shuffle(10, seed=1).take(6).batch(2), None, {}, r, 2).x for r in (0, 1)
    ]
    taken = sorted(int(v) for v in data.shuffle(10, seed=1).take(6))
    assert sorted(v for s in seeded for b in s for v in b.numpy().tolist()) == taken
    unordered = data.map(lambda v: v, num_parallel_calls=2, deterministic=False).take(4)
    with pytest.raises(InputError, match="another order on each rank"):
        shard_input(unordered, None, {}, 0, 2)
    files = tf.data.Dataset.list_files(__file__).interleave(tf.data.TextLineDataset)
    with pytest.raises(InputError, match=r"without a seed.*below interleave"):
        shard_input(files, None, {"steps_per_epoch": 2}, 0, 2)
    graph, _ = tf_pipeline._graph_of(data.cache("/nonexistent/cache").batch(2))
    assert tf_pipeline.shard_cut(graph).op == "CacheDatasetV2"  # a file cache is not split

    def differ(view):  # another rank read other data
        return [view, ("other", None, None)]

    differs = r"up to range \(RangeDataset\) differs between the ranks \(rank 0 and rank 1.*seed"
    with pytest.raises(InputError, match=differs):
        shard_input(data.batch(2), None, {}, 0, 2, gather=differ)


def test_inputs_of_unknown_length_give_every_rank_the_same_steps():
    """Issue 49, item 10: 110 rows in batches of 10 behind a filter, steps_per_epoch=4, 3
    epochs at np=2 hung: one rank had 6 batches and the other 5."""
    tf = pytest.importorskip("tensorflow")
    rows = tf.data.Dataset.from_tensor_slices(np.arange(110)).filter(lambda v: v >= 0).batch(10)
    shares = [shard_input(rows, None, {"steps_per_epoch": 4}, r, 2).x for r in (0, 1)]
    taken = [[b.numpy().tolist() for b in share.take(12)] for share in shares]  # 3 epochs
    assert [len(t) for t in taken] == [12, 12]
    assert [len(b) for b in taken[0][:6]] == [10] * 5 + [5]  # 55 rows each, then again
    assert sorted(v for t in taken for b in t[:6] for v in b) == list(range(110))
    gen = [shard_input(iter(range(11)), None, {"steps_per_epoch": 4}, r, 2).x for r in (0, 1)]
    assert [len(list(g)) for g in gen] == [6, 6]


def test_a_torch_loader_keeps_its_own_sampler_sharded_between_the_ranks():
    """Issue 49, item 8: the user's sampler was replaced by a DistributedSampler over the
    whole dataset, so the held-out rows were trained on and the weights were lost."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import (
        DataLoader,
        DistributedSampler,
        SubsetRandomSampler,
        TensorDataset,
        WeightedRandomSampler,
    )

    data = TensorDataset(torch.arange(20))
    train = list(range(0, 20, 2)) + [1]  # 11 rows; the other odd rows are held out

    def epoch(sampler, seed, e):
        loader = DataLoader(data, batch_size=3, sampler=sampler)
        loaders = [shard_input(loader, None, {}, r, 2).x for r in (0, 1)]
        for loader in loaders:
            loader.sampler.seed = seed
            loader.sampler.set_epoch(e)
        return [[int(v) for (b,) in loader for v in b] for loader in loaders]

    first, second = epoch(SubsetRandomSampler(train), 5, 0), epoch(SubsetRandomSampler(train), 5, 1)
    for ranks in (first, second):
        assert [len(r) for r in ranks] == [6, 6]
        assert sorted(ranks[0] + ranks[1][:-1]) == sorted(train)  # the last: padding
    assert first != second  # a new draw each epoch
    weights = torch.tensor([1.0 if v < 10 else 0.0 for v in range(20)])
    drawn = epoch(WeightedRandomSampler(weights, 16), 5, 0)
    assert [len(r) for r in drawn] == [8, 8] and max(max(r) for r in drawn) < 10
    own = torch.Generator().manual_seed(3)
    sampler = SubsetRandomSampler(train, generator=own)
    state = own.get_state()
    torch_loader._probe(sampler)
    assert torch.equal(own.get_state(), state)  # the probe leaves training's draws alone

    def differ(view):  # a rank that split its rows at random with its own seed
        return [view, ("other", None, 1)]

    with pytest.raises(InputError, match=r"SubsetRandomSampler's indices differs between"):
        shard_input(DataLoader(data, sampler=sampler), None, {}, 0, 2, gather=differ)
    sharded = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    assert shard_input(sharded, None, {}, 1, 2).x is sharded
    with pytest.raises(InputError, match="DistributedSampler is rank 1 of 2.*Fix"):
        shard_input(sharded, None, {}, 0, 2)
