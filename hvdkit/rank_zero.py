"""Everything that happens on rank 0 only: printing, progress bars, and the rank the
checkpoint gate and callbacks ask. User code and examples never need ``if hvd.rank() == 0``.

The rank is set once by the adapter after ``init``; before that it is read from the launcher's
environment (horovodrun, mpirun, srun), so module-level logging works too.

Unlike Lightning's ``rank_zero`` (STYLE.md), there is no ``rank_zero_first()`` barrier here:
the one rank-0-first action hvdkit has, writing a checkpoint before the others go on, is a
collective in :meth:`hvdkit.core.Adapter.save_checkpoint`, where a failed write also reaches
every rank (a barrier alone would leave them running on).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from hvdkit import envvars

T = TypeVar("T")
_rank: int | None = None


def set_rank(rank: int) -> None:
    """Called by the adapters once Horovod knows this process's rank."""
    global _rank
    _rank = rank


def rank() -> int:
    """This process's global rank (0 when not launched by a distributed launcher)."""
    if _rank is not None:
        return _rank
    for name in envvars.RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def is_rank_zero() -> bool:
    return rank() == 0


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorator: run ``fn`` on rank 0, return None elsewhere."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if is_rank_zero() else None

    return wrapped


@rank_zero_only
def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed, so lines are not lost when a rank dies)."""
    print(*args, **{"flush": True, **kwargs})


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterator[T]:
    """A tqdm progress bar on rank 0 (plain iteration elsewhere, or without tqdm).

    Shown when rank 0's stderr is a terminal (``mpirun``/``srun`` in a shell); launchers
    that pipe output, like ``horovodrun``, would turn its redraws into noise, so there it is
    off unless ``HVDKIT_PROGRESS=1``."""
    if is_rank_zero():
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            forced = os.environ.get(envvars.PROGRESS) == "1"
            options = {"dynamic_ncols": True, "disable": False if forced else None, **kwargs}
            yield from tqdm(iterable, **options)
            return
    yield from iterable
