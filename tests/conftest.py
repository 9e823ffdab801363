"""Shared helpers: launching real Horovod jobs and reading what each rank reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from budget import SUMMARY

ROOT = Path(__file__).resolve().parents[1]
TEST_ALL = "HVDKIT_TEST_ALL"
# tests/ranked/ runs inside the ranks of a job (tests/in_ranks.py, tests/test_in_ranks.py).
collect_ignore = [] if os.environ.get("HVDKIT_IN_RANKS") else ["ranked"]


def pytest_addoption(parser) -> None:
    parser.addoption("--lane", type=int, choices=(1, 2), default=None,
                     help="only this lane's test files (tests/lanes.py; make test)")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """Under ``--lane``, that lane's tests only (``tests/lanes.py``). The core tests first,
    then the budgeted ones (``tests/budget.py``), then the image tests: CI builds the image in
    the background meanwhile, so they find it built. Tests marked ``extra`` run only under
    ``make test-all``."""
    from budget import DEADLINE, order, rotation
    from lanes import lane

    wanted = config.getoption("--lane")
    if wanted is not None:
        config.hook.pytest_deselected(items=[i for i in items if lane(i.nodeid) != wanted])
        items[:] = [i for i in items if lane(i.nodeid) == wanted]

    offset = rotation() if os.environ.get(DEADLINE) else 0
    items.sort(key=lambda item: order(item.nodeid, item.path.name == "test_docker_image.py",
                                      offset))  # fmt: skip
    if os.environ.get(TEST_ALL) == "1":
        return
    import pytest

    skip = pytest.mark.skip(reason=f"marked extra: make test-all ({TEST_ALL}=1) runs it")
    for item in items:
        if "extra" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item) -> None:
    """Under ``.ci/run``, a budgeted test starts only if it fits before the deadline."""
    from budget import DEADLINE, over_budget

    deadline = os.environ.get(DEADLINE)
    why = over_budget(item.nodeid, float(deadline) if deadline else None)
    if why:
        import pytest

        pytest.skip(why)


_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report) -> None:
    """Under ``.ci/run`` (``HVDKIT_CI_SUMMARY`` names a file): each test's part, seconds
    and outcome, for CI's summary line (``tests/budget.py``)."""
    if not os.environ.get(SUMMARY):
        return
    from budget import part

    entry = _outcomes.setdefault(report.nodeid, {"part": part(report.nodeid), "seconds": 0.0,
                                                 "outcome": "passed"})  # fmt: skip
    entry["seconds"] += report.duration
    if report.skipped:
        entry["outcome"] = "skipped"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else ""
        entry["budget"] = "CI time budget" in str(reason)
    elif report.failed:
        entry["outcome"] = "failed"


def pytest_sessionfinish(session) -> None:
    path = os.environ.get(SUMMARY)
    if path:
        Path(path).write_text(json.dumps(_outcomes))


WORKERS = Path(__file__).resolve().parent / "workers"
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def interruptible() -> None:
    """``preexec_fn`` for a process the test will Ctrl-C: SIGINT back to its default. A shell
    without job control starts background commands with SIGINT ignored, and that is inherited
    (a suite run in the background would start hvdkit deaf to the test's Ctrl-C); a user's
    terminal gives it the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def horovodrun(
    script: str,
    *args: str,
    np: int = 2,
    controller: str = "gloo",
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``horovodrun -np N -H localhost:N --gloo|--mpi python tests/workers/SCRIPT ARGS``, as
    ``hvdkit run`` starts it (:mod:`hvdkit.launch.horovodrun`: horovodrun's own code, its
    build probe answered from hvdkit's build record instead of ~3 s of TensorFlow's import a
    launch). The examples' tests run the ``horovodrun`` script itself (:func:`run_example`)."""
    from hvdkit.launch.horovodrun import launcher_argv

    argv = launcher_argv(
        [
            HOROVODRUN,
            "-np",
            str(np),
            "-H",
            f"localhost:{np}",
            f"--{controller}",
            sys.executable,
            str(WORKERS / script),
            *args,
        ]
    )
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"horovodrun failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def results(out: subprocess.CompletedProcess) -> dict[int, dict]:
    """RESULT lines by rank. The output is put back into whole lines per rank first (hvdkit's
    own Demux): MPI tags each piece a rank writes, and cuts a long line into pieces."""
    from hvdkit.launch.console import Demux

    demux = Demux()
    pieces = demux.feed(out.stdout, "stdout") + demux.flush()
    by_rank = {}
    decoder = json.JSONDecoder()
    for piece in pieces:
        # Untagged output (mpirun without --tag-output) can put two ranks' records on one
        # line: print() writes the text and its newline separately, and another rank's text
        # may land in between. Every record on a line is read.
        start = piece.text.find("RESULT ")
        while start != -1:
            value, end = decoder.raw_decode(piece.text, start + len("RESULT "))
            by_rank[value["rank"]] = value
            start = piece.text.find("RESULT ", end)
    return by_rank


def run_example(script: str, *args: str, controller: str = "gloo", env: dict | None = None) -> str:
    """``horovodrun -np 2`` of ``examples/SCRIPT``; its stdout (fails with the output tail)."""
    argv = [
        HOROVODRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        f"--{controller}",
        sys.executable,
        str(ROOT / "examples" / script),
        *args,
    ]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=850,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout
