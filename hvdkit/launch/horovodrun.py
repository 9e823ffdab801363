"""``python -m hvdkit.launch.horovodrun ARGS``: horovodrun, run in-process, that marks the end of
its output.

``hvdkit run`` reads horovodrun's stdout and stderr through two pipes and names the failing rank
from what horovodrun said. Waiting for the pipes' end-of-file to know that everything has been
read is not enough: processes horovodrun started can outlive it and keep the pipes open, and
waiting a fixed time instead is a race (a reader that is behind under load misses the last
lines, where horovodrun names the rank). So this wrapper writes :data:`END` as the last line of
each stream once horovodrun is done, and the reader knows its output is complete when it has
read that line, however long that takes.

Under MPI horovodrun ends by replacing itself with ``mpirun`` (``os.execve``), after which
nothing could write the marker; here ``mpirun`` runs as a child instead, with the same
arguments, environment and process group (so a Ctrl-C sent to the group reaches it as before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from hvdkit import envvars

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
END = "\x1ehvdkit: horovodrun is done\x1e"
"""The last line of each stream (record separators: no program prints this by chance)."""


def launcher_argv(horovodrun_argv: Sequence[str]) -> list[str]:
    """What runs a planned ``horovodrun ARGS`` (``LaunchPlan.argv``): this module in the same
    Python. Every hvdkit launch goes through it (``hvdkit run``, the doctor's checks, the
    bench's jobs), so none pays horovodrun's build probe (about 3 s of TensorFlow's import in a
    forked process, each launch) when hvdkit's build record can answer."""
    return [sys.executable, "-m", "hvdkit.launch.horovodrun", *horovodrun_argv[1:]]


def without_end(text: str) -> str:
    """``text`` without the :data:`END` markers (for messages quoting the output); a marker
    written after output that did not end its line is taken off that line."""
    return "\n".join(line.replace(END, "") for line in text.split("\n") if line != END)


def _run_instead_of_exec(path: str, args: Sequence[str], env: Mapping[str, str]) -> None:
    """``os.execve``'s replacement: run the program as a child and exit with its status. The
    child is stopped (SIGTERM) if this process dies first: a caller's timeout that kills this
    process must not leave ``mpirun`` and its ranks behind, as it did not when horovodrun
    replaced itself with ``mpirun``."""
    args = list(args)
    shell = os.path.basename(path) in ("sh", "bash", "dash")
    if shell and len(args) == 3 and args[1] == "-c" and "=" not in args[2].split(" ", 1)[0]:
        # horovodrun's ``/bin/sh -c 'mpirun ...'``: the shell execs mpirun rather than waiting
        # for it as a child, so the request below reaches mpirun (it survives an exec).
        args[2] = f"exec {args[2]}"
    child = subprocess.Popen(args, executable=path, env=dict(env),
                             preexec_fn=_dies_with_parent())  # fmt: skip
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:  # the group's Ctrl-C reached mpirun too: it stops its ranks
            continue
    raise SystemExit(code if code >= 0 else 128 - code)


def _dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux for SIGTERM when the parent dies (``prctl``'s
    ``PR_SET_PDEATHSIG``), or None where that is not available. libc is loaded here, before
    the fork: the child only calls it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


ORPHAN_POLL_S = 1.0


def _stop_when_orphaned(parent: int, poll: float = ORPHAN_POLL_S) -> None:
    """Once ``parent`` (hvdkit's launcher: ``hvdkit run``, a notebook's kernel) is gone, stop
    the job as the launcher's Ctrl-C would: SIGINT to this process group (horovodrun stops
    its ranks), then SIGTERM, then SIGKILL. The launcher started this process in a session
    of its own, which its death does not reach; Linux's parent-death signal would need a
    ``preexec_fn``, unsafe in a kernel's threaded process."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            os.killpg(0, sig)
            time.sleep(grace)

    threading.Thread(target=watch, name="hvdkit-orphan-watch", daemon=True).start()


def _answer_build_checks_from_the_record() -> None:
    """horovodrun asks "built with Gloo? with MPI?" by loading each framework's Horovod
    extension in a new process, TensorFlow's first: seconds per launch, and TensorFlow's
    start-up logging even for a PyTorch-only job. hvdkit's build record already knows."""
    from hvdkit.horovod_build import record

    built = record.controllers()
    if built is None:
        return
    import horovod.runner.launch as launch

    launch.gloo_built = lambda verbose=False: "gloo" in built
    launch.mpi_built = lambda verbose=False: "mpi" in built


def main() -> int:
    sys.argv[0] = "horovodrun"
    launcher = os.environ.pop(envvars.LAUNCHER_PID, "")  # the ranks need not see it
    if launcher.isdigit():
        _stop_when_orphaned(int(launcher))
    os.execve = _run_instead_of_exec  # type: ignore[assignment]  # narrower, for horovodrun only
    _answer_build_checks_from_the_record()
    from hvdkit.launch import private_env

    private_env.install()
    report = None
    if any(arg in sys.argv for arg in ("--min-np", "--min-num-proc", "--host-discovery-script")):
        from hvdkit.launch import elastic_report

        report = elastic_report.Report()
        report.stall_timeout = float(os.environ.get(envvars.ELASTIC_STALL_TIMEOUT, "30"))
        elastic_report.install(report)
        elastic_report.check_discovery(report)
    code = 0
    try:
        from horovod.runner.launch import run_commandline

        result = run_commandline()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:  # argparse errors, --help, --check-build
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - horovodrun's own way to fail: a traceback, status 1
        traceback.print_exc()
        code = 1
    if report is not None and code != 0:
        print(report.summary(), file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{END}\n")
        stream.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
