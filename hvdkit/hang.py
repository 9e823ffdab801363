"""A rank's side of ``hvdkit run``'s hang doctor (:mod:`hvdkit.launch.hang_doctor`). Under it
(``HVDKIT_HANG_DIR`` set) a daemon thread of each rank:

- keeps ``rank-N.HOST.PID.state`` in the folder while one of the rank's Horovod (torch)
  collectives has waited over a second: their names and how long (JSON), so that the
  launcher sees who waits in what, and who is in none;
- when the launcher asks (a file ``request`` newer than the last dump), writes every thread's
  Python stack there as ``rank-N.HOST.PID.stacks`` (``faulthandler``'s format).

Files in a folder rather than signals: ranks on other hosts answer too where the folder is
shared, and no signal of the script's own is taken. The collectives are seen where every
torch collective is submitted (``horovod.torch.mpi_ops``' ``_*_async`` functions); whether
one is done, by Horovod's own ``poll``. Started by the adapters' ``init()``; nothing otherwise.
"""

from __future__ import annotations

import faulthandler
import inspect
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdkit import envvars
from hvdkit.checkpoint import atomic_path, replace_text

POLL_S = 0.5
WAITED_S = 1.0  # a collective is written down once it has waited this long
REQUEST = "request"
SUBMITTERS = ("_allreduce_async", "_grouped_allreduce_async", "_allgather_async",
              "_grouped_allgather_async", "_broadcast_async", "_alltoall_async",
              "_reducescatter_async", "_grouped_reducescatter_async")  # fmt: skip
_started: Path | None = None  # the running watcher's folder
_stop = threading.Event()  # the running watcher's (each watcher its own)
_submitted: dict[int, tuple[str, float]] = {}  # handle: (name, when)
_sent: dict[int, tuple[str, list[int], str]] = {}  # handle: (name, shape, dtype)
_done: Callable[[int], bool] | None = None  # whether a handle's collective has finished


def _path(directory: Path, rank: int, suffix: str) -> Path:
    return directory / f"rank-{rank}.{socket.gethostname()}.{os.getpid()}.{suffix}"


def waiting(now: float) -> list[tuple[str, float]]:
    """The collectives submitted and not finished, with how long they have waited."""
    if _done is None:
        return []
    out = []
    for handle, (name, when) in list(_submitted.items()):
        if _done(handle):
            _submitted.pop(handle, None)
            _sent.pop(handle, None)
        else:
            out.append((name, now - when))
    return out


def _watch(directory: Path, stopped: threading.Event) -> None:
    from hvdkit import rank_zero

    request = directory / REQUEST
    seen = request.stat().st_mtime_ns if request.exists() else 0
    state: Path | None = None
    while not stopped.wait(POLL_S):
        rank = rank_zero.rank()
        late = [(n, s) for n, s in waiting(time.monotonic()) if s >= WAITED_S]
        if late:
            state = _path(directory, rank, "state")
            replace_text(state, json.dumps({"rank": rank, "waiting": late}))
        elif state is not None:
            state.unlink(missing_ok=True)
            state = None
        try:
            asked = request.stat().st_mtime_ns
        except OSError:
            continue
        if asked != seen:
            seen = asked
            path = _path(directory, rank, "stacks")
            with atomic_path(path, durable=False) as tmp, open(tmp, "w") as out:
                faulthandler.dump_traceback(file=out, all_threads=True)


def track_torch() -> None:
    """Note each torch collective's name and submission; its end by Horovod's ``poll``."""
    global _done
    from horovod.torch import mpi_ops

    if _done is not None:
        return

    def done(handle: int) -> bool:
        if handle not in mpi_ops._handle_map:
            return True  # synchronized already
        try:
            return bool(mpi_ops.poll(handle))
        except Exception:  # noqa: BLE001 - a handle cleared meanwhile: finished
            return True

    for name in SUBMITTERS:
        submit = getattr(mpi_ops, name, None)
        if submit is not None and "name" in inspect.signature(submit).parameters:
            kind = name.strip("_").removesuffix("_async").removeprefix("grouped_")
            setattr(mpi_ops, name, _noted(submit, kind))
    _done = done


def _noted(submit: Callable[..., Any], kind: str) -> Callable[..., Any]:
    at = list(inspect.signature(submit).parameters).index("name")

    def noted(*args: Any, **kwargs: Any) -> Any:
        handle = submit(*args, **kwargs)
        name = kwargs["name"] if "name" in kwargs else args[at] if len(args) > at else None
        # Named as Horovod names it (its stall warnings, its timeline): "allreduce.NAME".
        full = f"{kind}.{name or 'noname'}"
        _submitted[handle] = (full, time.monotonic())
        tensor: Any = args[0] if args else None
        if hasattr(tensor, "shape"):  # what a mismatch report names (a group: its first)
            _sent[handle] = (full, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        return handle

    noted.__wrapped__ = submit  # type: ignore[attr-defined]
    return noted


MISMATCH = "Mismatched"  # Horovod's error for one tensor of other shapes or dtypes


def _note_mismatch() -> Callable[..., None]:
    """An ``excepthook`` that, before the usual one, writes what this rank sent in the
    collective Horovod refused for a mismatch (its newest finished one): the launcher names
    every rank's shape and dtype in one line."""
    plain = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if MISMATCH in str(error) and _done is not None:
            from hvdkit import rank_zero

            finished = [h for h in _sent if h in _submitted and _done(h)]
            if finished:
                name, shape, dtype = _sent[finished[-1]]
                note = {"rank": rank_zero.rank(), "name": name, "shape": shape, "dtype": dtype}
                if _started is not None:  # the folder of the watcher running now
                    replace_text(_path(_started, rank_zero.rank(), "sent"), json.dumps(note))
        plain(kind, error, trace)

    hook.hvdkit_hang = True  # type: ignore[attr-defined]
    return hook


def untrack() -> None:
    """Horovod's torch functions as they were (the bench's rounds without the doctor)."""
    global _done
    from horovod.torch import mpi_ops

    for name in SUBMITTERS:
        plain = getattr(getattr(mpi_ops, name, None), "__wrapped__", None)
        if plain is not None:
            setattr(mpi_ops, name, plain)
    _done = None
    _submitted.clear()
    _sent.clear()


def stop() -> None:
    """The watcher stopped and the functions untracked; :func:`install` starts them again."""
    global _started
    if _started is not None:
        _stop.set()
        _started = None
    untrack()


def install(torch: bool = True) -> bool:
    """Start the watcher when ``hvdkit run`` asked for it (once per process, or again for
    another folder: an engine's worker process serves job after job); ``torch``: note
    Horovod's torch collectives too."""
    global _started, _stop
    directory = os.environ.get(envvars.HANG_DIR)
    if not directory:
        return False
    if torch:
        track_torch()
    if _started == Path(directory):
        return True
    _stop.set()  # an earlier job's watcher, if any
    _started, _stop = Path(directory), threading.Event()
    if not hasattr(sys.excepthook, "hvdkit_hang"):
        sys.excepthook = _note_mismatch()
    watcher = threading.Thread(target=_watch, args=(Path(directory), _stop), name="hvdkit-hang")
    watcher.daemon = True
    watcher.start()
    return True
