"""``hvdkit bench``: allreduce bandwidth against the loopback limit, training throughput and
weak scaling of hvdkit against Horovod by hand and torch DDP, Keras ``fit()`` and TensorFlow
custom-loop throughput against the allreduce written by hand, and the input pipeline, all
measured side by side in one run. Prints a table; ``--json`` and
``--plots`` keep the numbers and draw them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from hvdkit.commands import options

if TYPE_CHECKING:
    from hvdkit.bench.plan import Job


def _list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give rank counts like 1,2") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark allreduce, training throughput and scaling", description=__doc__
    )
    parser.add_argument("--np", type=_ints, default=(1, 2), metavar="N,N",
                        help="world sizes to run (default 1,2)")  # fmt: skip
    options.add_hostfile(parser, "place ranks on these hosts")
    parser.add_argument("--only", type=_list, metavar="SECTIONS",
                        help="some of: allreduce,training,keras,pipeline,profile,"
                        "memory")  # fmt: skip
    parser.add_argument("--controllers", type=_list, metavar="C,C",
                        help="for allreduce (default: every one available); the first also "
                             "runs the training and Keras jobs (default: hvdkit run's choice, "
                             "MPI when available)")  # fmt: skip
    parser.add_argument("--models", type=_list, default=("cnn", "resnet18"), metavar="M,M",
                        help="PyTorch models (cnn, mlp, resnet18, resnet50)")  # fmt: skip
    parser.add_argument("--keras-backends", type=_list, metavar="B,B",
                        default=tuple(b for b in ("tensorflow", "torch", "jax") if find_spec(b)),
                        help="Keras backends (default: those installed)")  # fmt: skip
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads per rank at every world size (default: cores / the "
                             "largest world size)")  # fmt: skip
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="run the jobs with glibc's own malloc thresholds (default: blocks "
                             "up to 32 MiB from the heap, kept: fewer page faults, steadier "
                             "steps)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps and rounds")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    options.add_network_interface(parser, "NIC(s) the jobs use, e.g. eth0")
    options.add_env(
        parser, "for every job, e.g. HOROVOD_CYCLE_TIME=5 (repeatable)", metavar="NAME=VALUE"
    )
    parser.add_argument("--timeout", type=float, default=900, metavar="S", help="per job")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=bench_command)


def _fail(message: str) -> int:
    print(f"hvdkit bench: {message}", file=sys.stderr)
    return 2


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def machine(hosts: list | None) -> dict:
    """Where the run happened: this machine (the launcher) and the hosts the ranks ran on."""
    import platform
    import socket
    from importlib import metadata

    versions = {}
    for dist in ("horovod", "torch", "tensorflow-cpu", "tensorflow", "keras"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    rank_hosts = [f"{h.name}:{h.slots}" for h in hosts] if hosts else ["localhost"]
    return {"host": socket.gethostname(), "cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions, "rank_hosts": rank_hosts}  # fmt: skip


def bench_command(args: argparse.Namespace) -> int:
    from hvdkit.bench import report
    from hvdkit.bench.execute import BenchError, command_for, run_jobs
    from hvdkit.bench.plan import SECTIONS, BenchConfig, plan_jobs
    from hvdkit.devices import cores_per_process
    from hvdkit.launch.hostfile import HostfileError, parse_hostfile
    from hvdkit.launch.runner import available_controllers

    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plots needs matplotlib. Fix: pip install matplotlib "
                         "(or pip install 'hvdkit[bench]')")  # fmt: skip
    available = available_controllers()
    if not available:
        return _fail("Horovod has no usable controller here. Fix: hvdkit build-horovod")
    hosts = None
    if args.hostfile:
        try:
            hosts = parse_hostfile(args.hostfile)
        except HostfileError as exc:
            return _fail(str(exc))
    config = BenchConfig(
        nps=args.np,
        sections=args.only or SECTIONS,
        quick=args.quick,
        controllers=args.controllers or (),
        models=args.models,
        keras_backends=args.keras_backends,
        threads=args.threads or cores_per_process(max(args.np or (1,))),
        gpu=_has_gpu(),
        steady_heap=not args.glibc_malloc_defaults,
    )
    try:
        jobs = plan_jobs(config, available)
    except ValueError as exc:
        return _fail(str(exc))
    print(f"hvdkit bench: {len(jobs)} jobs, world sizes {','.join(map(str, config.nps))}, "
          f"{config.threads} thread(s) per rank{', GPU' if config.gpu else ''}"
          f"{', quick' if config.quick else ''}",
          file=sys.stderr)  # fmt: skip

    extra = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            return _fail(f"--env {item!r}: give NAME=VALUE, e.g. --env HOROVOD_CYCLE_TIME=0.5")
        extra[name] = value

    def starter(job: Job) -> tuple[list[str], dict[str, str]]:
        return command_for(replace(job, env={**job.env, **extra}), hosts, available,
                           args.network_interface)  # fmt: skip

    records: list[dict] = []
    status, complete = 0, False
    try:
        for job, result in run_jobs(jobs, starter, args.timeout, not args.no_progress):
            records.append(report.record(job, result))
        complete = True
    except BenchError as exc:
        print(f"hvdkit bench: {exc}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        print("hvdkit bench: interrupted", file=sys.stderr)
        status = 130
    doc = report.document(config, machine(hosts), records, complete)
    print(report.table(doc["summary"]))
    if args.json:
        _write_json(Path(args.json), doc)
        print(f"hvdkit bench: wrote {args.json}{'' if complete else ' (partial)'}",
              file=sys.stderr)  # fmt: skip
    if args.plots:
        from hvdkit.bench.plots import write_plots

        for path in write_plots(doc["summary"], Path(args.plots)):
            print(f"hvdkit bench: wrote {path}", file=sys.stderr)
    return status


def _write_json(path: Path, doc: dict) -> None:
    from hvdkit.checkpoint import atomic_write

    atomic_write(path, lambda fh: fh.write(json.dumps(doc, indent=1).encode()))
