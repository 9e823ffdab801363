"""pytest inside each rank of one job (tests/in_ranks.py runs it as ``-p ranks_plugin``): each
test's outcome on this rank, as JSON lines in ``$HVDKIT_IN_RANKS_DIR/rank-N.jsonl``, a
``start`` line first, so that a job that hangs or dies shows the test it was in.

The ranks stop at the first failure: a rank whose test failed exits at once (horovodrun then
stops the others, which may be waiting in that test's collectives); a rank whose test passed
learns from the others (``allgather``, set by the ranked files' conftest) that it may go on. A
test that runs past ``$HVDKIT_IN_RANKS_TIMEOUT`` seconds on a rank (a hang) writes every
thread's stack to ``rank-N.stacks`` and ends the rank
(:func:`faulthandler.dump_traceback_later`)."""

from __future__ import annotations

import faulthandler
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

allgather: Callable[[Any], list] | None = None  # set by tests/ranked/conftest.py
_session: Any = None
_failed: dict[str, bool] = {}
_stacks: Any = None


def _rank() -> int:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _write(line: dict) -> None:
    with open(_where("jsonl"), "a") as f:
        f.write(json.dumps({**line, "time": time.time()}) + "\n")


def pytest_sessionstart(session) -> None:
    global _session
    _session = session


def _where(suffix: str) -> Path:
    return Path(os.environ["HVDKIT_IN_RANKS_DIR"]) / f"rank-{_rank()}.{suffix}"


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _write({"test": nodeid, "event": "start"})
    global _stacks
    if _stacks is None:
        _stacks = open(_where("stacks"), "w")
    _stacks.write(f"--- {nodeid}\n")
    _stacks.flush()
    faulthandler.dump_traceback_later(float(os.environ.get("HVDKIT_IN_RANKS_TIMEOUT", "120")),
                                      exit=True, file=_stacks)  # fmt: skip


def pytest_runtest_logreport(report) -> None:
    # A test's outcome: its call, or the setup/teardown that failed or skipped it.
    if report.failed:
        _failed[report.nodeid] = True
    if report.when != "call" and report.passed and report.when != "teardown":
        return
    if report.when == "teardown":
        faulthandler.cancel_dump_traceback_later()
        if report.passed:
            _agree(report.nodeid)
            return
    line = {"test": report.nodeid, "event": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 3)}  # fmt: skip
    if not report.passed:
        line["longrepr"] = str(report.longrepr)[-6000:]
    _write(line)
    if report.when == "teardown" or (report.failed and report.when == "call"):
        _agree(report.nodeid)


def _agree(nodeid: str) -> None:
    """A rank whose test failed exits now; the others learn whether every rank may go on."""
    if _failed.get(nodeid):
        _write({"test": nodeid, "event": "stop", "why": f"{nodeid} failed on rank {_rank()}"})
        os._exit(1)
    if allgather is None:
        return
    try:
        allgather(True)
    except Exception as exc:  # noqa: BLE001 (another rank exited: Horovod stopped)
        _write({"test": nodeid, "event": "stop", "why": f"another rank stopped: {exc}"})
        _session.shouldstop = "another rank stopped"
