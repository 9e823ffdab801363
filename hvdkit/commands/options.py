"""Command-line options that more than one subcommand takes, defined once: the flag, its
type and metavar live here; each subcommand gives the help that fits it."""

from __future__ import annotations

import argparse
from typing import Any


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    """``--ssh-port`` and ``--ssh-identity-file`` (``hvdkit run``, ``hvdkit doctor``)."""
    parser.add_argument("--ssh-port", type=int, metavar="PORT", help="sshd port on the hosts")
    parser.add_argument("--ssh-identity-file", metavar="FILE", help="private key for ssh")


def add_hostfile(parser: Any, help: str) -> None:  # noqa: A002 - argparse's own keyword
    """``--hostfile FILE`` (``run``, ``doctor``, ``bench``); ``parser`` may be a group."""
    parser.add_argument("--hostfile", metavar="FILE", help=help)


def add_network_interface(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002
    """``--network-interface IF``, horovodrun's flag (``run``, ``doctor``, ``bench``)."""
    parser.add_argument("--network-interface", metavar="IF", help=help)


def add_env(
    parser: argparse.ArgumentParser,
    help: str,  # noqa: A002
    metavar: str = "NAME[=VALUE]",
) -> None:
    """``--env``, repeatable (``run`` also forwards a bare ``NAME``; ``bench`` takes
    ``NAME=VALUE`` only)."""
    parser.add_argument("--env", action="append", default=[], metavar=metavar, help=help)
