"""The flakiness sweep: run tests again and again with the machine loaded, and count.

    python tests/sweep.py --runs 5 --load 2 -- -m multiprocess      (or: make sweep)

Multi-process tests race on timing; a race that loses once in twenty runs on an idle machine
loses more often when the cores are busy. So ``--load`` CPU-bound processes run beside the
whole sweep, and the suite (any pytest arguments after ``--``) runs ``--runs`` times. The
summary lists every test that failed at least once, with its count and first failure line;
the exit status is non-zero if any did. Each run's JUnit XML stays in ``--out``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _burn(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the failure message) from one run's JUnit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        state, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                state = kind
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
                break
        out[test] = (state, message)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="times to run the suite (5)")
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes beside it (2)")
    parser.add_argument("--out", default="/tmp/hvdkit-sweep", help="folder for JUnit XML")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest arguments")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The burners end by themselves (a sweep that is killed leaves no load behind for long).
    burners = [
        multiprocessing.Process(target=_burn, args=(6 * 3600,), daemon=True)
        for _ in range(args.load)
    ]
    for burner in burners:
        burner.start()
    failed: Counter[str] = Counter()
    first: dict[str, str] = {}
    seen: Counter[str] = Counter()
    started = time.monotonic()
    try:
        for run in range(1, args.runs + 1):
            junit = out / f"run-{run}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *pytest_args]  # fmt: skip
            t0 = time.monotonic()
            # SIGINT at its default, as in CI and a terminal (a sweep started in the background
            # by a shell without job control would otherwise pass on "SIGINT ignored").
            code = subprocess.run(
                cmd, cwd=ROOT, stdin=subprocess.DEVNULL,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            ).returncode  # fmt: skip
            results = outcomes(junit) if junit.exists() else {}
            bad = [t for t, (state, _) in results.items() if state in ("failure", "error")]
            for test, (state, message) in results.items():
                seen[test] += state != "skipped"
                if state in ("failure", "error"):
                    failed[test] += 1
                    first.setdefault(test, message)
            print(f"sweep: run {run}/{args.runs}: {len(results)} tests, {len(bad)} failed, "
                  f"pytest exit {code}, {time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
            if not results:
                failed["(pytest produced no report)"] += 1
    finally:
        for burner in burners:
            burner.terminate()
    minutes = (time.monotonic() - started) / 60
    print(f"\nsweep: {args.runs} runs of {len(seen)} tests with {args.load} CPU-bound processes "
          f"beside them, {minutes:.1f} min", flush=True)  # fmt: skip
    if not failed:
        print("sweep: no test failed")
        return 0
    for test, count in failed.most_common():
        print(f"  FLAKY {count}/{seen[test] or args.runs}  {test}  {first.get(test, '')}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
