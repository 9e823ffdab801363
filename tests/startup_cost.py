"""How much of the suite's time is process start and framework imports, per test file
(``make startup-cost``; issue 50). Runs pytest with tests/startup/sitecustomize.py on
``PYTHONPATH``, so every Python process a test starts logs its interpreter start and its first
imports of the heavy frameworks, then prints a table per test file: the file's wall time, the
processes its tests started, their start + import seconds, and the estimated share of the
wall time (those seconds over the 2 cores: the ranks of a job start side by side)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table(processes: list[dict], tests: dict[str, dict], cores: int) -> str:
    wall: dict[str, float] = collections.Counter()
    for nodeid, t in tests.items():
        wall[nodeid.split("::")[0]] += t["seconds"]
    started: dict[str, list[float]] = collections.defaultdict(list)
    for p in processes:
        if p["test"]:
            started[p["test"].split("::")[0]].append(p["boot"] + sum(p["imports"].values()))
    rows = []
    for name in sorted(set(wall) | set(started)):
        costs = started.get(name, [])
        share = sum(costs) / cores / wall[name] if wall.get(name) else 0.0
        rows.append((name, wall.get(name, 0.0), len(costs), sum(costs), min(share, 1.0)))
    rows.sort(key=lambda r: -r[3])
    total_wall = sum(wall.values())
    total_cost = sum(r[3] for r in rows)
    lines = ["| test file | wall s | Python processes | start + imports s | share of wall |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {n} | {w:.0f} | {k} | {c:.0f} | {s:.0%} |" for n, w, k, c, s in rows]
    share = total_cost / cores / total_wall if total_wall else 0.0
    lines.append(f"| **all** | {total_wall:.0f} | {sum(r[2] for r in rows)} | {total_cost:.0f} "
                 f"| {share:.0%} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--log", type=Path, help="keep the per-process log here")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="startup-cost-"))
    log = args.log or work / "processes.jsonl"
    summary = work / "tests.json"
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    env = {**os.environ, "HVDKIT_STARTUP_LOG": str(log), "HVDKIT_CI_SUMMARY": str(summary),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "startup"),
                                                       os.environ.get("PYTHONPATH")]))}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *extra], cwd=ROOT, env=env)
    processes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    tests = json.loads(summary.read_text()) if summary.exists() else {}
    print(table(processes, tests, args.cores))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
