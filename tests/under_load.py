"""Run a command several times with every core kept busy (one spinning process per core), to
check that a verdict derived from timings does not flip under load (``make
profile-under-load``). Prints each run's ``PROFILE`` lines and its result; exit 1 if any run
failed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]  # fmt: skip
    failed = 0
    try:
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if "PROFILE " in ln]
            tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
            failed += done.returncode != 0
            print(f"run {run}: exit {done.returncode} in {time.monotonic() - start:.0f} s, "
                  f"{len(hogs)} hogs; {tail[0]}", flush=True)  # fmt: skip
            for line in lines:
                print("   " + line[line.index("PROFILE ") :], flush=True)
            if done.returncode:
                print(done.stdout[-3000:], flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"{args.runs - failed} of {args.runs} runs passed with every core busy", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
