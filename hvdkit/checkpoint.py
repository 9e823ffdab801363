"""Atomic checkpoint files: written to a temporary file in the same directory, flushed to
disk, then renamed over the old one. A crash mid-write leaves the previous checkpoint intact,
never a half-written file. Framework-agnostic: the adapters pass the serializer."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit; the message names the file."""

    def __init__(self, path: Path | str, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}\n  Fix: {fix}")
        self.path = Path(path)


def atomic_write(path: Path | str, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fileobj)`` into a temporary file beside ``path``, fsync it, and rename it
    to ``path``; on any error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename itself must reach the disk too, or a power cut can undo it.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
