"""``hvdkit doctor``: check that this machine can run Horovod jobs, one PASS/FAIL line per
check with the fix under each failure; exits non-zero if anything failed."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from hvdkit.commands import options
from hvdkit.doctor.checks import FAIL, SKIP, Check

if TYPE_CHECKING:
    from hvdkit.doctor.checks import BuildMatrix


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check versions, Horovod's build and real allreduces", description=__doc__
    )
    parser.add_argument(
        "--no-allreduce",
        dest="allreduce",
        action="store_false",
        help="skip the 2-process allreduce runs",
    )
    options.add_network_interface(parser, "network interface for the allreduce runs")
    options.add_hostfile(
        parser, "check every host in FILE over ssh, then run an allreduce across all of them"
    )
    options.add_ssh_options(parser)
    parser.set_defaults(func=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    from hvdkit.doctor import checks
    from hvdkit.doctor.gpu import gpu_section

    results: list[Check] = []

    def emit(check: Check) -> None:
        results.append(check)
        print(check.render(), flush=True)

    for check in checks.version_checks():
        emit(check)
    build, matrix = checks.build_checks()
    for check in build:
        emit(check)
    for check in gpu_section():
        emit(check)
    if args.hostfile:
        _cluster_checks(args, matrix, emit)
    elif matrix is not None and args.allreduce:
        for check in checks.allreduce_checks(matrix, args.network_interface):
            emit(check)
    failed = [c for c in results if c.status == FAIL]
    print(
        f"\n{len(results) - len(failed)} checks passed, {len(failed)} failed"
        + ("" if not failed else ": " + ", ".join(c.name for c in failed))
    )
    return 1 if failed else 0


def _cluster_checks(
    args: argparse.Namespace, matrix: BuildMatrix | None, emit: Callable[[Check], None]
) -> None:
    from hvdkit.doctor import checks, remote
    from hvdkit.launch.hostfile import HostfileError, parse_hostfile

    try:
        hosts = parse_hostfile(args.hostfile)
    except HostfileError as exc:
        emit(Check(FAIL, "hostfile", str(exc), "fix the line named above"))
        return
    ssh = {"port": args.ssh_port, "identity": args.ssh_identity_file}
    host_results = list(remote.host_checks(hosts, **ssh))
    for check in host_results:
        emit(check)
    if matrix is None or not args.allreduce:
        return
    if any(c.status == FAIL and c.name.startswith("host ") for c in host_results):
        emit(Check(SKIP, "allreduce across hosts", "skipped: not every host can be reached"))
        return
    emit(
        checks.allreduce_check(
            "torch" if matrix.frameworks.get("torch") else "tensorflow",
            "gloo",
            hosts=hosts,
            network_interface=args.network_interface,
            ssh_port=args.ssh_port,
            ssh_identity_file=args.ssh_identity_file,
        )
    )
