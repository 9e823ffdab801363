"""hvdkit.keras on Keras 3 with real processes, on both backends Horovod can serve."""

from __future__ import annotations

import os

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
BACKENDS = ["tensorflow", "torch"]


@pytest.fixture(params=BACKENDS)
def keras_backend(request, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("mode", ["fit", "fit_eager"])
def test_weights_identical_on_all_ranks_after_fit(keras_backend, mode):
    r = results(horovodrun("keras_worker.py", mode))
    assert r[0]["backend"] == keras_backend == os.environ["KERAS_BACKEND"]
    assert r[0]["weights"] == r[1]["weights"]


def test_one_step_np2_equals_np1_with_double_batch(keras_backend):
    r = results(horovodrun("keras_worker.py", "one_step"))
    for rank in (0, 1):
        assert r[rank]["moved"] > 1e-3
        assert r[rank]["diff"] < 1e-5, r[rank]


def test_metric_average_is_global_on_unequal_shards_whatever_the_callback_order(keras_backend):
    r = results(horovodrun("keras_worker.py", "metrics"))
    for rank in (0, 1):
        seen = r[rank]["seen"]
        assert seen["loss"] == pytest.approx(r[rank]["loss"], rel=1e-5)
        assert seen["mae"] == pytest.approx(r[rank]["mae"], rel=1e-5)
        assert seen["val_loss"] == pytest.approx(r[rank]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["float", "schedule"])
def test_warmup_reaches_full_lr_at_the_right_step(keras_backend, kind):
    r = results(horovodrun("keras_worker.py", f"warmup_{kind}"))
    ramp = [0.5, 0.625, 0.75, 0.875, 1.0, 1.0, 1.0, 1.0]  # 2 ranks, 4 warmup steps
    base = [0.2 * (0.9**i if kind == "schedule" else 1.0) for i in range(8)]
    expected = [b * m for b, m in zip(base, ramp, strict=True)]
    for rank in (0, 1):
        assert r[rank]["lrs"] == pytest.approx(expected, rel=1e-4)
