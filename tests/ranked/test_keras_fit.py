"""hvdkit.keras's callbacks and optimizer in ``fit``, run inside the ranks of one job per Keras
backend (tests/in_ranks.py): each against one process on the global batch or the expected
schedule, and ranks against each other. Moved from tests/test_keras_adapter.py, where each
started its own job."""

from __future__ import annotations

import os

import pytest
from ranked.conftest import gathered
from workers import keras_syncbn_worker, keras_worker

KERAS_BACKENDS = ["tensorflow", "torch", "jax"]  # one job each (tests/in_ranks.py)


@pytest.mark.parametrize("eager", [False, True], ids=["fit", "fit_eager"])
def test_weights_identical_on_all_ranks_after_fit(horovod, eager):
    r = gathered(horovod, keras_worker.fit(eager))
    assert r[0]["backend"] == os.environ["KERAS_BACKEND"]
    assert r[0]["weights"] == r[1]["weights"]
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # each rank's share of the cores
    assert r[0]["threads"] and all(t == share for rank in (0, 1) for t in r[rank]["threads"]), r


def test_one_step_np2_equals_np1_with_double_batch(horovod):
    r = gathered(horovod, keras_worker.one_step())
    for rank in (0, 1):
        assert r[rank]["moved"] > 1e-3
        assert r[rank]["diff"] < 1e-5, r[rank]


def test_metric_average_is_global_on_unequal_shards_whatever_the_callback_order(horovod):
    if os.environ["KERAS_BACKEND"] == "jax":
        pytest.skip("unequal shards are refused on JAX, every rank told (test_keras_jax.py)")
    r = gathered(horovod, keras_worker.metrics())
    for rank in (0, 1):
        seen = r[rank]["seen"]
        assert seen["loss"] == pytest.approx(r[rank]["loss"], rel=1e-5)
        assert seen["mae"] == pytest.approx(r[rank]["mae"], rel=1e-5)
        assert seen["val_loss"] == pytest.approx(r[rank]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("schedule", [False, True], ids=["float", "schedule"])
def test_warmup_reaches_full_lr_at_the_right_step(horovod, schedule):
    r = gathered(horovod, keras_worker.warmup(schedule))
    # Horovod's ramp, 2 ranks, 4 warmup steps: initial_lr on the last warmup batch.
    ramp = [0.625, 0.75, 0.875, 1.0, 1.0, 1.0, 1.0, 1.0]
    base = [0.2 * (0.9**i if schedule else 1.0) for i in range(8)]
    expected = [b * m for b, m in zip(base, ramp, strict=True)]
    for rank in (0, 1):
        assert r[rank]["lrs"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("schedule", [False, True], ids=["float", "schedule"])
def test_lr_schedule_callback_multiplies_from_its_start_epoch(horovod, schedule):
    r = gathered(horovod, keras_worker.lr_schedule(schedule))
    multipliers = [1, 1, 0.5, 0.5, 0.25, 0.25]  # 2 steps per epoch, x0.5 per epoch from 1
    base = [0.2 * (0.9**i if schedule else 1.0) for i in range(6)]
    expected = [b * m for b, m in zip(base, multipliers, strict=True)]
    for rank in (0, 1):
        assert r[rank]["lrs"] == pytest.approx(expected, rel=1e-4)
        assert len(r[rank]["logged"]) == 3


def test_sync_batch_normalization_equals_batch_norm_on_the_global_batch(horovod):
    if os.environ["KERAS_BACKEND"] == "jax":
        pytest.skip("the check differentiates through tf or torch (on JAX: the test below, in fit)")
    r = gathered(horovod, keras_syncbn_worker.main())
    for rank in (0, 1):
        failed = [name for name, ok in r[rank]["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    assert r[0]["weights"] == r[1]["weights"]  # both ranks hold the same moving statistics


@pytest.mark.parametrize("mode", ["compiled", "no_jit", "eager"])
def test_sync_batch_normalization_in_fit_equals_batch_norm_on_the_global_batch(horovod, mode):
    """Compiled on JAX it used to fail deep in JAX (the step's values are traced)."""
    r = gathered(horovod, keras_syncbn_worker.fit_check(mode))
    assert r[0] == r[1]
    assert r[0]["moved"] > 0.1 and r[0]["diff"] < 1e-5, r[0]
