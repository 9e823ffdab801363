"""Starting ``hvdkit bench``'s jobs: one plain process, or ranks under horovodrun through
hvdkit's launch plan (so a hostfile, controller and interface work as in ``hvdkit run``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from hvdkit import envvars
from hvdkit.bench.plan import Job
from hvdkit.bench.worker import parse_results
from hvdkit.launch.horovodrun import launcher_argv, without_end
from hvdkit.launch.hostfile import Host
from hvdkit.launch.plan import LaunchConfig, build_plan

TAIL_LINES = 25


class BenchError(RuntimeError):
    """A job failed; the message names it and ends with the tail of its output."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def command_for(
    job: Job,
    hosts: list[Host] | None,
    available: tuple[str, ...],
    network_interface: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start ``job``."""
    command = (sys.executable, "-m", job.module, *job.args)
    if job.controller is None:
        return list(command), dict(job.env)
    hosts = hosts or [Host("localhost", job.np)]
    first = "127.0.0.1" if hosts[0].name == "localhost" else hosts[0].name
    # torch.distributed (DDP, its allreduce) rendezvous at the first host, next to Horovod's.
    env = {**job.env, envvars.BENCH_MASTER: f"{first}:{_free_port()}"}
    if job.np == 1 and first == "127.0.0.1" and "mpi" in available:
        # One local rank needs no launcher (a start costs a rendezvous and its processes): Horovod
        # initialises as an MPI singleton.
        return list(command), env
    config = LaunchConfig(
        command=command,
        np=job.np,
        controller=job.controller,
        network_interface=network_interface,
        env=tuple(f"{k}={v}" for k, v in env.items()),
    )
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    plan = build_plan(config, hosts, available=available, horovodrun=horovodrun)
    return launcher_argv(plan.argv), plan.env


def run_job(job: Job, argv: list[str], env: dict[str, str], timeout: float) -> list[dict]:
    """Run one job to the end and return rank 0's results (one per model for training)."""
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=timeout,
            env={**os.environ, **env}, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout if isinstance(exc.stdout, str) else ""
        raise BenchError(f"{job.label}: no result after {timeout:.0f} s{_tail(text)}") from None
    results = parse_results(out.stdout)
    if out.returncode != 0 or not results:
        raise BenchError(
            f"{job.label}: exit {out.returncode}"
            + ("" if results else ", no result printed")
            + _tail(out.stdout + out.stderr)
        )
    return results


def _tail(text: str) -> str:
    lines = [line for line in without_end(text).splitlines() if line.strip()][-TAIL_LINES:]
    return ("\n  " + "\n  ".join(lines)) if lines else ""


def run_jobs(
    jobs: list[Job],
    starter: Callable[[Job], tuple[list[str], dict[str, str]]],
    timeout: float,
    progress: bool = True,
) -> Iterator[tuple[Job, dict]]:
    """Run ``jobs`` one after another with a progress bar, yielding each result (a job may
    have several) as it comes."""
    try:
        from tqdm import tqdm
    except ImportError:  # no bar: one line per job instead
        tqdm = None
    bar = None
    if progress and tqdm is not None:
        bar = tqdm(total=len(jobs), unit="job", file=sys.stderr,
                   bar_format="{l_bar}{bar:20}{r_bar}")  # fmt: skip
    try:
        for i, job in enumerate(jobs, 1):
            if bar is not None:
                bar.set_description(job.label)
            elif progress:
                print(f"hvdkit bench: [{i}/{len(jobs)}] {job.label}", file=sys.stderr, flush=True)
            argv, env = starter(job)
            for result in run_job(job, argv, env, timeout):
                yield job, result
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
