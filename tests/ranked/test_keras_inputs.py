"""Session.fit on every input model.fit takes, inside the ranks of the Keras jobs
(tests/in_ranks.py) on both Keras backends Horovod serves: every rank takes the same steps,
ends with the same weights, and those are the weights of one plain Keras process trained on
the global batches (tests/workers/keras_inputs_worker.py); and issue 49's inputs with a ledger
of the samples each rank trained (tests/workers/keras_inputs_ledger_worker.py). Moved from
tests/test_keras_inputs.py, where each backend took two jobs."""

from __future__ import annotations

import itertools
import os

import keras_inputs_ledger_worker
import keras_inputs_worker
import numpy as np
import pytest
from ranked.conftest import gathered

KERAS_BACKENDS = ["tensorflow", "torch"]  # JAX: tests/test_keras_jax.py
KINDS = ["arrays", "tf.data", "pydataset", "pydataset-processes", "torch-loader",
         "torch-dataset", "generator"]  # fmt: skip
STEPS, EPOCHS = 3, 2  # as in the worker
UNEVEN = ["tf.data", "pydataset", "torch-loader", "arrays"]


def test_fit_shards_every_input_kind_like_one_process_on_the_global_batch(horovod):
    """An input of one batch more than the ranks share (``:uneven``) gives each rank
    ceil(n / size) batches, the short shard wrapping around, so no rank waits in an allreduce
    the others never join."""
    specs = KINDS + [f"{kind}:uneven" for kind in UNEVEN]
    r = gathered(horovod, keras_inputs_worker.main(specs))
    for spec in specs:
        ranks = [r[rank]["runs"][spec] for rank in (0, 1)]
        assert ranks[0]["digest"] == ranks[1]["digest"], (spec, ranks)
        if spec.endswith(":uneven"):
            assert [x["batches"] for x in ranks] == [(STEPS + 1) * EPOCHS] * 2, (spec, ranks)
            continue
        for one in ranks:
            assert one["batches"] == STEPS * EPOCHS, (spec, one)
            assert one["moved"] > 1e-3, (spec, one)  # the oracle trained
            assert one["oracle_close"], (spec, one)


# Issue 49, items 8-11, with a ledger of the samples each rank trained at each step
# (tests/workers/keras_inputs_ledger_worker.py), run once in each backend's job.
LEDGER = {
    "tensorflow": ["shuffled-tf.data", "unknown-tf.data", "finite-generator",
                   "dict-sample-weight", "list-inputs", "validation-split"],
    "torch": ["subset-sampler", "weighted-sampler", "finite-generator", "dict-sample-weight",
              "list-inputs", "validation-split"],
}  # fmt: skip
ROWS = 110  # as in the worker


@pytest.fixture(scope="module")
def ledger(horovod) -> dict[str, list[dict]]:
    """This backend's runs, each as the ranks' results in rank order."""
    specs = LEDGER[os.environ["KERAS_BACKEND"]]
    r = gathered(horovod, keras_inputs_ledger_worker.main(specs))
    return {spec: [r[rank]["runs"][spec] for rank in (0, 1)] for spec in specs}


def only_on(backend: str) -> None:
    if os.environ["KERAS_BACKEND"] != backend:
        pytest.skip(f"this input is checked in the {backend} job")


def in_step(ranks: list[dict]) -> list[list[int]]:
    """The global batches (the ranks' k-th batches together), after the checks every input
    must pass: no error, the same steps on both ranks, identical weights, trained, and equal
    to one process trained on those global batches."""
    assert all("error" not in one for one in ranks), ranks
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]), ranks
    assert ranks[0]["digest"] == ranks[1]["digest"], ranks
    for one in ranks:
        assert one["moved"] > 1e-3 and one["oracle_close"], one
    return [a + b for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]


def epochs_of(ranks: list[dict]) -> list[list[int]]:
    """The ids trained in each epoch, over both ranks."""
    steps, starts = in_step(ranks), ranks[0]["epoch_starts"] + [len(ranks[0]["steps"])]
    return [sum(steps[a:b], []) for a, b in itertools.pairwise(starts)]


def counts(ids: list[int]) -> list[int]:
    return np.bincount(ids, minlength=ROWS).tolist()


def test_a_loader_with_a_subset_sampler_never_trains_the_held_out_rows(ledger):
    """Item 8: SubsetRandomSampler(train_idx)'s held-out rows are never trained, and its
    training rows once each epoch (73 rows over 2 ranks: one padding row), drawn anew each
    epoch."""
    only_on("torch")
    held_in = [i for i in range(ROWS) if i % 3 != 2][:-1]
    subset = epochs_of(ledger["subset-sampler"])
    for ids in subset:
        assert sorted(set(ids)) == held_in and len(ids) == len(held_in) + 1, ids
    assert len(subset) == 2 and subset[0] != subset[1]


def test_a_loader_with_a_weighted_sampler_keeps_its_weights(ledger):
    """Item 8: WeightedRandomSampler's 100 draws an epoch, none of a row of weight 0."""
    only_on("torch")
    for ids in epochs_of(ledger["weighted-sampler"]):
        assert max(ids) < ROWS // 2 and len(ids) == 100, ids


def test_a_shuffled_tf_data_gives_the_ranks_a_partition_of_each_epoch(ledger):
    """Item 9: `.shuffle(N).batch(B)` with no seed: every sample once an epoch over the ranks,
    reshuffled each epoch, and the map run on each rank's own elements only."""
    only_on("tensorflow")
    ranks = ledger["shuffled-tf.data"]
    shuffled = epochs_of(ranks)
    assert [counts(ids) for ids in shuffled] == [[1] * ROWS] * 2
    assert shuffled[0] != shuffled[1]
    assert [one["mapped"] for one in ranks] == [ROWS] * 2  # 2 epochs of 55 rows


def test_inputs_of_unknown_length_take_the_same_steps_on_every_rank(ledger):
    """Item 10: 110 rows in batches of 10 (11 batches), steps_per_epoch=4, 3 epochs hung at
    np=2. A tf.data behind a filter repeats each rank's 55 rows: 12 steps, every row twice; a
    finite generator's shares are padded to 6 batches (the first batch again) and run out at
    the same step on both ranks."""
    if os.environ["KERAS_BACKEND"] == "tensorflow":
        steps = in_step(ledger["unknown-tf.data"])
        assert len(steps) == 12 and counts(sum(steps, [])) == [2] * ROWS
    first = sum(in_step(ledger["finite-generator"])[:6], [])
    assert counts(first) == [2] * 10 + [1] * (ROWS - 10), first


@pytest.mark.parametrize("spec", ["dict-sample-weight", "list-inputs"])
def test_sample_weight_lists_and_multi_input_arrays_are_sharded(spec, ledger):
    """Item 11: a dict of inputs with sample_weight and a Python list of targets, and a list
    of inputs: the same rows of each, every sample once an epoch, equal to one process with
    the same weights."""
    assert [counts(ids) for ids in epochs_of(ledger[spec])] == [[1] * ROWS] * 2


def test_validation_split_holds_out_the_rows_one_process_holds_out(ledger):
    """fit(x, y, validation_split=0.1) on 111 rows: one process trains rows 0-98 and validates
    99-110. Split per rank's shard, row 99 was trained too. Now: the validation rows never
    trained, each training row once an epoch (plus one padding row), the weights one
    process's on the global batches, and val_loss one process's on the held-out rows."""
    ranks = ledger["validation-split"]
    for ids in epochs_of(ranks):
        assert sorted(set(ids)) == list(range(99)) and len(ids) == 100, ids
    assert all(one["val_close"] for one in ranks), ranks
