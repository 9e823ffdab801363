"""The ``hvdkit`` command: each subcommand lives in its own module under
:mod:`hvdkit.commands` and registers itself here."""

from __future__ import annotations

import argparse
import faulthandler
import signal

from hvdkit import __version__
from hvdkit.commands import bench, build_horovod, doctor, run

COMMANDS = (build_horovod, doctor, run, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdkit",
        description="Distributed data-parallel training with Horovod on today's Keras and PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"hvdkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvdkit`` console script; returns the exit status."""
    # `kill -USR1 PID` prints every thread's stack to stderr: where a stuck launch waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
