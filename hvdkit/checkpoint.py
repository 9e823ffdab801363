"""Atomic checkpoint files: written to a temporary file in the same directory, flushed to
disk, then renamed over the old one. A crash mid-write leaves the previous checkpoint intact,
never a half-written file. Framework-agnostic: the adapters pass the serializer."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit; the message names the file."""

    def __init__(self, path: Path | str, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}\n  Fix: {fix}")
        self.path = Path(path)


@contextlib.contextmanager
def atomic_path(path: Path | str, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to (by any library); on success it is
    fsynced and renamed to ``path``, on any error removed, leaving ``path`` untouched. The
    temporary name keeps the suffix, for writers that insist on one (``.keras``,
    ``.weights.h5``). ``durable=False`` skips the fsyncs and the mode: for notes that other
    processes read whole while the job runs (the profile's and the hang doctor's), where a
    power cut does not matter but a half-read file would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = ".weights.h5" if path.name.endswith(".weights.h5") else path.suffix
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            # mkstemp makes the file 0600; a checkpoint gets the mode any new file would, so
            # a group-shared directory (umask 002) stays shared.
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not durable:
        return
    # The rename itself must reach the disk too, or a power cut can undo it.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it back at once
    os.umask(mask)
    return mask


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(fileobj)`` into a temporary file beside ``path`` and rename it to ``path``
    (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        write(fh)
    return Path(path)


def replace_text(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one whole,
    never a part (:func:`atomic_path` with ``durable=False``)."""
    with atomic_path(path, durable=False) as tmp:
        tmp.write_text(text)
    return Path(path)


def plain_extra(extra: dict[str, Any], allowed: tuple[type, ...]) -> dict[str, Any]:
    """``extra`` as a checkpoint can hold it: lists, tuples and dicts of the ``allowed``
    leaf types; numpy scalars become the Python numbers they hold (``np.float64(0.5)`` is
    ``0.5``). Anything else raises ``TypeError`` naming where it is in ``extra`` and what to
    pass instead, when ``save()`` is called, not on the next start's resume."""

    def plain(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: plain(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if type(value).__module__ == "numpy" and hasattr(value, "item") and not value.shape:
            return value.item()  # a numpy scalar: np.float64, np.int32, np.bool_...
        if isinstance(value, allowed):
            return value
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        names = ", ".join(t.__name__ for t in allowed if t is not type(None))
        raise TypeError(
            f"save(): extra {where} is a {kind}, which a checkpoint cannot hold. Fix: pass "
            f"one of {names}, None, or lists, tuples and dicts of them (e.g. str(path), "
            "array.tolist())"
        )

    return {key: plain(value, repr(key)) for key, value in extra.items()}
