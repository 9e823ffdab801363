"""Reading horovodrun's merged output: which rank said what, and which rank failed. Pure.

horovodrun tags each line with its rank: ``[3]<stderr>:...`` under Gloo, ``[1,3]<stderr>:...``
under MPI (``--tag-output``). When a rank exits non-zero it names it ("Process name: 3" from
Gloo, "Process name: [[4711,1],3]" from Open MPI).
"""

from __future__ import annotations

import re
from collections import deque

_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:?(.*)$")
_FAILED = re.compile(r"Process name:\s*(?:\[\[\d+,\d+\],(\d+)\]|(\d+))")
_EXIT = re.compile(r"Exit code:\s*(-?\d+)")
_GLOO_EXIT = re.compile(r"Process (\d+) exit with status code (-?\d+)")
_UNREACHABLE = re.compile(r"^ssh not successful for host (\S+):$")
# A host lost during the run: Open MPI's daemon there, or the ssh connection to it.
_LOST = (re.compile(r"Remote daemon: \S+ on node (\S+)"),
         re.compile(r"^Connection to (\S+) closed by remote host"))  # fmt: skip
# What a rank says when it stops only because another rank failed first.
SECONDARY = ("Horovod has been shut down", "HorovodInternalError")


class RankOutput:
    """The last ``keep`` stderr lines of each rank, and what horovodrun said about failures."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.stderr: dict[int, deque[str]] = {}
        self.launcher: deque[str] = deque(maxlen=200)

    def feed(self, line: str) -> None:
        """Record one tagged line as horovodrun prints it (``[3]<stderr>:text``)."""
        line = line.rstrip("\n")
        match = _TAG.match(line)
        if match is None:
            self.record(None, "stdout", line)
        else:
            self.record(int(match.group(1)), match.group(2), match.group(3))

    def record(self, rank: int | None, stream: str, text: str) -> None:
        """Record a whole line of ``rank``'s ``stream`` (None: horovodrun's own)."""
        if rank is None:
            self.launcher.append(text)
        elif stream == "stderr":
            self.stderr.setdefault(rank, deque(maxlen=self.keep)).append(text)

    def exit_codes(self) -> dict[int, int]:
        """Exit codes horovodrun reported per rank (Gloo reports every rank's)."""
        return {
            int(m.group(1)): int(m.group(2))
            for m in (_GLOO_EXIT.search(line) for line in self.launcher)
            if m
        }

    def failed_rank(self) -> tuple[int, int | None] | None:
        """(rank, exit code) of the rank that failed first, if any. horovodrun names the
        first to *exit*, which is often a rank that only stopped because another one failed
        ("Horovod has been shut down"); then the rank whose error is its own is chosen."""
        text = "\n".join(self.launcher)
        match = _FAILED.search(text)
        if match is None:
            return None
        rank = int(match.group(1) or match.group(2))
        code_match = _EXIT.search(text[match.end() :])
        code = int(code_match.group(1)) if code_match else None
        if self._secondary(rank):
            codes = self.exit_codes()
            for other in sorted(self.stderr):
                if other != rank and self.stderr[other] and not self._secondary(other):
                    return other, codes.get(other)
        return rank, code

    def _secondary(self, rank: int) -> bool:
        return any(marker in line for line in self.stderr.get(rank, ()) for marker in SECONDARY)

    def unreachable(self) -> dict[str, str]:
        """Hosts horovodrun's ssh check could not reach, with ssh's reason (the line after
        ``ssh not successful for host H:``)."""
        found: dict[str, str] = {}
        lines = list(self.launcher)
        for i, line in enumerate(lines):
            match = _UNREACHABLE.match(line)
            if match:
                found[match.group(1)] = _reason(lines[i + 1 :]) or "no reason given"
        return found

    def lost_hosts(self) -> list[str]:
        """Hosts the launcher lost during the run (Open MPI's ``Remote daemon: ... on node
        H``, ssh's ``Connection to H closed by remote host``), in the order said."""
        found: list[str] = []
        for line in self.launcher:
            for pattern in _LOST:
                match = pattern.search(line)
                if match and match.group(1).rstrip(".") not in found:
                    found.append(match.group(1).rstrip("."))
        return found

    def tail(self, rank: int, lines: int = 10) -> list[str]:
        return list(self.stderr.get(rank, ()))[-lines:]


NO_REASON = "ssh printed no reason: it may have timed out resolving or connecting"


def _reason(after: list[str]) -> str:
    """ssh's reason: the first line after horovodrun's. Where ssh printed nothing (on a
    loaded machine the check can give up first), the next line is the start of horovodrun's
    own traceback, which is not a reason."""
    first = next((x.strip() for x in after[:3] if x.strip()), "")
    return NO_REASON if first.startswith("Traceback") else first


def failure_message(
    output: RankOutput, host_of: dict[int, str], returncode: int, lines: int = 10
) -> str:
    """The one message ``hvdkit run`` prints when the job failed."""
    unreachable = output.unreachable()
    if unreachable:
        hosts = "; ".join(f"{host} ({why})" for host, why in unreachable.items())
        return (
            f"hvdkit run: no rank started: cannot reach {hosts} over ssh. Fix: check the host "
            "names (where they came from is printed above), that sshd runs there and that "
            "this user's key is accepted without a password; `hvdkit doctor --hostfile FILE` "
            "checks each host"
        )
    lost = output.lost_hosts()
    if lost:  # the cause: the other ranks' errors follow from it
        ranks = {h: sorted(r for r, host in host_of.items() if host == h) for h in lost}
        said = "; ".join(f"host {h} (rank {', '.join(map(str, ranks[h])) or '?'})" for h in lost)
        return (
            f"hvdkit run: lost {said} during the run: the launcher's connection to it closed "
            "(the host went down, or its processes were killed); the other ranks failed after "
            "it. Fix: look at that host (its logs, memory, the scheduler); `hvdkit doctor "
            "--hostfile FILE` checks each host; an elastic job (--min-np) goes on without it"
        )
    failed = output.failed_rank()
    if failed is None:
        talking = sorted(output.stderr)
        rank = talking[-1] if len(talking) == 1 else None
        head = f"hvdkit run: the job failed (horovodrun exit status {returncode})"
        if rank is None:
            return head + "; no rank was named. See the output above."
        code = None
    else:
        rank, code = failed
        head = f"hvdkit run: rank {rank} on host {host_of.get(rank, '?')} failed" + (
            f" with exit code {code}" if code is not None else ""
        )
    tail = output.tail(rank, lines)
    if not tail:
        return head + " (it wrote nothing to stderr)."
    return (
        head
        + f"; the last {len(tail)} lines of its stderr:\n"
        + "\n".join(f"    {line}" for line in tail)
    )
