"""Command-line options that more than one subcommand takes, defined once: the flag, its
type and metavar live here; each subcommand gives the help that fits it."""

from __future__ import annotations

import argparse
from typing import Any

from hvdkit.launch.names import BadInputError, check_interfaces, check_port


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    """``--ssh-port`` and ``--ssh-identity-file`` (``hvdkit run``, ``hvdkit doctor``)."""
    parser.add_argument("--ssh-port", type=port, metavar="PORT", help="sshd port on the hosts")
    parser.add_argument("--ssh-identity-file", metavar="FILE", help="private key for ssh")


def add_hostfile(parser: Any, help: str) -> None:  # noqa: A002 - argparse's own keyword
    """``--hostfile FILE`` (``run``, ``doctor``, ``bench``); ``parser`` may be a group."""
    parser.add_argument("--hostfile", metavar="FILE", help=help)


def interface_names(value: str) -> str:
    """``--network-interface``'s value, checked by :func:`hvdkit.launch.names.check_interfaces`
    (it reaches horovodrun's shell strings)."""
    try:
        return check_interfaces(value)
    except BadInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--network-interface ")) from None


def port(value: str) -> int:
    """A port flag's value (``--ssh-port``), checked by :func:`hvdkit.launch.names.check_port`."""
    try:
        return check_port(value, "")
    except BadInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def add_network_interface(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002
    """``--network-interface IF``, horovodrun's flag (``run``, ``doctor``, ``bench``)."""
    parser.add_argument("--network-interface", metavar="IF", type=interface_names, help=help)


def add_env(
    parser: argparse.ArgumentParser,
    help: str,  # noqa: A002
    metavar: str = "NAME[=VALUE]",
) -> None:
    """``--env``, repeatable (``run`` also forwards a bare ``NAME``; ``bench`` takes
    ``NAME=VALUE`` only)."""
    parser.add_argument("--env", action="append", default=[], metavar=metavar, help=help)
