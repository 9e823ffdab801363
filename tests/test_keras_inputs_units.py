"""hvdkit.keras.inputs in one process: the index arithmetic, and every input Session.fit
cannot shard evenly refused with the fix (before any rank starts a step)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from hvdkit.keras import inputs  # noqa: E402
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
    assert [inputs.steps(n, 2) for n in (4, 5, 1)] == [2, 3, 1]
    assert [inputs.source_batch(i, 1, 2, 5) for i in range(3)] == [1, 3, 0]
    assert [inputs.source_batch(i, 0, 3, None) for i in range(3)] == [0, 3, 6]
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
    assert mine.x.sampler.shuffle and len(mine.x) == 2 and mine.callbacks  # set_epoch each epoch
