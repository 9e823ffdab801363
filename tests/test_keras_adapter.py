"""hvdkit.keras on Keras 3 with real processes, on both backends Horovod can serve and JAX: the
checks that need jobs of their own (a resume is a second job). Its in-process checks (fit,
one step against one process, metric averaging, the LR callbacks) run inside the ranks of one
job per backend: tests/ranked/test_keras_fit.py."""

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
