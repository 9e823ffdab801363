"""Atomic checkpoint files: written to a temporary file in the same directory, flushed to
disk, then renamed over the old one. A crash mid-write leaves the previous checkpoint intact,
never a half-written file. Framework-agnostic: the adapters pass the serializer."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit; the message names the file."""

    def __init__(self, path: Path | str, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}\n  Fix: {fix}")
        self.path = Path(path)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to (by any library); on success it is
    fsynced and renamed to ``path``, on any error removed, leaving ``path`` untouched. The
    temporary name keeps the suffix, for writers that insist on one (``.keras``,
    ``.weights.h5``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = ".weights.h5" if path.name.endswith(".weights.h5") else path.suffix
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself must reach the disk too, or a power cut can undo it.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(fileobj)`` into a temporary file beside ``path`` and rename it to ``path``
    (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        write(fh)
    return Path(path)
