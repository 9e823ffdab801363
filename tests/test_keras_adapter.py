"""hvdkit.keras on Keras 3 with real processes, on both backends Horovod can serve and JAX."""

from __future__ import annotations

import os

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
BACKENDS = ["tensorflow", "torch", "jax"]


@pytest.fixture(params=BACKENDS)
def keras_backend(request, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("mode", ["fit", "fit_eager"])
def test_weights_identical_on_all_ranks_after_fit(keras_backend, mode):
    r = results(horovodrun("keras_worker.py", mode))
    assert r[0]["backend"] == keras_backend == os.environ["KERAS_BACKEND"]
    assert r[0]["weights"] == r[1]["weights"]
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # each rank's share of the cores
    assert r[0]["threads"] and all(t == share for rank in (0, 1) for t in r[rank]["threads"]), r


def test_one_step_np2_equals_np1_with_double_batch(keras_backend):
    r = results(horovodrun("keras_worker.py", "one_step"))
    for rank in (0, 1):
        assert r[rank]["moved"] > 1e-3
        assert r[rank]["diff"] < 1e-5, r[rank]


def test_metric_average_is_global_on_unequal_shards_whatever_the_callback_order(keras_backend):
    if keras_backend == "jax":
        pytest.skip("unequal shards are refused on JAX, every rank told (test_keras_jax.py)")
    r = results(horovodrun("keras_worker.py", "metrics"))
    for rank in (0, 1):
        seen = r[rank]["seen"]
        assert seen["loss"] == pytest.approx(r[rank]["loss"], rel=1e-5)
        assert seen["mae"] == pytest.approx(r[rank]["mae"], rel=1e-5)
        assert seen["val_loss"] == pytest.approx(r[rank]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["float", "schedule"])
def test_warmup_reaches_full_lr_at_the_right_step(keras_backend, kind):
    r = results(horovodrun("keras_worker.py", f"warmup_{kind}"))
    # Horovod's ramp, 2 ranks, 4 warmup steps: initial_lr on the last warmup batch.
    ramp = [0.625, 0.75, 0.875, 1.0, 1.0, 1.0, 1.0, 1.0]
    base = [0.2 * (0.9**i if kind == "schedule" else 1.0) for i in range(8)]
    expected = [b * m for b, m in zip(base, ramp, strict=True)]
    for rank in (0, 1):
        assert r[rank]["lrs"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("kind", ["float", "schedule"])
def test_lr_schedule_callback_multiplies_from_its_start_epoch(keras_backend, kind):
    r = results(horovodrun("keras_worker.py", f"lr_schedule_{kind}"))
    multipliers = [1, 1, 0.5, 0.5, 0.25, 0.25]  # 2 steps per epoch, x0.5 per epoch from 1
    base = [0.2 * (0.9**i if kind == "schedule" else 1.0) for i in range(6)]
    expected = [b * m for b, m in zip(base, multipliers, strict=True)]
    for rank in (0, 1):
        assert r[rank]["lrs"] == pytest.approx(expected, rel=1e-4)
        assert len(r[rank]["logged"]) == 3


def test_setup_checkpoints_on_rank0_only_and_resumes_by_broadcast(keras_backend, tmp_path):
    """Two epochs, then a new job resumes to four: it must run epochs 2 and 3 only and end
    with the weights of an uninterrupted four-epoch run. Each rank has its own directory, so
    rank 1 can only get the resumed state by broadcast."""
    first = horovodrun("keras_worker.py", "resume", str(tmp_path / "split"), "2")
    second = results(horovodrun("keras_worker.py", "resume", str(tmp_path / "split"), "4"))
    whole = results(horovodrun("keras_worker.py", "resume", str(tmp_path / "whole"), "4"))
    first_r = results(first)
    assert first_r[0]["ran"] == [0, 1] and second[0]["ran"] == [2, 3] == second[1]["ran"]
    assert first_r[0]["files"] == ["best.keras", "ckpt.npz"]
    assert first_r[1]["files"] == second[1]["files"] == []
    assert second[0]["digest"] == second[1]["digest"]
    assert second[0]["weights"] == pytest.approx(whole[0]["weights"], abs=1e-5)
    assert second[0]["lr"] == pytest.approx(0.02)  # Adam 0.01 x 2 ranks after warmup
    assert first_r[0]["loaded_ok"] is True
    # The Session twin: unpacks as (optimizer, callbacks), knows the topology and resumed epoch.
    assert [r["start"] for r in (first_r[0], second[1])] == [
        {"epoch": 0, "size": 2, "rank": 0},
        {"epoch": 2, "size": 2, "rank": 1},
    ]
    assert second[1]["multiplier"] == 2.0 and second[1]["same"] is True
    # fit(verbose=1) on both ranks: only rank 0 prints progress.
    epoch_lines = [line for line in first.stdout.splitlines() if "Epoch 1/2" in line]
    assert epoch_lines and all(line.startswith("[0]") for line in epoch_lines), epoch_lines


def test_bad_checkpoint_stops_every_rank_naming_the_file(keras_backend, tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    (tmp_path / "rank0" / "ckpt.npz").write_bytes(b"not a checkpoint")
    out = horovodrun("keras_worker.py", "resume", str(tmp_path), "1", check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "checkpoint ckpt.npz: cannot be read" in text
    assert "RootRankError" in text or "rank 0 failed" in text
