"""What the scenario generators' tests share (tests/test_torch_scenarios.py,
tests/test_keras_scenarios.py): the seed a CI draws its cases with, reading the workers'
records back from a job's output, and the report of the failing cases with their
reproducers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import zlib
from typing import Any

from conftest import ROOT


def commit_seed() -> int:
    """``HVDKIT_SCENARIO_SEED``, else the checked-out commit's: each CI tries other cases."""
    if "HVDKIT_SCENARIO_SEED" in os.environ:
        return int(os.environ["HVDKIT_SCENARIO_SEED"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return zlib.crc32((head.stdout.strip() or "no commit").encode())


def records(stdout: str, tag: str = "CASE ") -> dict[int, dict[int, dict]]:
    """The worker's ``tag`` lines, ``{case: {rank: record}}``, from whole lines per rank
    (hvdkit's own Demux: MPI tags each piece a rank writes and cuts long lines)."""
    from hvdkit.launch.console import Demux

    demux = Demux()
    decoder = json.JSONDecoder()
    found: dict[int, dict[int, dict]] = {}
    for piece in demux.feed(stdout, "stdout") + demux.flush():
        start = piece.text.find(tag)
        while start != -1:
            value, end = decoder.raw_decode(piece.text, start + len(tag))
            found.setdefault(value["case"], {})[value.get("rank", 0)] = value
            start = piece.text.find(tag, end)
    return found


def name_lost_ranks(ranks: dict[int, dict], size: int, stderr: str) -> None:
    """Give each of the ``size`` ranks missing from a case's ``ranks`` an error: it died
    without a record, and the end of the job's stderr is what ``hvdkit run`` saw of it."""
    lost = {"error": f"no record; the job's stderr ends: {stderr[-2000:]}"}
    ranks.update({r: lost for r in range(size) if r not in ranks})


def report(scenarios: list[Any], problems: list[list[str]], seed: int | None = None) -> str:
    """Each failing case, its problems and its one-line reproducer."""
    lines = []
    for case, found in zip(scenarios, problems, strict=True):
        if found:
            lines.append(f"{case}\n    " + "\n    ".join(found) + f"\n    {case.reproducer(seed)}")
    return "\n".join(lines)


def watched(argv: list[str], env: dict | None, case_timeout: float) -> tuple[str, str, bool]:
    """Run ``argv``; stopped (SIGHUP: ``hvdkit run`` stops its ranks) when no case ends for
    ``case_timeout`` seconds. Its stdout, stderr, and whether it was stopped."""
    proc = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
    last = [time.monotonic()]

    def read(name: str) -> None:
        for line in getattr(proc, name):
            lines[name].append(line)
            if "CASE " in line:
                last[0] = time.monotonic()

    readers = [threading.Thread(target=read, args=(n,), daemon=True) for n in lines]
    for reader in readers:
        reader.start()
    hung = False
    while proc.poll() is None:
        if time.monotonic() - last[0] > case_timeout:
            hung = True
            proc.send_signal(signal.SIGHUP)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        time.sleep(1)
    proc.wait()
    for reader in readers:
        reader.join(10)
    return "".join(lines["stdout"]), "".join(lines["stderr"]), hung
