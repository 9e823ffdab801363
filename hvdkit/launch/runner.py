"""Running a :class:`~hvdkit.launch.plan.LaunchPlan`: horovodrun as a child process, its
output passed through live, Ctrl-C passed on, and a failing rank named at the end."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hvdkit import envvars, preempt
from hvdkit.horovod_build.config import CONTROLLERS, Controller
from hvdkit.launch import hang_doctor, preemption, private_env
from hvdkit.launch.console import Demux, Piece, is_noise, render
from hvdkit.launch.elastic_report import SUMMARY
from hvdkit.launch.hang_doctor import Doctor
from hvdkit.launch.horovodrun import END, launcher_argv
from hvdkit.launch.output import RankOutput, failure_message
from hvdkit.launch.plan import LaunchPlan

STOP_GRACE_S = 10.0
ORPHAN_WAIT_S = 15.0
PREEMPT_GRACE_S = 300.0
"""After a SIGTERM/SIGUSR1 passed on to the ranks: how long they have to reach a step boundary
and checkpoint before hvdkit stops them (a second signal, or Ctrl-C, stops them at once)."""


def _marked(code: int) -> bool:
    """Whether horovodrun ended by itself (so it wrote its end marker): not killed by a signal."""
    return code >= 0


def available_controllers(python: str = sys.executable) -> tuple[Controller, ...]:
    """Controllers this environment's Horovod can use: Gloo when built, MPI when built *and*
    ``mpirun`` is on PATH. Read from hvdkit's build record when there is one (fast), else from
    Horovod itself."""
    from hvdkit.horovod_build import record

    built = record.controllers()
    if built is None:
        from hvdkit.horovod_build.matrix import MatrixError, read_matrix

        try:
            built = [c for c, ok in read_matrix(python).controllers.items() if ok]
        except MatrixError:
            built = []
    return tuple(c for c in CONTROLLERS if c in built and (c != "mpi" or shutil.which("mpirun")))


def _from_files(output: RankOutput, output_dir: str, rank: int) -> None:
    """With --output-dir horovodrun writes each rank's output to files instead of the console."""
    for path in sorted(Path(output_dir).glob("**/rank.*/stderr")):
        if path.parent.name.split(".")[-1].lstrip("0") == str(rank).lstrip("0"):
            for line in path.read_text(errors="replace").splitlines()[-output.keep :]:
                output.feed(f"[{rank}]<stderr>:{line}")
            return


@dataclass(frozen=True)
class View:
    """Which ranks' output the console shows (None: every rank; horovodrun's own lines are
    always shown, every line is kept for the failure message) and whether progress bars are
    redrawn in place with a bare ``\r`` where the output is not a terminal (a Jupyter cell
    draws that; on a terminal they always are)."""

    ranks: frozenset[int] | None = None
    inline_progress: bool = False


class Console:
    """Writes the job's pieces of output as whole lines (:mod:`hvdkit.launch.console`): one
    prefix format, start-up noise dropped unless ``verbose``, progress bars redrawn in place
    on a terminal (on anything else only their final state is written). Records everything in
    ``output`` for the failure message; horovodrun's own closing traceback is held back in
    ``held``, shown only if hvdkit cannot say more plainly which rank failed."""

    def __init__(
        self, output: RankOutput, verbose: bool, doctor: Doctor | None = None, view: View = View()
    ) -> None:
        self.output, self.verbose, self.doctor, self.view = output, verbose, doctor, view
        self.gpu = Path("/dev/nvidiactl").exists()
        self.held: list[str] = []
        self.summarised = False
        self.preempted: str | None = None  # rank 0's line after its preemption checkpoint
        self._lock = threading.Lock()
        self._progress_on: TextIO | None = None

    def write(self, piece: Piece) -> None:
        sink = sys.stdout if piece.stream == "stdout" else sys.stderr
        if self.doctor is not None and piece.stream == "stderr" and not piece.progress:
            if self.doctor.feed(piece.rank, piece.text):
                return  # Horovod's stall warning: the doctor reports it
        if not self.verbose and is_noise(piece.text, gpu=self.gpu):
            return
        if not piece.progress:
            self.output.record(piece.rank, piece.stream, piece.text)
        if piece.rank in (0, None) and preempt.MARKER in piece.text:
            self.preempted = piece.text
        elif self.preempted is not None and preempt.AFTERMATH.match(piece.text):
            return  # horovodrun's account of the ranks' exit 75: expected, not a failure
        if piece.rank is None and piece.text.startswith(SUMMARY):
            self.summarised = True  # said why the elastic job stopped: no rank to guess
        elif (
            piece.rank is None
            and piece.stream == "stderr"
            and (self.held or piece.text.startswith("Traceback (most recent call last)"))
        ):
            self.held.append(piece.text + "\n")
            return
        if piece.rank is not None and self.view.ranks is not None:
            if piece.rank not in self.view.ranks:
                return  # kept above for the failure message, not shown
        terminal = sink.isatty()
        with self._lock:
            if piece.progress:
                if piece.rank in (None, 0) and (terminal or self.view.inline_progress):
                    # Keras ends each state with the backspaces of the next: "\r" does it. A
                    # notebook's output drops what a line held before its "\r".
                    shown = render(piece).rstrip("\b") + "\x1b[K" if terminal else (
                        render(piece, terminal=False))  # fmt: skip
                    sink.write("\r" + shown)
                    sink.flush()
                    self._progress_on = sink
                return
            if self._progress_on is not None:
                self._progress_on.write("\r\x1b[K" if terminal else "\r")
                self._progress_on.flush()
                self._progress_on = None
            sink.write(render(piece, terminal=terminal) + "\n")
            sink.flush()


