"""Hostfiles and ``-H`` lists, parsed the way people write them. Pure: no I/O but reading the
file.

Accepted, one host per line::

    # comments, and blank lines
    server1 slots=4            # Open MPI form; max_slots=N may follow
    server2:4                  # horovodrun form
    server3                    # bare: 1 slot, or --slots-per-host
    10.0.0.7 slots=2
    fe80::1 slots=2            # IPv6 literal (bracketed with :N: [fe80::1]:2)

Every mistake is reported as ``file:line``, the offending text and the form expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hvdkit.launch.names import BadInputError, check_host, whole_number

EXPECTED = "HOST slots=N [max_slots=M], HOST:N or HOST (one host per line)"
MAX_SLOTS = 4096
"""The most processes one host is given: a larger count is a typo (the plan lists every rank,
so ``host:99999999999`` would never finish planning)."""


class HostfileError(BadInputError):
    """A hostfile or ``-H`` entry that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Host:
    """One host: its name or address, the processes to start there, and where it came from."""

    name: str
    slots: int
    max_slots: int | None = None
    source: str = ""

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.name


def _where(source: str, lineno: int | None) -> str:
    return f"{source}:{lineno}" if lineno is not None else source


def check_name(name: str, where: str, text: str) -> str:
    """``name`` if :func:`hvdkit.launch.names.check_host` accepts it; HostfileError saying
    ``where`` it came from otherwise."""
    try:
        return check_host(name, where, text)
    except BadInputError as exc:
        raise HostfileError(str(exc)) from None


def _count(value: str, key: str, where: str, text: str) -> int:
    count = whole_number(value, MAX_SLOTS)
    if count is None:
        raise HostfileError(
            f"{where}: {key} must be a whole number > 0, got {value!r} in {text!r} (a host "
            f"takes at most {MAX_SLOTS})"
        )
    return count


def parse_entry(
    text: str, where: str, default_slots: int | None = None, *, allow_options: bool = True
) -> Host:
    """One host entry (a hostfile line without its comment, or one ``-H`` item)."""
    if default_slots is not None and not 1 <= default_slots <= MAX_SLOTS:
        raise HostfileError(
            f"--slots-per-host {default_slots}: give a whole number from 1 to {MAX_SLOTS}"
        )
    fields = text.split()
    head, options = fields[0], fields[1:]
    slots: int | None = None
    if head.startswith("["):  # [v6]:N or [v6]
        match = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\](?::(.*))?", head)
        if not match:
            raise HostfileError(f"{where}: cannot read {text!r}; expected {EXPECTED}")
        name = match.group(1)
        if match.group(2) is not None:
            slots = _count(match.group(2), "slots", where, text)
    elif head.count(":") == 1:
        name, count = head.split(":")
        slots = _count(count, "slots", where, text)
    else:
        name = head  # a plain name, or a bare IPv6 literal (two or more colons)
    name = check_name(name, where, text)
    max_slots = None
    if options and not allow_options:
        raise HostfileError(f"{where}: unexpected {' '.join(options)!r}; expected HOST or HOST:N")
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("slots", "max_slots", "max-slots"):
            raise HostfileError(
                f"{where}: unknown field {option!r} in {text!r}; expected {EXPECTED}"
            )
        if key == "slots":
            if slots is not None:
                raise HostfileError(f"{where}: slots given twice in {text!r}")
            slots = _count(value, "slots", where, text)
        else:
            max_slots = _count(value, "max_slots", where, text)
    if slots is None:
        slots = default_slots or 1
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is below slots={slots} in {text!r}")
    return Host(name, slots, max_slots, where)


def _no_duplicates(hosts: list[Host]) -> list[Host]:
    seen: dict[str, Host] = {}
    for host in hosts:
        if host.name in seen:
            raise HostfileError(
                f"{host.source}: host {host.name!r} is listed again (first at "
                f"{seen[host.name].source}); list each host once with its total slots"
            )
        seen[host.name] = host
    return hosts


def parse_hostfile_text(
    text: str, source: str = "<hostfile>", slots_per_host: int | None = None
) -> list[Host]:
    """The hosts of a hostfile's text; ``source`` names it in errors."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(parse_entry(line, _where(source, lineno), slots_per_host))
    if not hosts:
        raise HostfileError(f"{source}: no hosts in it; expected {EXPECTED}")
    return _no_duplicates(hosts)


def parse_hostfile(path: str | Path, slots_per_host: int | None = None) -> list[Host]:
    """The hosts listed in the file at ``path``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read the hostfile: {exc.strerror or exc}") from None
    return parse_hostfile_text(text, str(path), slots_per_host)


def parse_hosts_arg(text: str, slots_per_host: int | None = None) -> list[Host]:
    """The hosts of ``-H h1:4,h2:4`` (``h`` alone means 1 slot, or ``--slots-per-host``)."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise HostfileError(f"-H {text!r}: empty host entry; expected -H host1:4,host2:4")
    hosts = [
        parse_entry(item, f"-H item {i}", slots_per_host, allow_options=False)
        for i, item in enumerate(items, start=1)
    ]
    return _no_duplicates(hosts)
