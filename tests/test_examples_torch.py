"""The PyTorch examples, end to end, for short runs under horovodrun -np 2."""

from __future__ import annotations

import re

import pytest
from conftest import run_example

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


def test_mnist_mlp_reaches_90_percent_on_digits(tmp_path):
    out = run_example(
        "pytorch_mnist.py", "--epochs", "4", "--checkpoint", str(tmp_path / "mnist.pt")
    )
    assert "data: scikit-learn digits upsampled to 28x28 (no local mnist copy found)" in out
    assert out.count("data: ") == 1  # printed once, by rank 0
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.90, out
    assert (tmp_path / "mnist.pt").is_file()
    # Running again resumes after the last epoch and trains no further.
    again = run_example(
        "pytorch_mnist.py", "--epochs", "4", "--checkpoint", str(tmp_path / "mnist.pt")
    )
    assert "resumed from" in again and "epoch 3:" not in again


def test_fashion_resnet_short_run_channels_last_under_mpi():
    out = run_example(
        "pytorch_fashion_resnet.py",
        "--epochs",
        "1",
        "--max-steps",
        "3",
        "--batch-size",
        "16",
        "--channels-last",
        controller="mpi",
    )
    assert "test accuracy:" in out


def test_synthetic_benchmark_compare_prints_ratio():
    out = run_example(
        "pytorch_synthetic_benchmark.py",
        "--model",
        "mlp",
        "--batch-size",
        "64",
        "--num-iters",
        "2",
        "--num-batches-per-iter",
        "3",
        "--compare",
    )
    assert re.search(r"hvdkit: [\d.]+ images/s per rank, [\d.]+ images/s total", out)
    assert re.search(r"ratio hvdkit / hand-written horovod: [\d.]+", out)