def _pump(stream: TextIO, name: str, console: Console, done: threading.Event) -> None:
    """Pass horovodrun's ``stream`` to the console; ``done`` is set once horovodrun's end
    marker (or the end of the stream) has been read, i.e. once the console has everything
    horovodrun wrote to it."""
    demux = Demux()
    try:
        for chunk in stream:
            if END in chunk:
                chunk = chunk.split(END, 1)[0]
                for piece in demux.feed(chunk, name) + demux.flush():
                    console.write(piece)
                done.set()
                continue
            for piece in demux.feed(chunk, name):
                console.write(piece)
        for piece in demux.flush():
            console.write(piece)
    finally:
        done.set()


def _text(pipe: Any) -> TextIO:
    # newline="": a progress bar's "\r" must reach the demux as it is, not turned into "\n".
    return io.TextIOWrapper(pipe, encoding="utf-8", errors="replace", newline="")


def execute(
    plan: LaunchPlan,
    output_dir: str | None = None,
    verbose: bool = False,
    requeue: bool = False,
    doctor: Doctor | None = None,
    view: View = View(),
) -> int:
    """Run the job; returns its exit status (non-zero if any rank failed), after printing
    which rank failed, on which host, with the tail of its stderr. A SIGTERM or SIGUSR1 is
    passed on to the ranks (:mod:`hvdkit.preempt`): if they checkpoint and stop, the status is
    ``hvdkit.preempt.EXIT_CODE`` and with ``requeue`` the Slurm job is requeued."""
    output = RankOutput()
    # HVDKIT_ENV_EXCLUDE's names reach no rank, under MPI (which forwards horovodrun's whole
    # environment) as under Gloo; --env's own names still do.
    excluded = set(private_env.leave_out(os.environ))
    env = {k: v for k, v in os.environ.items() if k not in excluded} | plan.env
    env[envvars.LAUNCHER_PID] = str(os.getpid())
    # Own session: a Ctrl-C reaches hvdkit only, which stops horovodrun in order (the ranks
    # are stopped by horovodrun and, on other hosts, by their guard). If this process dies
    # unannounced (a notebook's kernel restarted, hvdkit run killed -9), horovodrun stops
    # its job itself (hvdkit.launch.horovodrun's watch on its parent).
    proc = subprocess.Popen(
        launcher_argv(plan.argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    console = Console(output, verbose, doctor, view)
    if doctor is not None:
        doctor.stop = lambda: stop(proc)
        doctor.start()
    held = console.held
    done = [threading.Event(), threading.Event()]
    pumps = [
        threading.Thread(target=_pump, args=(_text(pipe), name, console, event), daemon=True)
        for pipe, name, event in (
            (proc.stdout, "stdout", done[0]),
            (proc.stderr, "stderr", done[1]),
        )
    ]
    for pump in pumps:
        pump.start()
    interrupted = False
    warned = _Warning(proc.pid)
    try:
        with _signals_handled(warned):
            code = warned.wait(proc)
    except KeyboardInterrupt:
        interrupted = True
        print("\nhvdkit run: interrupted, stopping every rank ...", file=sys.stderr, flush=True)
        code = stop(proc)
    if interrupted:
        for pump in pumps:
            pump.join(timeout=5)
        return 130
    # The failing rank is named from horovodrun's complete output: wait until both pumps have
    # read its end marker. Only a horovodrun killed before writing it (no marker) ends the wait
    # on EOF, which processes it left behind can delay, hence the bound in that case alone.
    for event in done:
        if not event.wait(timeout=None if _marked(code) else ORPHAN_WAIT_S):
            break
    if doctor is not None and doctor.stopped:
        return hang_doctor.EXIT_CODE  # its report said who and where
    if console.preempted is not None:
        print(f"hvdkit run: the job checkpointed and every rank stopped; exit "
              f"{preempt.EXIT_CODE}", file=sys.stderr, flush=True)  # fmt: skip
        if requeue:
            _requeue()
        return preempt.EXIT_CODE
    if code != 0 and warned.name:
        print(f"hvdkit run: stopped by {warned.name} (no hvdkit session checkpointed: give "
              "setup() a checkpoint= path to resume after a preemption)",
              file=sys.stderr, flush=True)  # fmt: skip
        return 130
    if code != 0 and console.summarised:
        pass  # an elastic job: horovodrun's wrapper named the reason and the hosts lost
    elif code != 0:
        host_of = {slot.rank: slot.host for slot in plan.ranks}
        if output_dir:
            for slot in plan.ranks:
                if not output.tail(slot.rank):
                    _from_files(output, output_dir, slot.rank)
        failed = output.failed_rank()
        if failed is None and not output.unreachable():
            sys.stderr.writelines(held)
        print(failure_message(output, host_of, code), file=sys.stderr, flush=True)
        if doctor is not None:
            doctor.after_failure()
    elif held:
        sys.stderr.writelines(held)
    return code


class _Warning:
    """A SIGTERM or SIGUSR1 (a scheduler's time limit or preemption warning, CI's timeout):
    the first is passed on to the ranks here, which checkpoint at their next step and stop
    (hvdkit sessions; a plain script just ends); a second, or the ranks not done within
    :data:`PREEMPT_GRACE_S`, stops the job as Ctrl-C does."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.name: str | None = None
        self.at = 0.0

    def __call__(self, signum: int, frame: Any) -> None:
        if self.name is not None:
            raise KeyboardInterrupt
        self.name, self.at = signal.Signals(signum).name, time.monotonic()
        ranks = preemption.relay(self.root, signum)
        print(f"hvdkit run: {self.name}: passed on to the {ranks} rank(s) here; hvdkit "
              "sessions checkpoint at their next step and stop (again to stop at once)",
              file=sys.stderr, flush=True)  # fmt: skip

    def wait(self, proc: subprocess.Popen) -> int:
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if self.name is not None and time.monotonic() - self.at > PREEMPT_GRACE_S:
                    raise KeyboardInterrupt from None


def _requeue() -> None:
    """``scontrol requeue`` this Slurm job and say what happened.

    The requeue has Slurm end this batch script at once (SIGTERM, then SIGKILL KillWait
    later): SIGTERM is ignored until the line is printed, or the log would not say it."""
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        print(f"hvdkit run: {preemption.requeue(os.environ)}", file=sys.stderr, flush=True)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_handled(warned: _Warning) -> Iterator[None]:
    """SIGTERM and SIGUSR1 go to ``warned``; SIGHUP (a closed terminal) stops the job as
    Ctrl-C does. By default these would end hvdkit alone and leave horovodrun and every rank
    running in their own session."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    handlers: dict[signal.Signals, Callable[[int, Any], None]] = {
        signal.SIGTERM: warned,
        signal.SIGUSR1: warned,
        signal.SIGHUP: interrupt,
    }
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (hvdkit.run called from a thread)
        return
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop(proc: subprocess.Popen) -> int:
    """SIGINT to horovodrun's process group (it stops its ranks), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second Ctrl-C: go straight on to the next signal
            continue
    return proc.wait()
