"""A rank's record of its steps, phase by phase. Active only under ``hvdkit run --profile``
(``HVDKIT_PROFILE_DIR`` set); otherwise :func:`get` is None and the hooks cost one test.

Time is charged to the innermost open phase, with the monotonic clock, and whatever no phase
holds between two step ends is ``compute``: a step is the time from the previous step's end
to this one's, so the phases add up to it exactly. Time between training steps
(:data:`~hvdkit.profile.stats.APART`: validation, the epoch's end, a checkpoint, an elastic
reset) is charged apart and is in no step. A compiled step's time is ``unsplit``, less what
hvdkit's input wrappers spent loading meanwhile (:meth:`Recorder.loading`), which is ``data``.
On a GPU (CUDA through torch) each phase's edge waits for the device's queued work, so the
forward and backward pass is compute, not the next wait; TensorFlow's GPU steps are not
synchronised.

At exit a rank writes its summary (:func:`hvdkit.profile.stats.digest`), not its steps.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from hvdkit import envvars
from hvdkit.checkpoint import replace_text
from hvdkit.profile.stats import APART, PHASES, digest

MAX_STEPS = 50_000
"""Steps kept in memory (their summary goes to ``rank-N.HOST.PID.json``): past it, every other
one is dropped and from then on only every 2nd (4th, ...) step is kept, an even sample of a long
run in bounded memory."""
_INDEX = {name: i for i, name in enumerate(PHASES)}


SyncFinder = Callable[[], "Callable[[], None] | None"]
"""Finds the device's synchronisation once the process uses a device (None until then)."""


class Recorder:
    """The steps of one process: ``[seconds per phase in PHASES order]`` each."""

    def __init__(self, clock: Any = time.perf_counter, device_sync: SyncFinder | None = None):
        self.clock = clock
        # Where the step runs on a GPU, its kernels are asynchronous: each phase's edge waits
        # for them (CUDA through torch), so the forward and backward pass is charged to
        # compute, not to the next wait (communication). Found lazily, once CUDA is in use.
        self._find_sync = device_sync or _cuda_sync
        self._sync: Callable[[], None] | None = None
        self.synchronized = False  # whether any edge waited for a device
        self.steps: list[list[float]] = []
        self.ends: list[float] = []  # each step's end, seconds since the first step began
        self._open: list[int | str] = []  # a phase's index, or an APART name
        self._current = [0.0] * len(PHASES)
        self.apart = dict.fromkeys(APART, 0.0)
        self._sticky: str | None = None  # apart until a training batch or step says otherwise
        self._lock = threading.Lock()  # loaders run in threads of their own
        self._thread = threading.local()  # each thread's loads: counted or not
        self._loads = 0  # loads running now, in any thread
        self._load_start = 0.0
        self._loaded = 0.0  # seconds some load ran, since the last step's end
        self._mark: float | None = None
        self._origin: float | None = None
        self.compiled = False  # steps run inside a compiled graph: only their time is known
        self.loader_timed = False  # their data is the input wrappers' loading time
        self.stride = 1  # every stride-th step is kept (MAX_STEPS)
        self._count = 0

    def _charge(self, now: float) -> None:
        if self._mark is None:
            self._origin = self._mark = now
            return
        # Time apart (validation, ...) holds everything inside it: a validation's batch
        # fetches are its own, not a step's data.
        apart = next((p for p in self._open if isinstance(p, str)), None)
        phase = apart or (self._open[-1] if self._open else self._sticky or _INDEX["compute"])
        if isinstance(phase, str):
            self.apart[phase] += now - self._mark
        else:
            self._current[phase] += now - self._mark
        self._mark = now

    def _now(self) -> float:
        """The clock at a phase's edge, once the device's queued work is done."""
        if self._sync is None:
            self._sync = self._find_sync()
        if self._sync is not None:
            self._sync()
            self.synchronized = True
        return float(self.clock())

    def start(self) -> None:
        """Start the clock, if no phase has yet (the first step begins now)."""
        if self._mark is None:
            self._charge(self._now())

    def enter(self, phase: str) -> None:
        """Open ``phase`` (one of PHASES, or of APART: time between training steps)."""
        self._charge(self._now())
        self._open.append(phase if phase in APART else _INDEX[phase])

    def exit(self) -> None:
        self._charge(self._now())
        if self._open:
            self._open.pop()

    def within(self, phase: str) -> bool:
        """Whether a ``phase`` is open now (perhaps with another inside it)."""
        return (phase if phase in APART else _INDEX[phase]) in self._open

    def apart_until_training(self, name: str) -> None:
        """From now, what no phase holds is ``name`` (an APART), until :meth:`training`
        or the next step's end: a validation loop seen by its first batch."""
        self._charge(self._now())
        self._sticky = name

    def reclaim(self, name: str) -> None:
        """What the step under way holds so far is ``name`` (an APART) instead: the gap since
        the last step's end turned out to lead out of training (Keras's validation or epoch
        end follows an epoch's last batch, after setting itself up: 0.5-0.8 s on TensorFlow,
        which had landed in the next step as compute)."""
        now = self._now()
        self._charge(now)
        self.apart[name] += sum(self._current)
        self._current = [0.0] * len(PHASES)
        with self._lock:
            self._loaded, self._load_start = 0.0, now

    def training(self) -> None:
        """A training batch is being fetched: the time apart, if any, ends."""
        if self._sticky is not None:
            self._charge(self._now())
            self._sticky = None

    def loading(self, begin: bool) -> None:
        """An input wrapper's load begins or ends, in any thread: the time any load runs is
        counted once, and a compiled step's share of it is ``data``."""
        now = self.clock()
        counted = getattr(self._thread, "counted", None)
        if counted is None:
            counted = self._thread.counted = []
        if begin:
            # A validation's loads (while time is apart) are not a step's data.
            counted.append(not any(isinstance(p, str) for p in self._open))
            if not counted[-1]:
                return
        elif not (counted and counted.pop()):
            return
        with self._lock:
            if begin:
                if self._loads == 0:
                    self._load_start = now
                self._loads += 1
            else:
                self._loads -= 1
                if self._loads == 0:
                    self._loaded += now - self._load_start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def step_done(self) -> None:
        """Close the step that ends now (the next one starts at once)."""
        now = self._now()
        self._charge(now)
        self._sticky = None
        with self._lock:
            loaded = self._loaded + (now - self._load_start if self._loads else 0.0)
            self._loaded, self._load_start = 0.0, now
        unsplit = _INDEX["unsplit"]
        moved = min(loaded, self._current[unsplit])  # eager steps timed their waits already
        self._current[unsplit] -= moved
        self._current[_INDEX["data"]] += moved
        self.loader_timed = self.loader_timed or moved > 0
        if sum(self._current) > 0:
            self._count += 1
            if self._count % self.stride == 0:
                assert self._origin is not None
                self.steps.append(self._current)
                self.ends.append(now - self._origin)
                if len(self.steps) >= MAX_STEPS:
                    self.steps, self.ends = self.steps[1::2], self.ends[1::2]
                    self.stride *= 2
        self._current = [0.0] * len(PHASES)

    def record(self, rank: int, host: str) -> dict[str, Any]:
        """Every kept step (what :func:`hvdkit.profile.stats.digest` reads)."""
        return {"rank": rank, "host": host, "pid": os.getpid(), "phases": list(PHASES),
                "steps": self.steps, "ends": self.ends, "compiled": self.compiled,
                "loader_timed": self.loader_timed, "stride": self.stride,
                "synchronized": self.synchronized,
                "apart": dict(self.apart)}  # fmt: skip

    def write(self, directory: Path, rank: int, host: str) -> Path:
        """The summary, in a file of this process's own (an elastic job's rank N may be
        several processes over the run, each with its file)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank-{rank}.{host}.{os.getpid()}.json"
        return replace_text(path, json.dumps(digest(self.record(rank, host))))


def _cuda_sync() -> Callable[[], None] | None:
    """torch's CUDA synchronisation once this process uses CUDA (else None: asked again at
    the next edge, cheaply)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():  # a flag: cheap at every edge
        return None
    return cast(Callable[[], None], torch.cuda.synchronize)


