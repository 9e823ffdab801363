"""Preemption and time limits: on SIGTERM or SIGUSR1 (a scheduler's warning, e.g. Slurm's
``--signal=B:USR1@90``), the sessions checkpoint at the next step boundary and every rank
exits with :data:`EXIT_CODE`; ``hvdkit run`` exits with it too (and with ``--requeue``
inside Slurm, requeues the job).

A signal may reach only some ranks (Slurm signals its own tasks; a rank started over ssh gets
nothing, only what ``hvdkit run`` relays to this host's ranks), so the ranks agree through a
small max-allreduce, about every :data:`INTERVAL_S` (in steps, the same on every rank). It is
started after step ``n`` and read after step ``n + 1``: every rank reads the same value at the
same step, and the collective overlaps a step.

:class:`Preemption` is pure but for the signal handlers; the collectives are passed in.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

EXIT_CODE = 75
"""What every rank, and ``hvdkit run``, exit with after a preempted job checkpointed (BSD's
EX_TEMPFAIL: run it again to resume)."""

MARKER = "hvdkit: preempted"
"""Rank 0's last line after it checkpointed; ``hvdkit run`` reads it from the job's output."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

INTERVAL_S = 0.5
"""About how often the ranks compare flags (and so the most a signal waits for its step)."""
MAX_GAP = 1000

AFTERMATH = re.compile(
    r"^(Process \d+ exit with status code (75|137|143)\.|Terminating remaining workers after "
    r"failure of Process \d+\.|Terminated)$"
)
"""What horovodrun and the shell say as the ranks exit after a preemption checkpoint (the
first rank out makes horovodrun stop the rest, which are past the checkpoint by then: SIGTERM,
then SIGKILL after its grace period for a rank still tearing down)."""

EXTRA = "hvdkit.preempted"
"""The checkpoint's ``extra`` entry for a preempted run's position (not shown in ``resumed``)."""


class Preempted(SystemExit):
    """Raised on every rank once the job has checkpointed after a signal; exits the script
    with :data:`EXIT_CODE` unless caught."""

    def __init__(self) -> None:
        super().__init__(EXIT_CODE)


class Preemption:
    """A flag set by SIGTERM/SIGUSR1 and the ranks' agreement on it.

    ``start(flag, seconds)`` starts a max-allreduce of this rank's flag and of the seconds
    since its previous exchange, and returns a handle; ``finish(handle)`` waits for it and
    returns both maxima. An exchange costs a collective (about 2 ms on CPU here), so after
    the first ones the ranks space them to about :data:`INTERVAL_S` apart, in steps: the gap
    is computed on every rank from the agreed maxima alone, so every rank exchanges, and
    stops, at the same step."""

    def __init__(
        self,
        start: Callable[[int, float], Any],
        finish: Callable[[Any], tuple[float, float]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._start, self._finish, self._clock = start, finish, clock
        self.received: int | None = None  # the signal this rank got
        self.agreed: int | None = None  # the largest signal number any rank got
        self._pending: Any = None
        self._installed: dict[int, Any] = {}
        self._pid = os.getpid()
        self._steps = 0
        self._next = 1  # the step after which the next exchange starts
        self._gap = 1  # steps between the last two exchanges
        self._started: float | None = None

    def install(self) -> bool:
        """Handle SIGTERM and SIGUSR1 here, where they still have Python's default action (a
        script's own handlers are kept). Main thread only. A repeat changes nothing: the same
        signal often arrives twice (from the scheduler, and passed on by ``hvdkit run`` and
        the rank's guard), so stopping at once is left to SIGINT, SIGKILL and ``hvdkit run``'s
        second signal."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._pid = os.getpid()
        for sig in SIGNALS:
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._installed[sig] = signal.signal(sig, self._on_signal)
        return bool(self._installed)

    def uninstall(self) -> None:
        for sig, previous in self._installed.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._installed.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child the fork hook missed: die as it would
            signal.signal(signum, self._installed.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def step_done(self) -> bool:
        """Call after every optimizer step, on every rank: whether the job is to checkpoint
        and stop now (the same answer on every rank)."""
        self._steps += 1
        if self._pending is not None:
            flag, seconds = self._finish(self._pending)
            self._pending, self.agreed = None, int(flag)
            if self.agreed > 0:
                return True
            per_step = seconds / self._gap
            gap = math.ceil(INTERVAL_S / per_step) if per_step > 0 else 1
            self._gap = min(max(gap, 1), MAX_GAP)
            self._next = self._next + self._gap
        if self._steps >= self._next and self._pending is None:
            now = self._clock()
            seconds = 0.0 if self._started is None else now - self._started
            self._started = now
            self._pending = self._start(0 if self.received is None else int(self.received), seconds)
        return False

    def describe(self) -> str:
        """Which signal stopped the job (the largest number any rank got)."""
        return signal.Signals(self.agreed).name if self.agreed else "a signal"


def among(
    size: int, start: Callable[[int, float], Any], finish: Callable[[Any], tuple[float, float]]
) -> Preemption:
    """A :class:`Preemption` for ``size`` ranks agreeing through ``start``/``finish``; a job
    of one rank agrees with itself (:func:`alone`), without a collective."""
    return Preemption(alone, agreed) if size == 1 else Preemption(start, finish)


def alone(flag: int, seconds: float) -> tuple[float, float]:
    """``start`` for a job of one rank: its own flag is the agreement (no collective, whose
    Horovod cycle would cost about a millisecond); pass :func:`agreed` as ``finish``."""
    return float(flag), seconds


def agreed(exchange: tuple[float, float]) -> tuple[float, float]:
    """``finish`` for an exchange that has completed already (:func:`alone`, a blocking one)."""
    return exchange


def split_extra(
    extra: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A resumed checkpoint's ``extra``: the script's part, and a preempted run's position
    (:data:`EXTRA`, or None)."""
    if not extra or EXTRA not in extra:
        return extra, None
    return {k: v for k, v in extra.items() if k != EXTRA}, extra[EXTRA]


def announce(by: str, epoch: int, batches: int, step: int, path: Any) -> str:
    """Rank 0's last line (it starts with :data:`MARKER`)."""
    return (
        f"{MARKER} ({by}) at epoch {epoch + 1}, batch {batches} (step {step}): checkpoint "
        f"{path}; run the same command again to resume from it"
    )


def _restore_in_child() -> None:
    """In a forked child (a PyDataset or DataLoader worker), SIGTERM and SIGUSR1 as they were
    before :meth:`Preemption.install`, and SIGTERM's default action where Python's table says
    default: a handler installed below Python (XLA's preemption notifier under JAX) is
    inherited too. A worker that kept either would survive the SIGTERM its pool stops it
    with, and the rank would wait for it at exit, or leave it behind. A script's own Python
    handler is kept."""
    for sig in SIGNALS:
        handler = signal.getsignal(sig)
        owner = getattr(handler, "__self__", None)
        if isinstance(owner, Preemption) and sig in owner._installed:
            restore = owner._installed[sig]
        elif sig == signal.SIGTERM and handler in (signal.SIG_DFL, None):
            restore = signal.SIG_DFL
        else:
            continue
        try:
            signal.signal(sig, restore)
        except ValueError:  # not the child's main thread: _on_signal's own check remains
            pass


os.register_at_fork(after_in_child=_restore_in_child)
