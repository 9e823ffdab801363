"""hvdkit.keras's callbacks, optimizer and checkpoints in ``fit``, run inside the ranks of one
job per Keras backend (tests/in_ranks.py): each against one process on the global batch, an
uninterrupted run or the expected schedule, and ranks against each other. Moved from
tests/test_keras_adapter.py, where each started its own job (a resume took three)."""

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


def test_setup_checkpoints_on_rank0_only_and_resumes_by_broadcast(horovod, tmp_path, capfd,
                                                                   monkeypatch):  # fmt: skip
    """Two epochs, then a new model and session resume to four: they must run epochs 2 and 3
    only and end with the weights of an uninterrupted four-epoch run. Each rank has its own
    directory, so rank 1 can only get the resumed state by broadcast."""
    monkeypatch.chdir(tmp_path)  # keras_worker.resume enters each rank's directory
    first = gathered(horovod, keras_worker.resume(str(tmp_path / "split"), 2))
    printed = gathered(horovod, capfd.readouterr().out)
    second = gathered(horovod, keras_worker.resume(str(tmp_path / "split"), 4))
    whole = gathered(horovod, keras_worker.resume(str(tmp_path / "whole"), 4))
    assert first[0]["ran"] == [0, 1] and second[0]["ran"] == [2, 3] == second[1]["ran"]
    assert first[0]["files"] == ["best.keras", "ckpt.npz"]
    assert first[1]["files"] == second[1]["files"] == []
    assert second[0]["digest"] == second[1]["digest"]
    assert second[0]["weights"] == pytest.approx(whole[0]["weights"], abs=1e-5)
    assert second[0]["lr"] == pytest.approx(0.02)  # Adam 0.01 x 2 ranks after warmup
    assert first[0]["loaded_ok"] is True
    # The Session twin: unpacks as (optimizer, callbacks), knows the topology and resumed epoch.
    assert [r["start"] for r in (first[0], second[1])] == [
        {"epoch": 0, "size": 2, "rank": 0},
        {"epoch": 2, "size": 2, "rank": 1},
    ]
    assert second[1]["multiplier"] == 2.0 and second[1]["same"] is True
    # fit(verbose=1) on both ranks: only rank 0 prints progress.
    assert "Epoch 1/2" in printed[0] and "Epoch" not in printed[1], printed


def test_bad_checkpoint_stops_every_rank_naming_the_file(horovod, tmp_path, monkeypatch):
    """Rank 0 cannot read its checkpoint: it raises naming the file, and every other rank
    raises too (told by rank 0) instead of waiting in the broadcast."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad" / "rank0").mkdir(parents=True)
    (tmp_path / "bad" / "rank0" / "ckpt.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as raised:
        keras_worker.resume(str(tmp_path / "bad"), 1)
    messages = gathered(horovod, f"{type(raised.value).__name__}: {raised.value}")
    assert "checkpoint ckpt.npz: cannot be read" in messages[0], messages
    assert messages[1].startswith("RootRankError: rank 0 failed"), messages
    assert "ckpt.npz" in messages[1], messages
