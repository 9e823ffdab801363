"""MNIST / Fashion-MNIST from a local copy, else scikit-learn's digits: no download needed.

Returns numpy arrays (uint8 images ``(N, 28, 28)``, int64 labels), so the Keras and PyTorch
examples share it. A local copy is looked for in the usual places: ``root`` or
``$HVDKIT_DATA_DIR`` (IDX files, gzipped or not, directly or under ``MNIST/raw`` /
``FashionMNIST/raw`` as torchvision lays them out) and Keras's cache (``~/.keras/datasets``).
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvdkit import envvars

_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_SUBDIRS = {"mnist": ("MNIST/raw", "mnist"), "fashion": ("FashionMNIST/raw", "fashion-mnist")}


@dataclass(frozen=True)
class ImageData:
    """Train and test split, and where they came from (for the one-line notice)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} bytes (truncated?)")
    return data.reshape(dims)


def _find_idx(directory: Path) -> dict[str, Path] | None:
    found = {}
    for key, stem in _FILES.items():
        candidates = [directory / stem, directory / f"{stem}.gz"]
        match = next((c for c in candidates if c.is_file()), None)
        if match is None:
            return None
        found[key] = match
    return found


def _search_dirs(kind: str, root: str | Path | None) -> list[Path]:
    torchvision_sub, keras_sub = _SUBDIRS[kind]
    bases = [Path(p) for p in (root, os.environ.get(envvars.DATA_DIR)) if p]
    dirs = [d for base in bases for d in (base, base / torchvision_sub, base / keras_sub)]
    dirs.append(Path.home() / ".keras" / "datasets" / keras_sub)
    return dirs


def load_images(kind: str = "mnist", root: str | Path | None = None) -> ImageData:
    """MNIST (``kind="mnist"``) or Fashion-MNIST (``"fashion"``) when a local copy exists;
    otherwise scikit-learn's 8x8 digits upsampled to 28x28 (real data, no download)."""
    if kind not in _SUBDIRS:
        raise ValueError(f"kind={kind!r}: use 'mnist' or 'fashion'")
    for directory in _search_dirs(kind, root):
        files = _find_idx(directory)
        if files:
            arrays = {k: read_idx(p) for k, p in files.items()}
            return ImageData(
                **{k: v.astype(np.int64) if k.startswith("y") else v for k, v in arrays.items()},
                source=f"{kind} from {directory}",
            )
    keras_npz = Path.home() / ".keras" / "datasets" / "mnist.npz"
    if kind == "mnist" and keras_npz.is_file():
        with np.load(keras_npz) as npz:
            return ImageData(
                npz["x_train"],
                npz["y_train"].astype(np.int64),
                npz["x_test"],
                npz["y_test"].astype(np.int64),
                source=f"mnist from {keras_npz}",
            )
    return digits_28x28(reason=f"no local {kind} copy found")


def digits_28x28(reason: str = "", test_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """scikit-learn's 1,797 handwritten digits (8x8, 0-16) upsampled to 28x28 uint8 and split
    into train and test with a fixed seed."""
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.stack([zoom(img, 28 / 8, order=1) for img in digits.images])
    images = np.clip(images / 16.0 * 255.0, 0, 255).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = int(len(images) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    note = f"scikit-learn digits upsampled to 28x28 ({reason})" if reason else "digits"
    return ImageData(images[train], labels[train], images[test], labels[test], source=note)
