"""Running a :class:`~hvdkit.launch.plan.LaunchPlan`: horovodrun as a child process, its
output passed through live, Ctrl-C passed on, and a failing rank named at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TextIO

from hvdkit.launch.horovodrun import END
from hvdkit.launch.output import RankOutput, failure_message
from hvdkit.launch.plan import LaunchPlan

STOP_GRACE_S = 10.0
ORPHAN_WAIT_S = 15.0


def _marked(code: int) -> bool:
    """Whether horovodrun ended by itself (so it wrote its end marker): not killed by a signal."""
    return code >= 0


def available_controllers(python: str = sys.executable) -> tuple[str, ...]:
    """Controllers this environment's Horovod can use: Gloo when built, MPI when built *and*
    ``mpirun`` is on PATH. Read from hvdkit's build record when there is one (fast), else from
    Horovod itself."""
    from hvdkit.build.builder import MARKER

    built: list[str] | None = None
    try:
        built = list(json.loads(MARKER.read_text())["inputs"]["controllers"])
    except (OSError, ValueError, KeyError, TypeError):
        from hvdkit.build.matrix import MatrixError, read_matrix

        try:
            built = [c for c, ok in read_matrix(python).controllers.items() if ok]
        except MatrixError:
            built = []
    return tuple(
        c for c in ("gloo", "mpi") if c in built and (c != "mpi" or shutil.which("mpirun"))
    )


def _from_files(output: RankOutput, output_dir: str, rank: int) -> None:
    """With --output-dir horovodrun writes each rank's output to files instead of the console."""
    for path in sorted(Path(output_dir).glob("**/rank.*/stderr")):
        if path.parent.name.split(".")[-1].lstrip("0") == str(rank).lstrip("0"):
            for line in path.read_text(errors="replace").splitlines()[-output.keep :]:
                output.feed(f"[{rank}]<stderr>:{line}")
            return


def _pump(
    stream: TextIO, sink: TextIO, output: RankOutput, held: list[str], done: threading.Event
) -> None:
    """Pass ``stream`` on to ``sink`` line by line, recording it in ``output``; ``done`` is set
    once horovodrun's end marker (or the end of the stream) has been read, i.e. once
    ``output`` holds everything horovodrun wrote to it."""
    try:
        for line in stream:
            if END in line:
                line = line.split(END, 1)[0]
                done.set()
                if not line:
                    continue
            output.feed(line)
            # horovodrun ends a failed job with its own Python traceback; it is held back and
            # shown only if hvdkit cannot say more plainly which rank failed.
            if held or (
                line.startswith("Traceback (most recent call last)") and sink is sys.stderr
            ):
                held.append(line)
                continue
            sink.write(line)
            sink.flush()
    finally:
        done.set()


def launcher_argv(plan: LaunchPlan) -> list[str]:
    """What runs ``plan.argv``: horovodrun through :mod:`hvdkit.launch.horovodrun` in the same
    Python, which marks where its output ends."""
    return [sys.executable, "-m", "hvdkit.launch.horovodrun", *plan.argv[1:]]


def execute(plan: LaunchPlan, output_dir: str | None = None) -> int:
    """Run the job; returns its exit status (non-zero if any rank failed), after printing
    which rank failed, on which host, with the tail of its stderr."""
    output = RankOutput()
    env = {**os.environ, **plan.env}
    # Own session: a Ctrl-C reaches hvdkit only, which stops horovodrun in order (the ranks
    # are stopped by horovodrun and, on other hosts, by their guard).
    proc = subprocess.Popen(
        launcher_argv(plan),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        env=env,
        start_new_session=True,
    )
    held: list[str] = []
    done = [threading.Event(), threading.Event()]
    pumps = [
        threading.Thread(
            target=_pump, args=(proc.stdout, sys.stdout, output, [], done[0]), daemon=True
        ),
        threading.Thread(
            target=_pump, args=(proc.stderr, sys.stderr, output, held, done[1]), daemon=True
        ),
    ]
    for pump in pumps:
        pump.start()
    interrupted = False
    try:
        code = proc.wait()
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
    if code != 0:
        host_of = {slot.rank: slot.host for slot in plan.ranks}
        if output_dir:
            for slot in plan.ranks:
                if not output.tail(slot.rank):
                    _from_files(output, output_dir, slot.rank)
        failed = output.failed_rank()
        if failed is None:
            sys.stderr.writelines(held)
        print(failure_message(output, host_of, code), file=sys.stderr, flush=True)
    elif held:
        sys.stderr.writelines(held)
    return code


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
