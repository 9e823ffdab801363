"""``hvdkit doctor``: check that this machine can run Horovod jobs, one PASS/FAIL line per
check with the fix under each failure; exits non-zero if anything failed."""

from __future__ import annotations

import argparse

from hvdkit.doctor.checks import FAIL, Check


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
    parser.add_argument(
        "--network-interface",
        metavar="IF",
        default=None,
        help="network interface for the allreduce runs (horovodrun's flag)",
    )
    parser.set_defaults(func=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    from hvdkit.doctor import checks

    results: list[Check] = []

    def emit(check: Check) -> None:
        results.append(check)
        print(check.render(), flush=True)

    for check in checks.version_checks():
        emit(check)
    build, matrix = checks.build_checks()
    for check in build:
        emit(check)
    emit(checks.gpu_check())
    if matrix is not None and args.allreduce:
        for check in checks.allreduce_checks(matrix, args.network_interface):
            emit(check)
    failed = [c for c in results if c.status == FAIL]
    print(
        f"\n{len(results) - len(failed)} checks passed, {len(failed)} failed"
        + ("" if not failed else ": " + ", ".join(c.name for c in failed))
    )
    return 1 if failed else 0
