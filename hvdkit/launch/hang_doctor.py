"""``hvdkit run``'s hang doctor: when a collective has waited ``--stall-timeout`` seconds for
some ranks, say which ranks have not submitted which tensors, where every rank is (its Python
stack), and one line of diagnosis; then keep waiting, or stop the job (``--on-stall stop``).

Horovod's coordinator warns every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (set here to a quarter
of the timeout) while a tensor waits for some ranks, so the first warning comes when the wait
is between one and two such periods old: the report is made once the oldest possible start of
the wait is the timeout ago, at most half the timeout after it. The reading is pure
(:mod:`hvdkit.launch.stall`); the ranks write their stacks when asked (:mod:`hvdkit.hang`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdkit import envvars
from hvdkit.hang import REQUEST
from hvdkit.launch import stall

EXIT_CODE = 124  # as timeout(1): the job was stopped for taking too long
STACK_WAIT_S = 10.0


@dataclass(frozen=True)
class HangConfig:
    """``--stall-timeout S`` (0: off), ``--on-stall``, ``--hang-dir``; and how the report
    names its launcher and those two settings (the engines set them by variables)."""

    timeout: int = 60
    stop: bool = False
    directory: Path | None = None
    who: str = "hvdkit run"
    timeout_flag: str = "--stall-timeout"
    stop_flag: str = "--on-stall stop"

    @property
    def warn_every(self) -> int:
        return max(1, self.timeout // 4)

    def env(self, directory: Path) -> list[str]:
        if self.timeout <= 0:
            return []
        return [f"{envvars.HANG_DIR}={directory}",
                f"HOROVOD_STALL_CHECK_TIME_SECONDS={self.warn_every}"]  # fmt: skip

    def folder(self) -> Path:
        """Where the ranks write their stacks: ``--hang-dir`` (shared by the hosts), or a
        fresh folder here."""
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            return self.directory.resolve()
        return Path(tempfile.mkdtemp(prefix="hvdkit-hang-"))


class Doctor:
    """Reports a stall seen either way: the ranks' own notes of the torch collectives they
    have waited in (:meth:`watch`, any controller), or Horovod's coordinator's warnings on
    rank 0's stderr (:meth:`feed`; under MPI, TensorFlow's graph collectives too)."""

    def __init__(self, config: HangConfig, directory: Path, host_of: dict[int, str],
                 say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.config, self.directory, self.host_of = config, directory, host_of
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.clock = clock
        self.reader = stall.WarningReader()
        self.stop: Callable[[], object] | None = None
        self.stopped = False
        self.reports: list[str] = []
        self._first: float | None = None  # Horovod's first warning of the current stall
        self._last = 0.0
        self._reported = False  # this stall's report is made
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self.watch, name="hvdkit-hang-doctor", daemon=True).start()

    def close(self) -> None:
        self._done.set()

    def watch(self) -> None:
        """Every second: the ranks' notes; a report once one has waited the timeout."""
        while not self._done.wait(1.0):
            waits = self.notes()
            if not waits:
                with self._lock:
                    if self.clock() - self._last > 2.5 * self.config.warn_every:
                        self._reported = False  # no stall now: the next one is reported
                continue
            longest = max(s for waited in waits.values() for _, s in waited)
            if longest >= self.config.timeout and self._claim():
                found = stall.from_states(waits, len(self.host_of))
                self.report(found, longest, waits)

    def notes(self) -> dict[int, list[tuple[str, float]]]:
        """Each rank's collectives waited in, from its fresh note (written in the last
        3 s), ages brought up to now."""
        waits: dict[int, list[tuple[str, float]]] = {}
        now = time.time()
        for path in self.directory.glob("rank-*.state"):
            try:
                written = path.stat().st_mtime
                note = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced or removed meanwhile
            if now - written < 3.0:
                waits[int(note["rank"])] = [(n, s + now - written) for n, s in note["waiting"]]
        return waits

    def _claim(self) -> bool:
        """Whether this caller makes the current stall's report (once per stall)."""
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            return True

    def feed(self, rank: int | None, text: str) -> bool:
        """One line of a rank's stderr; True if it was Horovod's stall warning (held back:
        the doctor's report says it better)."""
        if rank != 0 or self.config.timeout <= 0:
            return False
        starts = stall.WARNING.search(text) is not None
        taken = self.reader.feed(text)
        if starts:
            now = self.clock()
            with self._lock:
                if self._first is None or now - self._last > 2.5 * self.config.warn_every:
                    self._first, self._reported = now, False  # a new stall
                self._last = now
                age = now - self._first + self.config.warn_every
            if age >= self.config.timeout and self._claim():
                # The warning's lines follow this one: read them first.
                threading.Timer(0.5, self._from_warning, args=(age,)).start()
        return taken

    def _from_warning(self, age: float) -> None:
        found = self.reader.complete()
        if found is not None:
            self.report(found, age)

    def report(self, found: stall.Stall, age: float,
               waits: dict[int, list[tuple[str, float]]] | None = None) -> str:  # fmt: skip
        """Ask every rank for its stacks, wait for them, and say what is going on."""
        stacks = self._stacks()
        places = {r: (stall.where(stall.main_thread(t)) if t else None) for r, t in
                  stacks.items()}  # fmt: skip
        who = self.config.who
        lines = [f"{who}: hang doctor: ranks have waited {int(age)} s or more in a "
                 f"collective for other ranks ({self.config.timeout_flag} "
                 f"{self.config.timeout})"]  # fmt: skip
        for rank, waited in sorted((waits or {}).items()):
            names = ", ".join(sorted({n for n, _ in waited}))
            lines.append(f"  rank {rank} ({self._host(rank)}) waits in: {names} "
                         f"({int(max(s for _, s in waited))} s)")  # fmt: skip
        for rank in sorted(found.missing):
            names = ", ".join(found.missing[rank]) + (" ..." if rank in found.more else "")
            lines.append(f"  rank {rank} ({self._host(rank)}) has not submitted: {names}")
        for rank, place in sorted(places.items()):
            lines.append(f"  rank {rank} ({self._host(rank)}): "
                         + (place.describe() if place else "no stack came back"))  # fmt: skip
        lines.append(f"  (every thread's stack: {self.directory}/rank-*.stacks)")
        lines.append(f"{who}: diagnosis: {stall.diagnose(found, places, len(self.host_of))}")
        stopping = self.config.stop and self.stop is not None
        flag = self.config.stop_flag
        then = f"stopping the job ({flag})" if stopping else (
            f"still waiting ({flag} ends the job here)")  # fmt: skip
        lines.append(f"{who}: {then}")
        text = "\n".join(lines)
        self.reports.append(text)
        self.say(text)
        if stopping:
            self.stopped = True
            assert self.stop is not None
            self.stop()
        return text

    def after_failure(self) -> str | None:
        """Once the job failed: one line naming each rank's shape and dtype, when Horovod
        refused a collective for a mismatch (the ranks' notes, :mod:`hvdkit.hang`)."""
        notes = []
        for path in self.directory.glob("rank-*.sent"):
            try:
                notes.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        line = stall.mismatch(notes)
        if line is not None:
            self.reports.append(line)
            self.say(f"{self.config.who}: diagnosis: {line}")
        return line

    def _host(self, rank: int) -> str:
        return self.host_of.get(rank, "?")

    def _stacks(self) -> dict[int, str | None]:
        """Each rank's stack dump written after the request (None: none came)."""
        asked = time.time()
        (self.directory / REQUEST).write_text(str(asked))
        want = set(self.host_of)
        got: dict[int, str] = {}
        deadline = self.clock() + STACK_WAIT_S
        while self.clock() < deadline and set(got) != want:
            for path in self.directory.glob("rank-*.stacks"):
                rank = path.name.split(".")[0].removeprefix("rank-")
                if rank.isdigit() and int(rank) in want and path.stat().st_mtime >= asked - 1:
                    got[int(rank)] = path.read_text(errors="replace")
            time.sleep(0.2)
        return {r: got.get(r) for r in sorted(want)}


