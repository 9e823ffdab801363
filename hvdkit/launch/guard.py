"""``python -m hvdkit.launch.guard -- CMD ...``: what each rank runs under ``hvdkit run``.

It starts CMD, passes on SIGINT/SIGTERM/SIGHUP, and exits with CMD's status. Its point is the
remote case: when the launcher is interrupted, horovodrun kills its ``ssh`` clients, but sshd
does not signal a command that has no terminal, so a rank on another host would keep running.
The guard notices that it lost its parent (the ssh session) and stops CMD, so Ctrl-C stops
every rank on every host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5
GRACE_S = 5.0


def _stop(child: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if child.poll() is None:
        child.send_signal(sig)
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m hvdkit.launch.guard -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    child = subprocess.Popen(args)

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait(POLL_S)
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # orphaned: the launcher or its ssh session is gone
            print("hvdkit: launcher gone, stopping this rank", file=sys.stderr, flush=True)
            _stop(child)
            return 143


if __name__ == "__main__":
    sys.exit(main())
