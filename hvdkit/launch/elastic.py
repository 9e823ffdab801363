"""Elastic jobs (Horovod's ``--min-np`` mode, Gloo only): the options, their checks, and the
horovodrun arguments they become. Pure, like :mod:`hvdkit.launch.plan`.

Hosts come from a discovery script that horovodrun runs every second (Horovod's contract: one
``host`` or ``host:slots`` per line on stdout, exit status 0), from ``-H`` (a fixed list), or
from a hostfile: ``hvdkit run --hostfile F --min-np A`` makes horovodrun re-read ``F``
through :mod:`hvdkit.launch.discover`, so editing the file adds or removes hosts while the job
runs.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from hvdkit import envvars
from hvdkit.launch.hostfile import Host, HostfileError, parse_entry


class ElasticError(ValueError):
    """Elastic options that cannot make a job; the message names the flag and the fix."""


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Horovod's elastic options, by their horovodrun names. ``discovery`` is the command
    horovodrun runs to list hosts (a user's script, or hvdkit's hostfile reader)."""

    min_np: int
    max_np: int | None = None
    discovery: str | None = None
    slots_per_host: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    elastic_timeout: int | None = None
    stall_timeout: int = 30  # hvdkit's own: not a horovodrun flag

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ElasticError(f"--min-np {self.min_np}: give at least 1")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ElasticError(
                f"--min-np {self.min_np} is above --max-np {self.max_np}. Fix: make --min-np "
                "the fewest processes the job may shrink to and --max-np the most it may grow to"
            )
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ElasticError(f"--reset-limit {self.reset_limit}: give 0 or more")
        if self.elastic_timeout is not None and self.elastic_timeout < 1:
            raise ElasticError(f"--elastic-timeout {self.elastic_timeout}: give seconds >= 1")
        if self.stall_timeout < 1:
            raise ElasticError(f"--stall-timeout {self.stall_timeout}: give seconds >= 1")
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if not 1 <= low <= high <= 3600:
                raise ElasticError(
                    f"--blacklist-cooldown-range {low} {high}: give MIN MAX seconds with "
                    "1 <= MIN <= MAX <= 3600 (Horovod's bounds)"
                )

    def initial_np(self, np: int | None, slots: int) -> int:
        """The processes to start with: ``-np``, else every slot listed up to ``--max-np``;
        checked against ``--min-np``/``--max-np``."""
        if np is None:
            np = min(slots, self.max_np) if self.max_np is not None else slots
            np = max(np, self.min_np)
        if np < self.min_np:
            raise ElasticError(
                f"-np {np} is below --min-np {self.min_np}: start with at least that"
            )
        if self.max_np is not None and np > self.max_np:
            raise ElasticError(f"-np {np} is above --max-np {self.max_np}")
        return np

    def env(self) -> dict[str, str]:
        """What hvdkit's driver hooks in horovodrun's process read (:mod:`elastic_report`)."""
        return {envvars.ELASTIC_STALL_TIMEOUT: str(self.stall_timeout)}

    def argv(self) -> list[str]:
        """horovodrun's elastic arguments."""
        out = ["--min-np", str(self.min_np)]
        if self.max_np is not None:
            out += ["--max-np", str(self.max_np)]
        if self.discovery is not None:
            out += ["--host-discovery-script", self.discovery]
        if self.slots_per_host is not None:
            out += ["--slots-per-host", str(self.slots_per_host)]
        if self.reset_limit is not None:
            out += ["--reset-limit", str(self.reset_limit)]
        if self.cooldown_range is not None:
            out += ["--blacklist-cooldown-range", *map(str, self.cooldown_range)]
        if self.elastic_timeout is not None:
            out += ["--elastic-timeout", str(self.elastic_timeout)]
        return out


def elastic_interface(
    hosts: list[Host], nic: str | None, local_names: set[str]
) -> tuple[str | None, str | None]:
    """The ``--network-interface`` an elastic job starts with, and a warning to print now.

    Without one, Horovod's elastic driver compares the interfaces of two hosts before it
    starts, so with fewer it waits out ``--elastic-timeout`` (600 s). Every host being this
    machine, the loopback interface is the answer; one other host gets the warning at once."""
    if nic:
        return nic, None
    names = {host.name for host in hosts}
    if names and all(n in local_names or n.startswith("127.") for n in names):
        return "lo", None
    if len(names) < 2:
        return None, (
            f"one host so far ({', '.join(sorted(names)) or 'none'}) and no "
            "--network-interface: Horovod's elastic driver waits (up to --elastic-timeout) for "
            "a second host to compare network interfaces before it starts. To start on one "
            "host, give --network-interface IFACE"
        )
    return None, None


def hostfile_discovery(
    hostfile: str, slots_per_host: int | None = None, python: str = sys.executable
) -> str:
    """The discovery command that re-reads ``hostfile`` (horovodrun runs it through a shell,
    so every word is quoted)."""
    words = [python, "-m", "hvdkit.launch.discover", hostfile]
    if slots_per_host is not None:
        words += ["--slots-per-host", str(slots_per_host)]
    return shlex.join(words)


def parse_discovery_output(text: str, source: str, default_slots: int | None) -> list[Host]:
    """The hosts a discovery script printed: ``host`` or ``host:slots`` per line (Horovod's
    format; blank output means no host is ready yet). A bad line is named with its number."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source}: output line {lineno}"
        try:
            host = parse_entry(line, where, default_slots, allow_options=False)
        except HostfileError as exc:
            raise ElasticError(
                f"{exc}. A discovery script prints one host per line as host or host:slots"
            ) from None
        if host.is_ipv6:
            raise ElasticError(
                f"{where}: {line!r} is an IPv6 literal, which Horovod's discovery format "
                "(host:slots) cannot carry. Fix: print a host name"
            )
        hosts.append(host)
    return hosts


def describe(config: ElasticConfig, hosts: list[Host], np: int) -> list[str]:
    """``--dry-run``'s elastic lines."""
    bound = f"{config.min_np}..{config.max_np if config.max_np is not None else 'all slots'}"
    lines = [
        f"elastic: start {np} processes, keep between {bound} (Gloo)",
        f"  hosts now: {', '.join(f'{h.name}:{h.slots}' for h in hosts) or '(none yet)'}",
    ]
    if config.discovery is not None:
        lines.append(f"  host discovery every second: {config.discovery}")
    lines.append(
        "  failed host: blacklisted "
        + (
            "for {}..{} s, then tried again".format(*config.cooldown_range)
            if config.cooldown_range
            else "for the rest of the job (--blacklist-cooldown-range MIN MAX to retry it)"
        )
    )
    lines.append(
        f"  resets allowed: {config.reset_limit if config.reset_limit is not None else 'no limit'}"
        f"; below --min-np the job waits {config.elastic_timeout or 600} s, then fails"
    )
    lines.append(
        "  a stopped or hung worker: failed once the others have waited "
        f"HOROVOD_GLOO_TIMEOUT_SECONDS (default 30) + {config.stall_timeout} s (--stall-timeout)"
    )
    return lines
