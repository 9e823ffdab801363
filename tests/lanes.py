"""``make test``'s two lanes: the suite split by test file into two pytest runs side by side.

Most of the suite's multi-process tests leave the CPU idle for much of their time: an elastic
kill waits out Horovod's detection, the hang doctor its stall timeout, Slurm, Ray, Spark and
sshd their start-up, a notebook its kernel. Measured 2026-11-29 on this 2-core machine: the
hang and preemption tests (156 s alone) beside the Keras scenarios (122 s alone) took 209 s
for both, 278 s one after the other. So the files that mostly wait run in a second lane
(:data:`SECOND_LANE`), beside the rest; each lane orders its tests as ``tests/budget.py``
says and checks CI's deadline itself.

The split is by file so that what cannot run twice at once stays in one lane: the Slurm
cluster (a bridge and daemons on fixed addresses and ports), Ray (``ray start`` leaves its
address for every later ``ray.init()`` on the machine), Spark, and the docs' examples that
start Ray and Spark. ``tests/test_lanes_units.py`` checks that every test file that starts
one of them is in the second lane.

    python tests/lanes.py [--lanes 2] -- PYTEST_ARGS...

Lane 1 prints as usual; lane 2 writes ``.test-lane2.log`` and its summary (durations, skips,
failures with their tracebacks) is printed when both are done. ``--lanes 1`` is one plain
pytest run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# Not from conftest: inside a job's ranks, "conftest" is tests/ranked/conftest.py.
from budget import DEADLINE, SUMMARY, file_name

ROOT = Path(__file__).resolve().parents[1]
LOG_DEFAULT = ROOT / ".test-lane2.log"
IMAGE_TESTS_S = 75
"""What the image tests take after lane 1's deadline (1.2-1.4 min in the cold CIs of
2026-11-28 and 29)."""
NO_TESTS = 5  # pytest's exit status when a lane's selection is empty

SECOND_LANE = frozenset({
    # Waiting on timeouts and detection: elastic kills, the hang doctor, signals; the seam
    # matrix's kills and preemptions; make run's console.
    "test_elastic.py", "test_hang.py", "test_preemption.py", "test_func_run.py",
    "test_seams.py", "test_console.py",
    # Daemons and clusters started by the test (one at a time: fixed addresses and ports).
    "test_slurm.py", "test_ray.py", "test_spark.py", "test_launch_ssh.py",
    # The docs' examples start Ray and Spark; notebooks wait on their kernels; fresh venvs
    # wait on pip's disk writes.
    "test_docs.py", "test_notebooks.py", "test_setup.py", "test_packaging.py",
    # To even the lanes out (2026-12-02: the fresh-checkout setup test went from 290 s to 62 s).
    "test_doctor.py",
})  # fmt: skip
"""Test files that run in the second lane."""


def lane(nodeid: str) -> int:
    """The lane (1 or 2) of a test, by its file."""
    return 2 if file_name(nodeid) in SECOND_LANE else 1


def lane_env(n: int, env: Mapping[str, str]) -> dict[str, str]:
    """Lane ``n``'s environment: its own CI summary file, and for lane 2 a deadline later by
    :data:`IMAGE_TESTS_S`. Lane 1 runs the image tests after CI's deadline; lane 2 has none,
    so its budgeted tests may use that time without CI ending later."""
    out = dict(env)
    if env.get(SUMMARY):
        out[SUMMARY] = f"{env[SUMMARY]}.lane{n}"
    if n == 2 and env.get(DEADLINE):
        out[DEADLINE] = str(float(env[DEADLINE]) + IMAGE_TESTS_S)
    return out


def status(codes: list[int]) -> int:
    """One exit status for the lanes: a lane that selected no test is no failure unless
    none selected any."""
    ran = [c for c in codes if c != NO_TESTS]
    if not ran:
        return NO_TESTS
    return next((c for c in ran if c != 0), 0)


def lane2_report(log: str) -> str:
    """What lane 2's log shows at the end: from pytest's first closing section (its failures,
    the slowest durations, the skips) to the last line; the whole log when it has none."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("=") and any(
            s in line for s in ("FAILURES", "ERRORS", "slowest", "short test summary")
        ):
            return "\n".join(lines[i:])
    return "\n".join(lines[-60:])


def merge_summaries(path: Path, parts: list[Path]) -> None:
    """CI's per-test summary (``conftest.py``) from each lane's file, into ``path``."""
    merged: dict = {}
    for p in parts:
        if p.exists():
            merged.update(json.loads(p.read_text()))
            p.unlink()
    path.write_text(json.dumps(merged))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=2)
    parser.add_argument("--log", type=Path, default=LOG_DEFAULT, help="lane 2's output")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    pytest = [sys.executable, "-m", "pytest", *args.pytest_args]
    if args.lanes == 1:
        return subprocess.call(pytest)
    summary = os.environ.get(SUMMARY)

    start, log_path = time.time(), args.log
    print(f"lane 2 ({', '.join(sorted(SECOND_LANE))}) runs beside this one; its output: {log_path}",
          flush=True)  # fmt: skip
    with log_path.open("w") as log:
        # Its own session, so that its jobs go with it if this run is stopped; a Ctrl-C at
        # the terminal reaches it through the handler below.
        second = subprocess.Popen(
            [*pytest, "--lane", "2", "-o", "cache_dir=.pytest_cache/lane2"], stdout=log,
            stderr=subprocess.STDOUT, env=lane_env(2, os.environ), start_new_session=True,
        )  # fmt: skip
    ended: list[float] = []

    def watch() -> None:
        second.wait()
        ended.append(time.time())

    threading.Thread(target=watch, daemon=True).start()
    first = subprocess.Popen([*pytest, "--lane", "1"], env=lane_env(1, os.environ))

    def forward(signum: int, _frame: object) -> None:
        os.killpg(second.pid, signum)
        if signum != signal.SIGINT:  # a terminal's Ctrl-C reached lane 1 itself
            first.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code1 = first.wait()
        first_s = time.time() - start
        if second.poll() is None:
            print(f"\nlane 1 done in {first_s:.0f} s; waiting for lane 2 ({log_path})", flush=True)
        code2 = second.wait()
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
        if first.poll() is None:
            first.kill()
        for s, handler in old.items():
            signal.signal(s, handler)
    print(f"\n{'=' * 30} lane 2 ({log_path.name}) {'=' * 30}")
    print(lane2_report(log_path.read_text(errors="replace")))
    second_s = (ended[0] if ended else time.time()) - start
    print(f"lanes: 1 took {first_s:.0f} s (exit {code1}), 2 took {second_s:.0f} s (exit {code2})")
    if summary:
        merge_summaries(Path(summary), [Path(f"{summary}.lane{n}") for n in (1, 2)])
    return status([code1, code2])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
