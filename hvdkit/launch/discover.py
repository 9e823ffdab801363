"""Host discovery scripts: ``python -m hvdkit.launch.discover HOSTFILE [--slots-per-host N]``
turns a hostfile into one, and :func:`probe` checks a user's before a job starts.

horovodrun runs the discovery command every second in an elastic job; ``hvdkit run
--hostfile F --min-np A`` gives it this module, which prints ``host:slots`` per host listed in
``F``. A hostfile that is being edited and does not parse makes it fail with the error on
stderr: horovodrun then keeps the hosts it had and retries.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from hvdkit.launch.elastic import ElasticError, parse_discovery_output
from hvdkit.launch.hostfile import Host, HostfileError, parse_hostfile

PROBE_TIMEOUT_S = 30


def probe(command: str, default_slots: int | None, timeout: float = PROBE_TIMEOUT_S) -> list[Host]:
    """Run a discovery ``command`` once, as horovodrun will (through a shell), and return the
    hosts it lists; raise :class:`ElasticError` naming the script and the fix when it is
    missing, not executable, fails, hangs or prints a line that is not ``host[:slots]``."""
    flag = "--host-discovery-script"
    program = _program(command, flag)
    path = Path(program) if "/" in program else None
    if path is not None:
        if not path.exists():
            raise ElasticError(f"{flag} {program}: no such file")
        if path.is_dir() or not path.stat().st_mode & 0o111:
            raise ElasticError(
                f"{flag} {program}: not executable. Fix: chmod +x {shlex.quote(program)} (and "
                "give it a #! line)"
            )
    elif shutil.which(program) is None:
        raise ElasticError(
            f"{flag} {program}: not found on PATH. Fix: give the script's path (./{program})"
        )
    try:
        done = subprocess.run(
            command, shell=True, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise ElasticError(
            f"{flag} {command}: still running after {timeout:.0f} s; horovodrun runs it every "
            "second, so it must print the hosts and exit quickly"
        ) from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.decode(errors="replace").strip().splitlines()[-5:])
        raise ElasticError(
            f"{flag} {command}: exited with status {done.returncode}"
            + (f":\n{tail}" if tail else "")
            + "\nFix: it must exit 0 and print one host[:slots] per line"
        )
    source = f"{flag} {command}"
    return parse_discovery_output(_text(done.stdout, source), source, default_slots)


def _program(command: str, flag: str) -> str:
    """The program a discovery ``command`` runs: its first word, as a shell splits it."""
    try:
        words = shlex.split(command)
    except ValueError as exc:  # shlex's "No closing quotation", "No escaped character"
        raise ElasticError(
            f"{flag} {command}: a shell cannot read it ({str(exc).lower()}). Fix: balance its "
            "quotes, or put the command in a script and give the script's path"
        ) from None
    if not words:
        raise ElasticError(f"{flag}: empty command")
    return words[0]


def _text(output: bytes, source: str) -> str:
    """A discovery script's output as text; ElasticError naming the line that is not UTF-8."""
    try:
        return output.decode()
    except UnicodeDecodeError as exc:
        lineno = output[: exc.start].count(b"\n") + 1
        raise ElasticError(
            f"{source}: output line {lineno} is not UTF-8 text. Fix: print host names (letters, "
            "digits, '.', '-', '_'), one host[:slots] per line"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdkit.launch.discover")
    parser.add_argument("hostfile")
    parser.add_argument("--slots-per-host", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        hosts = parse_hostfile(args.hostfile, args.slots_per_host)
    except HostfileError as exc:
        print(f"hvdkit discover: {exc}", file=sys.stderr)
        return 1
    for host in hosts:
        print(f"{host.name}:{host.slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
