"""From hosts and options to the exact ``horovodrun`` command, rank map and environment.
Pure: nothing here starts a process, so ``--dry-run`` shows exactly what would run.

The command is an argument list, never a shell string: nothing in a hostfile, an
environment value or the user's command can inject a shell command (host names are
validated; horovodrun quotes what it passes on over ssh).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from hvdkit.horovod_build.config import Controller
from hvdkit.launch.elastic import ElasticConfig, ElasticError
from hvdkit.launch.elastic import describe as describe_elastic
from hvdkit.launch.hostfile import Host

CONTROLLERS = ("gloo", "mpi")

# Set for MPI jobs unless the user sets them. Horovod's background thread runs a coordination
# collective every cycle (1 ms), and Open MPI busy-polls while it waits; on a CPU host whose
# cores the ranks' compute already fills, that spinning thread takes its core from the compute
# (measured on 2 cores, 2 ranks: plain compute at 0.69 of its one-rank speed, 1.05 with
# yielding; `hvdkit bench`, docs/guides/benchmarks.md). Open MPI yields by itself only when it sees
# more processes than slots, which an extra thread is not.
MPI_DEFAULT_ENV = {"OMPI_MCA_mpi_yield_when_idle": "1"}


HIDDEN = "(value not shown)"
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_RANKS = 1 << 17
"""The most ranks one plan lists (Horovod's largest reported jobs are ~27,000 GPUs)."""


class LaunchError(ValueError):
    """Options that cannot make a job; the message names the flag and the fix."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What ``hvdkit run`` was asked for."""

    command: tuple[str, ...]
    np: int | None = None
    controller: Controller | None = None  # None: MPI when built and installed, else Gloo
    network_interface: str | None = None
    start_timeout: int | None = None
    env: tuple[str, ...] = ()  # NAME or NAME=VALUE
    output_dir: str | None = None
    verbose: bool = False
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    elastic: ElasticConfig | None = None
    mpi_args: str | None = None  # extra arguments for mpirun (MPI jobs only)


@dataclass(frozen=True)
class RankSlot:
    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int


@dataclass(frozen=True)
class LaunchPlan:
    """The job: horovodrun's argv, the environment it gets, and which rank runs where."""

    argv: list[str]
    controller: str
    ranks: list[RankSlot]
    env: dict[str, str] = field(default_factory=dict)  # set or forwarded by hvdkit
    elastic: list[str] = field(default_factory=list)  # the elastic settings, described
    user_env: frozenset[str] = frozenset()  # names from --env: their values are never shown

    def shown_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` as ``--dry-run`` and ``--verbose`` show it: --env's values hidden."""
        return {k: HIDDEN if k in self.user_env else v for k, v in env.items()}

    def host_of(self, rank: int) -> str:
        return self.ranks[rank].host if 0 <= rank < len(self.ranks) else "?"

    def rank_env(self, slot: RankSlot) -> dict[str, str]:
        """The variables one rank sees besides the launcher's own environment: Horovod's under
        Gloo, Open MPI's under MPI."""
        placement: dict[str, object]
        if self.controller == "mpi":
            placement = {
                "OMPI_COMM_WORLD_RANK": slot.rank,
                "OMPI_COMM_WORLD_SIZE": len(self.ranks),
                "OMPI_COMM_WORLD_LOCAL_RANK": slot.local_rank,
                "OMPI_COMM_WORLD_LOCAL_SIZE": slot.local_size,
            }
        else:
            placement = {
                "HOROVOD_RANK": slot.rank,
                "HOROVOD_SIZE": len(self.ranks),
                "HOROVOD_LOCAL_RANK": slot.local_rank,
                "HOROVOD_LOCAL_SIZE": slot.local_size,
                "HOROVOD_CROSS_RANK": slot.cross_rank,
                "HOROVOD_HOSTNAME": slot.host,
            }
        return {**self.env, **{k: str(v) for k, v in placement.items()}}

    def to_dict(self) -> dict:
        return {
            "argv": self.argv,
            "controller": self.controller,
            "np": len(self.ranks),
            "ranks": [
                {**asdict(slot), "env": self.shown_env(self.rank_env(slot))} for slot in self.ranks
            ],
            "env": self.shown_env(self.env),
            "elastic": self.elastic or None,
        }


def allocate(hosts: list[Host], np: int | None) -> list[tuple[Host, int]]:
    """Fill the hosts in order: (host, processes there) for the hosts used, summing to np."""
    total = sum(h.slots for h in hosts)
    np = total if np is None else np
    if np < 1:
        raise LaunchError(f"-np {np}: give at least 1 process")
    if np > MAX_RANKS:
        raise LaunchError(
            f"-np {np} ({'the slots listed' if np == total else 'asked for'}): hvdkit plans at "
            f"most {MAX_RANKS} ranks a job, and lists each. Fix: give -np, or check the hosts' "
            "slot counts"
        )
    if np > total:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise LaunchError(
            f"-np {np} is more than the {total} slots listed ({listed}). Fix: lower -np, or add "
            "hosts/slots to the hostfile (slots=N per host)"
        )
    used, left = [], np
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        used.append((host, take))
        left -= take
    return used


def rank_map(used: list[tuple[Host, int]]) -> list[RankSlot]:
    slots, rank = [], 0
    for cross_rank, (host, count) in enumerate(used):
        for local_rank in range(count):
            slots.append(RankSlot(rank, host.name, local_rank, count, cross_rank))
            rank += 1
    return slots


def forwarded_env(names: tuple[str, ...], environ: dict[str, str]) -> dict[str, str]:
    """``--env NAME=VALUE`` sets a value; ``--env NAME`` forwards this shell's value."""
    out = {}
    for item in names:
        name, sep, value = item.partition("=")
        if not SHELL_NAME.fullmatch(name):
            shown = f"{name}=..." if sep else name  # the value may be a secret
            raise LaunchError(
                f"--env {shown!r}: {name!r} is not a variable name a shell can export. Fix: "
                "give NAME or NAME=VALUE with NAME like MY_VAR (letters, digits, _)"
            )
        if not sep:
            if name not in environ:
                raise LaunchError(
                    f"--env {name}: {name} is not set in this shell. Fix: set it, or pass "
                    f"--env {name}=VALUE"
                )
            value = environ[name]
        out[name] = value
    return out


def default_controller(available: tuple[str, ...]) -> Controller:
    """What a job runs on when no controller is asked for: MPI when this Horovod can use it
    (as horovodrun chooses), else Gloo."""
    return "mpi" if "mpi" in available else "gloo"


def build_plan(
    config: LaunchConfig,
    hosts: list[Host],
    *,
    available: tuple[str, ...],
    horovodrun: str = "horovodrun",
    environ: dict[str, str] | None = None,
) -> LaunchPlan:
    """The plan for ``config`` on ``hosts``; ``available`` are the controllers this Horovod
    build can use (Gloo always, MPI when built and mpirun is installed)."""
    if not config.command:
        raise LaunchError("no command to run. Usage: hvdkit run [options] -- python train.py ...")
    elastic = config.elastic
    if elastic is not None and config.controller == "mpi":
        raise LaunchError(
            "--mpi with an elastic job (--min-np / --host-discovery-script): Horovod's elastic "
            "mode runs on Gloo only. Fix: drop --mpi (hvdkit picks Gloo for elastic jobs)"
        )
    controller: str = (
        "gloo" if elastic is not None else config.controller or default_controller(available)
    )
    if controller not in available:
        raise LaunchError(
            f"--{controller}: this Horovod cannot use {controller.upper()} here "
            f"(available: {', '.join(available) or 'none'}). Fix: "
            + (
                "install Open MPI (apt-get install openmpi-bin) and rebuild with "
                "`hvdkit build-horovod --controllers gloo,mpi`, or use --gloo"
                if controller == "mpi"
                else "rebuild Horovod with `hvdkit build-horovod --controllers gloo`"
            )
        )
    np = config.np
    if elastic is not None:
        try:
            np = elastic.initial_np(np, sum(h.slots for h in hosts))
        except ElasticError as exc:
            raise LaunchError(str(exc)) from None
        if elastic.discovery is None and len(hosts) < 2:
            raise LaunchError(
                "an elastic job with a fixed host list (-H) needs at least 2 hosts (Horovod "
                "cannot fail over otherwise). Fix: list more hosts, or use --hostfile FILE or "
                "--host-discovery-script SCRIPT, which can add hosts while the job runs"
            )
    used = allocate(hosts, np)
    # An elastic job may move to any host listed, not only to those the first ranks fill.
    for host in (h for h, _ in used) if elastic is None else hosts:
        if host.is_ipv6:
            raise LaunchError(
                f"{host.source}: {host.name} is an IPv6 literal, which horovodrun's host lists "
                "cannot carry (they split on ':'). Fix: give the host a name (/etc/hosts or DNS) "
                "and use that in the hostfile"
            )
    ranks = rank_map(used)
    argv = [horovodrun, "-np", str(len(ranks))]
    if elastic is None or elastic.discovery is None:
        # A fixed elastic host list offers every slot, not only those the first ranks fill.
        listed = used if elastic is None else [(h, h.slots) for h in hosts]
        argv += ["-H", ",".join(f"{host.name}:{count}" for host, count in listed)]
    if elastic is not None:
        argv += elastic.argv()
    argv.append(f"--{controller}")
    if config.network_interface:
        argv += ["--network-interface", config.network_interface]
    if config.start_timeout is not None:
        argv += ["--start-timeout", str(config.start_timeout)]
    if config.ssh_port is not None:
        argv += ["--ssh-port", str(config.ssh_port)]
    if config.ssh_identity_file:
        argv += ["--ssh-identity-file", config.ssh_identity_file]
    if config.output_dir:
        argv += ["--output-filename", config.output_dir]
    if config.verbose:
        argv.append("--verbose")
    if config.mpi_args and controller != "mpi":
        raise LaunchError(
            f"--mpi-args {config.mpi_args!r}: this job runs on Gloo"
            + (" (elastic jobs always do)" if elastic is not None else "")
            + ", where mpirun is not used. Fix: add --mpi, or drop --mpi-args"
        )
    if config.mpi_args:
        argv.append(f"--mpi-args={config.mpi_args}")  # a value that starts with "--"
    argv += list(config.command)
    environ = dict(os.environ if environ is None else environ)
    env = forwarded_env(config.env, environ)
    user = frozenset(env)
    if controller == "mpi":
        env = {k: v for k, v in MPI_DEFAULT_ENV.items() if k not in environ} | env
    if elastic is not None:
        env |= elastic.env()
    described = [] if elastic is None else describe_elastic(elastic, hosts, len(ranks))
    return LaunchPlan(argv, controller, ranks, env, described, user)


def describe(plan: LaunchPlan) -> str:
    """``--dry-run``'s text: the command, where each rank runs, and what it gets."""
    from shlex import join

    ranks = "ranks (at the start: an elastic job re-assigns them):" if plan.elastic else "ranks:"
    lines = ["command:", "  " + join(plan.argv), f"controller: {plan.controller}", ranks]
    for slot in plan.ranks:
        lines.append(
            f"  rank {slot.rank}: host {slot.host} local_rank {slot.local_rank}/"
            f"{slot.local_size} cross_rank {slot.cross_rank}"
        )
    lines += plan.elastic
    lines.append(
        "environment (besides this shell's, which every rank receives; values set by --env "
        "are not shown):"
    )
    for name, value in plan.shown_env(plan.env).items():
        lines.append(f"  {name}" if value == HIDDEN else f"  {name}={value}")
    for slot in plan.ranks:
        own = {k: v for k, v in plan.rank_env(slot).items() if k not in plan.env}
        lines.append(f"  rank {slot.rank}: " + " ".join(f"{k}={v}" for k, v in own.items()))
    return "\n".join(lines)
