"""Horovod 0.28.1's Keras behaviour where Horovod defines it, with real processes, both Keras
backends: deferred-build models are synchronised, accumulation sums, sparse gradients work,
and ranks that drift apart stop the job (the sync guard)."""

from __future__ import annotations

import math

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@pytest.fixture(params=["tensorflow", "torch"])
def keras_backend(request, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovod_keras_script_shapes_end_in_sync(keras_backend, controller):
    if controller == "mpi" and keras_backend == "torch":
        pytest.skip("one MPI run (TensorFlow) is enough; Gloo covers both backends")
    r = results(horovodrun("keras_parity_worker.py", "all", controller=controller))
    assert sorted(r) == [0, 1] and r[0]["backend"] == keras_backend
    # Deferred-build Sequential from different seeds: identical after fit.
    assert r[0]["mnist"] == r[1]["mnist"]
    assert r[0]["jit"] is False  # XLA turned off by the broadcast callback (no Horovod kernels)
    for flag in (False, True):
        assert r[0][f"sparse_{flag}"] == r[1][f"sparse_{flag}"]
        assert all(math.isfinite(v) for v in r[0][f"sparse_{flag}"])
        acc = r[0][f"acc_{flag}"]
        assert acc == r[1][f"acc_{flag}"]
        # Per pass the reduced gradient of x is mean(1, 2) = 1.5; every 4th pass applies the
        # sum of the 4 passes (Horovod's default) or their mean (average_aggregated_gradients).
        per_update = 1.5 * (1 if flag else 4)
        for i in range(10):
            updates = (i + 1) // 4
            assert acc["x"][i] == pytest.approx(updates * per_update)
            assert acc["y"][i] == pytest.approx([1.0 - updates * per_update, 2.0])
        assert acc["iterations"] == list(range(1, 11))  # passes, as Horovod counts them
        assert acc["allreduces"] == 2  # once per update (passes 4 and 8), as Horovod reduces
        assert acc["pending"] == 10 % 4
    # fit() against one process on the global batches; 8 steps per rank.
    for label, allreduces in (("accumulate", 4), ("groups4", 8 * 4), ("groups_vars", 8 * 4)):
        fit = r[0][f"fit_{label}"]
        assert fit["weights"] == r[1][f"fit_{label}"]["weights"], label
        assert fit["gap"] < 1e-5, f"{label}: {fit['gap']} from the one-process run"
        assert fit["allreduces"] == allreduces, label
    assert r[0]["get_gradients"] == r[1]["get_gradients"] == 1.0  # 0 + 1, reduced once
    assert [r[k]["process_set_set0"] for k in (0, 1)] == [0.0, 1.0]  # rank 1 is not in {0}
    assert [r[k]["process_set_set1"] for k in (0, 1)] == [0.0, 1.0]  # each set of one keeps its own
    shared, local = r[0]["partial"], r[1]["partial"]
    assert shared["a"] == local["a"] and shared["b"] == local["b"] and shared["c"] != local["c"]
    if keras_backend == "tensorflow":
        assert r[0]["compute_gradients"] == r[1]["compute_gradients"] == 3.0


def test_ranks_that_drift_apart_stop_the_job(keras_backend):
    out = horovodrun("keras_parity_worker.py", "diverge", check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "ranks are out of sync at the end of epoch 1" in text
    assert "probe/kernel' (the first that differs" in text
    assert "RESULT" not in out.stdout


def test_the_sync_guard_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setenv("HVDKIT_SYNC_CHECK", "0")
    r = results(horovodrun("keras_parity_worker.py", "diverge"))
    assert r[0]["finished"] and r[1]["finished"]
