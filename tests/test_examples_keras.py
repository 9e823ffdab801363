"""The Keras example, end to end, for short runs under horovodrun -np 2, on each backend."""

from __future__ import annotations

import re

import pytest
from conftest import run_example

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_keras_mnist_reaches_90_percent_on_digits_and_resumes(backend, tmp_path):
    ckpt, best = tmp_path / "mnist.npz", tmp_path / "best.keras"
    args = ["--backend", backend, "--epochs", "10", "--checkpoint", str(ckpt)]
    out = run_example("keras_mnist.py", *args, "--save-model", str(best))
    assert "data: scikit-learn digits upsampled to 28x28 (no local mnist copy found)" in out
    assert out.count("data: ") == 1 and f"backend {backend}, 2 ranks" in out
    assert out.count("Epoch 10/10") == 1  # fit(verbose=2) prints on rank 0 only
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.90, out
    assert ckpt.is_file() and best.is_file()
    # Running again resumes after the last epoch: no epoch is trained again.
    again = run_example("keras_mnist.py", *args)
    assert "resumed from" in again and "at epoch 10" in again
    assert "Epoch " not in again and "test accuracy" in again
