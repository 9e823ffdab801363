"""The one check for what a launch hands to shells: host names, network interfaces and ports.
Pure.

horovodrun builds its ssh checks, remote commands and discovery calls as shell strings, so a
host name, an interface or a port that reaches it from anywhere (a hostfile, ``-H``, Slurm, PBS,
LSF, an MPIJob's hostfile, a discovery script's output, an engine's workers, a flag) must be
inert in a shell. Every source calls these functions, saying where the value came from (a file
and line, or a variable or flag); the error names that place and the fix.
"""

from __future__ import annotations

import ipaddress
import re

_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}")
_INTERFACE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
SHELL_SPECIAL = frozenset("|&;<>()$`\\\"' \t\n\r*?[]#~=%!{},^")
"""Characters a POSIX shell (or ssh's remote shell) treats specially: no accepted value has
one (the property the fuzz tests check)."""


class BadInputError(ValueError):
    """A host name, interface or port that cannot be used; the message says where and why."""


def check_host(name: str, where: str, text: str | None = None) -> str:
    """``name`` when it is a host name or address: letters, digits, ``.``, ``-`` and ``_``, not
    starting with ``-`` (ssh would read it as an option), or an IPv6 literal. ``where`` is the
    file and line, variable or flag it came from; ``text`` the whole entry, when it says more."""
    if _HOST.fullmatch(name) and not name.startswith("-"):
        return name
    if ":" in name:
        try:
            if isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address) and "%" not in name:
                return name
        except ValueError:
            pass
    shown = f"{name!r} in {text!r}" if text is not None and text != name else repr(name)
    raise BadInputError(
        f"{where}: bad host name {shown}: a host is a name or address made of letters, "
        "digits, '.', '-' and '_' (not starting with '-'), or an IPv6 literal. Fix: correct "
        "the entry there"
    )


def check_interfaces(value: str, where: str = "--network-interface") -> str:
    """``value`` when it is interface names (``eth0``, or ``eth0,ib0``): letters, digits,
    ``.``, ``_``, ``-`` and ``:``."""
    names = value.split(",")
    if all(_INTERFACE.fullmatch(n) and not n.startswith("-") for n in names):
        return value
    raise BadInputError(
        f"{where} {value!r}: not interface names. Fix: give names such as eth0 or ib0, "
        "comma-separated for several (`ip -brief address` lists them)"
    )


def whole_number(text: str, most: int) -> int | None:
    """``text`` as a whole number from 1 to ``most``; None when it is not one. Only ASCII
    digits: ``str.isdigit`` passes ``²``, which ``int()`` refuses, and ``int()`` refuses more
    than 4300 digits, so the length is checked first."""
    digits = text.lstrip("0")
    if not text.isascii() or not text.isdigit() or len(digits) > len(str(most)):
        return None
    number = int(digits or "0")
    return number if 1 <= number <= most else None


def check_port(value: str | int, where: str) -> int:
    """``value`` as a TCP port (1 to 65535)."""
    port = whole_number(str(value).strip(), 65535)
    if port is not None:
        return port
    raise BadInputError(f"{where} {value!r}: not a TCP port. Fix: give a number from 1 to 65535")


def is_inert(value: str) -> bool:
    """Whether ``value`` has no character a shell treats specially, and no control or
    non-ASCII character (what every accepted host name and interface satisfies)."""
    return value.isascii() and value.isprintable() and not SHELL_SPECIAL.intersection(value)
