"""``python -m hvdkit.launch.guard -- CMD ...``: what each rank runs under ``hvdkit run``.

It starts CMD, passes on SIGINT/SIGTERM/SIGHUP/SIGUSR1 (SIGUSR1: a preemption warning, which
``hvdkit run`` relays to this host's guards), and exits with CMD's status. Its point is the
remote case: when the launcher is interrupted, horovodrun kills its ``ssh`` clients, but sshd
does not signal a command that has no terminal, so a rank on another host would keep running.
The guard stops CMD once the session that started it is gone, so Ctrl-C stops every rank on
every host. "Gone" is either of:

- the read end of its stdout or stderr pipe was closed: sshd (or horovodrun, locally) exited.
  This is the reliable sign, because the remote shell between sshd and the guard
  (``cd DIR ; CMD``) stays alive when sshd exits;
- its parent changed (it was orphaned), for output that does not go to a pipe.
"""

from __future__ import annotations

import os
import select
import signal
import stat
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


def _output_watch() -> select.poll:
    """A poll object that reports when the reader of stdout or stderr goes away."""
    poller = select.poll()
    for fd in (1, 2):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            poller.register(fd, 0)  # 0: only POLLERR/POLLHUP, which poll always reports
    return poller


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m hvdkit.launch.guard -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    watch = _output_watch()
    child = subprocess.Popen(args)

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    while True:
        broken = watch.poll(POLL_S * 1000)
        code = child.poll()
        if code is not None:
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number
        if broken or os.getppid() != parent:
            _stop(child)  # nobody is left to read a message saying so
            return 143


if __name__ == "__main__":
    sys.exit(main())
