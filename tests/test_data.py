"""hvdkit.data: IDX parsing of a local copy, and the digits fallback."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from hvdkit.data import digits_28x28, load_images, read_idx


def write_idx(path, array, compress):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(payload)


def test_local_copy_in_torchvision_layout_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (5, 28, 28))
    y = np.arange(5)
    for name, arr in (
        ("train-images-idx3-ubyte", x),
        ("train-labels-idx1-ubyte", y),
        ("t10k-images-idx3-ubyte", x[:2]),
        ("t10k-labels-idx1-ubyte", y[:2]),
    ):
        write_idx(raw / (name + ".gz"), arr, compress=True)
    data = load_images("fashion", tmp_path / "data")
    assert data.source == f"fashion from {raw}"
    assert (data.x_train == x).all() and data.y_test.tolist() == [0, 1]


def test_truncated_idx_names_the_file(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    write_idx(path, np.zeros((2, 4, 4)), compress=False)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte: header says"):
        read_idx(path)


def test_fallback_is_digits_at_28x28(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HVDKIT_DATA_DIR", raising=False)
    data = load_images("mnist")
    assert data.source.startswith("scikit-learn digits upsampled to 28x28")
    assert data.x_train.shape[1:] == (28, 28) and data.x_train.dtype == np.uint8
    assert len(data.x_train) + len(data.x_test) == 1797
    assert set(data.y_train.tolist()) == set(range(10))
    assert digits_28x28().x_test.shape == data.x_test.shape
