"""Command-line options that more than one subcommand takes, defined once."""

from __future__ import annotations

import argparse


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    """``--ssh-port`` and ``--ssh-identity-file`` (``hvdkit run``, ``hvdkit doctor``)."""
    parser.add_argument("--ssh-port", type=int, metavar="PORT", help="sshd port on the hosts")
    parser.add_argument("--ssh-identity-file", metavar="FILE", help="private key for ssh")