ENGINE_TIMEOUT = "HVDKIT_STALL_TIMEOUT"
"""hvdkit.ray's and hvdkit.spark's hang doctor: seconds (default 60; 0: off)."""
ENGINE_ON_STALL = "HVDKIT_ON_STALL"
"""hvdkit.ray's and hvdkit.spark's hang doctor: ``wait`` (default) or ``stop``."""


def engine_config(who: str, environ: Mapping[str, str] = os.environ) -> HangConfig:
    """The hang doctor of an engine's ranks (hvdkit.ray, hvdkit.spark), set by
    :data:`ENGINE_TIMEOUT` and :data:`ENGINE_ON_STALL`: their functions keep Horovod's
    signatures. The doctor reads the ranks' notes in a folder on this machine, so it sees the
    ranks that run here (a local cluster)."""
    raw = environ.get(ENGINE_TIMEOUT, "60")
    on_stall = environ.get(ENGINE_ON_STALL, "wait")
    if not raw.isdigit() or on_stall not in ("wait", "stop"):
        raise ValueError(
            f"{who}: {ENGINE_TIMEOUT}={raw!r} {ENGINE_ON_STALL}={on_stall!r}: give whole "
            "seconds (0: no hang doctor) and wait or stop"
        )
    return HangConfig(timeout=int(raw), stop=on_stall == "stop", who=who,
                      timeout_flag=ENGINE_TIMEOUT, stop_flag=f"{ENGINE_ON_STALL}=stop")  # fmt: skip


@contextlib.contextmanager
def watching(
    config: HangConfig, folder: Path | None, host_of: dict[int, str], stop: Callable[[], object]
) -> Iterator[Doctor | None]:
    """A doctor over ``folder``'s notes while the block runs (None without a folder);
    ``stop`` ends the job for ``--on-stall stop``. ``host_of`` may be filled in as the ranks
    say where they run."""
    if folder is None:
        yield None
        return
    doctor = Doctor(config, folder, host_of)
    doctor.stop = stop
    doctor.start()
    try:
        yield doctor
    finally:
        doctor.close()


def engine_folder(config: HangConfig) -> tuple[Path | None, dict[str, str]]:
    """The folder an engine's ranks note in (None when the doctor is off) and the variables
    they need."""
    if config.timeout <= 0:
        return None, {}
    folder = config.folder()
    return folder, dict(item.split("=", 1) for item in config.env(folder))
