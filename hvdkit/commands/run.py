"""``hvdkit run``: launch a command on N processes from a hostfile or ``-H``, through
horovodrun (Gloo or MPI), with ``--dry-run`` to see exactly what would run.

    hvdkit run -np 4 --hostfile hostfiles/localhost -- python train.py --epochs 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from hvdkit import envvars
from hvdkit.commands import options

if TYPE_CHECKING:
    from hvdkit.launch.elastic import ElasticConfig
    from hvdkit.launch.hostfile import Host
    from hvdkit.launch.plan import LaunchPlan
    from hvdkit.launch.runner import View

SAFE_PATH = re.compile(r"^[\w./~+@%:,=-]+$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a training command on N processes / hosts through horovodrun",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="np",
        type=int,
        default=None,
        help="number of processes (default: all slots listed)",
    )
    hosts = parser.add_mutually_exclusive_group()
    options.add_hostfile(
        hosts,
        "hosts, one per line (default: localhost); with --min-np, re-read while the job runs, "
        "so editing it adds or removes hosts",
    )
    hosts.add_argument("-H", "--hosts", metavar="H1:N,H2:N", help="hosts and slots inline")
    hosts.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="elastic: a command printing the available hosts (host[:slots] per line)",
    )
    parser.add_argument(
        "--slots-per-host",
        type=int,
        default=None,
        metavar="N",
        help="slots of hosts listed without a count (default 1)",
    )
    elastic = parser.add_argument_group(
        "elastic training (Horovod's flags; Gloo only; the script uses hvdkit.torch.elastic "
        "or hvdkit.keras.elastic)"
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        type=int,
        metavar="N",
        help="run elastic: keep going while at least N processes are left",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        type=int,
        metavar="N",
        help="grow to at most N processes when hosts are added",
    )
    elastic.add_argument(
        "--reset-limit", type=int, metavar="N", help="fail after N resets (default: no limit)"
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="seconds a failed host stays out before it may rejoin (default: for good)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=int,
        metavar="S",
        help="hvdkit's hang doctor: when a collective has waited S s for some ranks, print "
        "which ranks have not submitted which tensors, each rank's Python stack and a "
        "diagnosis (default 60; 0: off). Elastic jobs: also count a worker that stopped "
        "answering as failed once the others have waited S s for it at a reset (default 30)",
    )
    parser.add_argument(
        "--on-stall",
        choices=("wait", "stop"),
        default="wait",
        help="after the hang doctor's report: keep waiting (default) or stop the job (exit 124)",
    )
    parser.add_argument(
        "--hang-dir",
        metavar="DIR",
        help="where the ranks write their stacks for the hang doctor; on several hosts, a "
        "folder they share (default: a fresh folder on this machine)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=int,
        metavar="S",
        help="seconds to wait for --min-np slots before failing (default 600)",
    )
    controller = parser.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="controller", action="store_const", const="gloo")
    controller.add_argument("--mpi", dest="controller", action="store_const", const="mpi")
    parser.add_argument(
        "--mpi-args",
        metavar="ARGS",
        help="extra arguments for mpirun, one string (horovodrun's flag; MPI jobs only)",
    )
    options.add_network_interface(parser, "NIC(s) to use, e.g. eth0")
    parser.add_argument(
        "--start-timeout",
        type=int,
        metavar="S",
        help="seconds to wait for all ranks to start (horovodrun's default 30)",
    )
    options.add_env(parser, "set or forward an environment variable to every rank (repeatable)")
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write each rank's stdout/stderr under DIR instead of the console",
    )
    options.add_ssh_options(parser)
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="inside a Slurm job: when a SIGTERM/SIGUSR1 made the job checkpoint and stop, "
        "requeue it (scontrol requeue $SLURM_JOB_ID); the next run resumes",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="hvdkit-profile",
        metavar="DIR",
        help="record where each rank's steps spend their time (data, compute, communication, "
        "optimizer, other); at the end print a table per rank, the verdict and advice, and "
        "write DIR/profile.json and DIR/profile.png (DIR: ./hvdkit-profile)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="start nothing; print the command, rank map and environment",
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="horovodrun's verbose output, and the frameworks' start-up logging hvdkit otherwise "
        "drops",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    parser.set_defaults(func=run_command)


class UsageError(ValueError):
    """What ``hvdkit run`` refuses before it starts anything; the message names the flag and
    the fix."""


def _fail(message: str) -> NoReturn:
    raise UsageError(message)


@dataclass(frozen=True)
class Caller:
    """What :func:`hvdkit.run` puts into a parsed ``hvdkit run`` in place of a command line:
    the command each rank runs, variables that reach the ranks privately (from the hosts the
    job runs on), and which output the console shows."""

    command: tuple[str, ...]
    env_for: Callable[[list[Host]], tuple[str, ...]]
    view: View
    planned: Callable[[LaunchPlan], None] = lambda plan: None


def _elastic_config(args: argparse.Namespace) -> ElasticConfig | None:
    """The elastic settings asked for, or None for a fixed job (Horovod's rule: --min-np or a
    discovery script makes a job elastic)."""
    from hvdkit.launch.elastic import ElasticConfig, ElasticError, hostfile_discovery

    if args.min_np is None and not args.host_discovery_script:
        given = [
            flag
            for flag, value in (
                ("--max-np", args.max_np),
                ("--reset-limit", args.reset_limit),
                ("--blacklist-cooldown-range", args.blacklist_cooldown_range),
                ("--elastic-timeout", args.elastic_timeout),
            )
            if value is not None
        ]
        if given:
            raise ElasticError(
                f"{given[0]} is for elastic jobs: add --min-np N (the fewest processes the job "
                "may shrink to)"
            )
        return None
    discovery = args.host_discovery_script
    if args.hostfile:
        discovery = hostfile_discovery(str(Path(args.hostfile).resolve()), args.slots_per_host)
    cooldown = args.blacklist_cooldown_range
    return ElasticConfig(
        min_np=args.min_np if args.min_np is not None else (args.np or 1),
        max_np=args.max_np,
        discovery=discovery,
        slots_per_host=args.slots_per_host if args.host_discovery_script else None,
        reset_limit=args.reset_limit,
        cooldown_range=tuple(cooldown) if cooldown else None,
        elastic_timeout=args.elastic_timeout,
        **({"stall_timeout": args.stall_timeout} if args.stall_timeout else {}),
    )


def run_command(args: argparse.Namespace) -> int:
    try:
        return launch(args)
    except UsageError as exc:
        print(f"hvdkit run: {exc}", file=sys.stderr)
        return 2


def launch(args: argparse.Namespace, caller: Caller | None = None) -> int:
    """``hvdkit run`` with ``args`` parsed; its exit status. Raises :class:`UsageError` for
    options that cannot make a job."""
    from hvdkit.horovod_build.record import nccl_built
    from hvdkit.launch import runner
    from hvdkit.launch.allocation import detect, gpu_problem
    from hvdkit.launch.discover import probe
    from hvdkit.launch.elastic import ElasticError, elastic_interface
    from hvdkit.launch.hang_doctor import Doctor, HangConfig
    from hvdkit.launch.hostfile import Host, HostfileError, parse_hostfile, parse_hosts_arg
    from hvdkit.launch.plan import LaunchConfig, LaunchError, build_plan, describe
    from hvdkit.launch.preemption import requeue_problem

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if caller is not None:
        command = list(caller.command)
    if args.json and not args.dry_run:
        return _fail("--json goes with --dry-run")
    if args.requeue and (problem := requeue_problem(os.environ)):
        return _fail(problem)
    if args.ssh_identity_file and not SAFE_PATH.match(args.ssh_identity_file):
        return _fail(
            f"--ssh-identity-file {args.ssh_identity_file!r}: horovodrun hands this path to a "
            "shell unquoted; use a path without spaces or shell characters"
        )
    if args.stall_timeout is not None and args.stall_timeout < 0:
        return _fail(f"--stall-timeout {args.stall_timeout}: give seconds >= 0 (0: no hang doctor)")
    hang = HangConfig(
        timeout=60 if args.stall_timeout is None else args.stall_timeout,
        stop=args.on_stall == "stop",
        directory=Path(args.hang_dir) if args.hang_dir else None,
    )
    hang_dir = Path("$TMPDIR/hvdkit-hang-XXXX") if args.dry_run else hang.folder()
    try:
        elastic = _elastic_config(args)
        if args.host_discovery_script:
            hosts = probe(args.host_discovery_script, args.slots_per_host)
            if not hosts:
                return _fail(
                    f"--host-discovery-script {args.host_discovery_script}: it lists no hosts "
                    "now; start the job once at least --min-np slots are up"
                )
        elif args.hostfile:
            hosts = parse_hostfile(args.hostfile, args.slots_per_host)
        elif args.hosts:
            hosts = parse_hosts_arg(args.hosts, args.slots_per_host)
        elif allocation := detect():
            hosts = list(allocation.hosts)
            print(f"hvdkit run: {allocation.describe()}", file=sys.stderr)
            if problem := gpu_problem(allocation, nccl_built()):
                return _fail(problem)
            if args.np is not None and args.np > allocation.slots:
                return _fail(
                    f"-np {args.np} is more than the {allocation.slots} slot(s) of the "
                    f"{allocation.scheduler} allocation ({allocation.origin}); ask the "
                    f"scheduler for more, or give -np {allocation.slots} or less"
                )
        elif args.np is not None:
            hosts = [Host("localhost", args.np, source="(no hosts given: this machine)")]
        else:
            return _fail(
                "give -np N (processes on this machine), or --hostfile FILE / -H h1:N; inside "
                "a Slurm, PBS, LSF or MPIJob allocation hvdkit run reads its hosts itself"
            )
        nic = args.network_interface
        if elastic is not None:
            nic, warning = elastic_interface(hosts, nic, _local_names())
            if warning:
                print(f"hvdkit run: warning: {warning}", file=sys.stderr)
            elif nic != args.network_interface:
                print(
                    f"hvdkit run: every host is this machine: --network-interface {nic} "
                    "(Horovod's elastic driver would otherwise wait for a second host)",
                    file=sys.stderr,
                )
        config = LaunchConfig(
            command=(sys.executable, "-m", "hvdkit.launch.guard", "--", *command)
            if command
            else (),
            np=args.np,
            controller=args.controller,
            network_interface=nic,
            start_timeout=args.start_timeout,
            env=(
                *args.env,
                *_profile_env(args.profile),
                *hang.env(hang_dir),
                *(caller.env_for(hosts) if caller else ()),
            ),
            output_dir=args.output_dir,
            verbose=args.verbose,
            ssh_port=args.ssh_port,
            ssh_identity_file=args.ssh_identity_file,
            elastic=elastic,
            mpi_args=args.mpi_args,
        )
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        plan = build_plan(
            config, hosts, available=runner.available_controllers(), horovodrun=horovodrun
        )
    except (HostfileError, LaunchError, ElasticError) as exc:
        return _fail(str(exc))
    if args.dry_run:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else describe(plan))
        return 0
    problem = _gpu_problem(plan)
    if problem:
        return _fail(problem)
    if caller is not None:
        caller.planned(plan)
    _clear_profile(args.profile)
    host_of = {slot.rank: slot.host for slot in plan.ranks}
    doctor = Doctor(hang, hang_dir, host_of) if hang.timeout > 0 else None
    try:
        code = runner.execute(
            plan, output_dir=args.output_dir, verbose=args.verbose, requeue=args.requeue,
            doctor=doctor, view=caller.view if caller else runner.View(),
        )  # fmt: skip
    finally:
        if doctor is not None:
            doctor.close()
        if hang.directory is None and not (doctor and doctor.reports):
            shutil.rmtree(hang_dir, ignore_errors=True)  # nothing to look at: no stall
    if args.profile:
        _print_profile(Path(args.profile).resolve(), len(plan.ranks))
    return code


def _print_profile(directory: Path, ranks: int) -> None:
    """The profile's report; nothing in it changes the job's exit status (a report that
    fails says so, and the job's own status stands)."""
    from hvdkit.profile import report

    try:
        text = report.finish(directory, ranks)
    except Exception as exc:  # noqa: BLE001 - advice never fails the job it describes
        text = (
            f"hvdkit profile: the report of {directory} failed ({type(exc).__name__}: {exc}); "
            "the job's exit status is its own (the ranks' records are kept)"
        )
    print(text, flush=True)


def _profile_env(directory: str | None) -> list[str]:
    """``--profile DIR``: the variable that turns each rank's recorder on."""
    return [f"{envvars.PROFILE_DIR}={Path(directory).resolve()}"] if directory else []


def _clear_profile(directory: str | None) -> None:
    """An earlier run's records in DIR would be read as this run's."""
    if directory:
        path = Path(directory).resolve()
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("rank-*.json"):
            old.unlink()


def _gpu_problem(plan: LaunchPlan) -> str | None:
    """With a NCCL build, more ranks on this machine than its GPUs fail inside NCCL once the
    job runs: say so before launching (other hosts: ``hvdkit doctor --hostfile``)."""
    from hvdkit import gpus
    from hvdkit.horovod_build import record

    if not record.nccl_built():
        return None
    here = _local_names() | {"127.0.0.1"}
    local = max((slot.local_size for slot in plan.ranks if slot.host in here), default=0)
    return gpus.shared_gpu_problem(local, len(gpus.probe().gpus), nccl=True) if local else None


def _local_names() -> set[str]:
    """The names this machine goes by in a host list. Names only: a DNS lookup (getfqdn)
    can stall a launch for seconds."""
    name = socket.gethostname()
    return {"localhost", name, name.split(".")[0]}
