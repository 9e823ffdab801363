"""``hvdkit build-horovod``: build Horovod against the installed frameworks (or reuse the
cached wheel), install it, and check its build matrix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hvdkit.horovod_build.config import (
    CONTROLLERS,
    FRAMEWORKS,
    HOROVOD_VERSION,
    BuildConfig,
    default_cache_dir,
)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build-horovod",
        help="build and install Horovod for the frameworks in this Python",
        description=__doc__,
    )
    parser.add_argument("--horovod-version", default=HOROVOD_VERSION)
    parser.add_argument(
        "--frameworks",
        type=_csv,
        default=None,
        help="comma list of torch,tensorflow (default: those installed)",
    )
    parser.add_argument(
        "--controllers",
        type=_csv,
        default=CONTROLLERS,
        help="comma list of gloo,mpi (default: both)",
    )
    parser.add_argument(
        "--gpu-operations",
        choices=["NCCL"],
        default=None,
        help="build GPU collectives with NCCL (default: CPU build)",
    )
    parser.add_argument(
        "--cuda-arch",
        type=_csv,
        default=(),
        dest="cuda_arch_list",
        help="compute capabilities, e.g. 80,90 (default: the visible GPUs')",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"wheel cache root (default: {default_cache_dir()})",
    )
    parser.add_argument(
        "--no-cache",
        dest="use_cache",
        action="store_false",
        help="compile even when a matching cached wheel exists",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="reinstall even when this exact build is already installed",
    )
    parser.add_argument(
        "--system-deps",
        choices=["auto", "apt", "check"],
        default="auto",
        help="auto/apt: apt-get install missing Debian packages when root; check: only report them",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="parallel compile jobs (default: from cores and memory)",
    )
    parser.add_argument(
        "--sdist",
        type=Path,
        default=None,
        help="a local horovod-X.tar.gz instead of downloading it",
    )
    parser.add_argument(
        "--allow-untested",
        action="store_true",
        help="build even with a Python, PyTorch or TensorFlow outside the tested ranges",
    )
    parser.add_argument(
        "--debug-info",
        action="store_true",
        help="compile with -g, as Horovod's own build does (default: without; faster, and "
        "a smaller wheel)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what was found and which remedies apply, then stop",
    )
    parser.set_defaults(func=build_horovod_command)


def build_horovod_command(args: argparse.Namespace) -> int:
    from hvdkit.horovod_build.builder import BuildError, build_horovod, describe_plan, plan_problems
    from hvdkit.horovod_build.cache import cache_key
    from hvdkit.horovod_build.probe import probe
    from hvdkit.horovod_build.remedies import plan_remedies

    env = probe() if args.frameworks is None or args.plan else None
    frameworks = args.frameworks
    if frameworks is None:
        assert env is not None
        frameworks = tuple(f for f in FRAMEWORKS if env.has_framework(f))
        if not frameworks:
            print(
                "error: neither PyTorch nor TensorFlow is installed in this Python "
                f"({sys.executable}).\nFix: install one first (see "
                "hvdkit/horovod_build/stack-cpu.txt) or name them with --frameworks.",
                file=sys.stderr,
            )
            return 2
    try:
        cfg = BuildConfig(
            horovod_version=args.horovod_version,
            frameworks=frameworks,
            controllers=args.controllers,
            gpu_operations=args.gpu_operations,
            cuda_arch_list=args.cuda_arch_list,
            use_cache=args.use_cache,
            system_deps=args.system_deps,
            jobs=args.jobs,
            sdist=args.sdist,
            allow_untested=args.allow_untested,
            debug_info=args.debug_info,
            **({"cache_dir": args.cache_dir} if args.cache_dir else {}),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        assert env is not None
        print(describe_plan(env, cfg, plan_remedies(env, cfg), cache_key(env, cfg)))
        packages, problems = plan_problems(env, cfg)
        if packages:
            print(f"Will apt-get install: {' '.join(packages)}")
        if problems:
            print("\nerror: the build would fail:\n\n" + "\n\n".join(map(str, problems)))
            return 1
        return 0
    try:
        result = build_horovod(cfg, force=args.force)
    except BuildError as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 1
    print(f"Horovod ready ({result.source}, {result.seconds:.0f} s).")
    return 0