_recorder: Recorder | None = None
_checked = False


def get() -> Recorder | None:
    """This process's recorder under ``--profile``, else None (decided once)."""
    global _recorder, _checked
    if not _checked:
        _checked = True
        directory = os.environ.get(envvars.PROFILE_DIR)
        if directory:
            _recorder = Recorder()
            atexit.register(_write_at_exit, Path(directory))
            time_data_loaders(_recorder)
            if "tensorflow" in sys.modules:
                from hvdkit.profile import tf_hooks

                tf_hooks.install(_recorder)
    return _recorder


@contextmanager
def phase(name: str) -> Iterator[None]:
    """``with phase("other"):`` around work of that phase; nothing when not profiling."""
    recorder = get()
    if recorder is None:
        yield
        return
    with recorder.phase(name):
        yield


def _write_at_exit(directory: Path) -> None:
    from hvdkit import rank_zero

    if _recorder is not None and _recorder.steps:
        _recorder.write(directory, rank_zero.rank(), socket.gethostname())


def time_data_loaders(recorder: Recorder) -> Callable[[], None]:
    """Make every torch ``DataLoader`` iterator's ``next`` a ``data`` wait (scripts written for
    Horovod included: the loader is theirs); returns the undo. Done only when profiling, and
    only if torch is already imported (a Keras-on-TensorFlow job never imports it for this)."""
    if "torch" not in sys.modules:
        return lambda: None
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    plain_next = base.__next__

    import torch

    def timed_next(self: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            # Fetched for a compiled step by another thread (Keras-TF's input pipeline): its
            # loading, not a phase of the step's thread.
            recorder.loading(True)
            try:
                return plain_next(self)
            finally:
                recorder.loading(False)
        # A batch fetched with gradients off is a validation (or test) loop's: what follows
        # is apart from the steps until a training batch, or a step, ends it.
        if torch.is_grad_enabled():
            recorder.training()
            with recorder.phase("data"):
                return plain_next(self)
        recorder.apart_until_training("validation")
        return plain_next(self)

    def undo() -> None:
        base.__next__ = plain_next  # type: ignore[method-assign]

    base.__next__ = timed_next  # type: ignore[method-assign]
    return undo
