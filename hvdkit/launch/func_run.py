"""``hvdkit.run``: Horovod 0.28.1's Python launcher (``horovod.run``), which runs a function on
N processes and returns each rank's result in rank order, through everything ``hvdkit run``
does (hosts and allocations, name checks, the private environment, controllers, elastic
jobs, the hang doctor).

The function and its closure travel by cloudpickle to fresh processes (started by
horovodrun, never forked from the caller: CUDA or a framework initialised in a notebook does
not reach the ranks). Where it differs from Horovod's, on purpose:

- only rank 0's output is shown (``show_ranks`` shows others; Horovod shows every rank's),
  and in a Jupyter cell progress bars redraw in place;
- an exception on a rank is raised here as :class:`RankError` naming the rank, with the
  rank's traceback, and the rank's own exception as its ``__cause__`` (Horovod raises a
  ``RuntimeError`` that says some process failed);
- an interrupt (Ctrl-C, a notebook's stop button) stops every rank and raises
  ``KeyboardInterrupt`` once none is left;
- ``disable_cache`` is accepted and does nothing: hvdkit answers horovodrun's checks from
  its build record instead of caching them.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hvdkit.launch.func_server import ADDRS, KEY, Failure, FuncServer, addresses, route_source

RANK_ZERO_ONLY = (0,)


class RankError(RuntimeError):
    """A rank's function raised: the message names the rank (and host) and carries the rank's
    traceback; ``__cause__`` is the rank's exception where it could be pickled. A
    ``RuntimeError``, as what Horovod raises when a process fails."""

    def __init__(self, failures: list[Failure], hosts: dict[int, str]) -> None:
        first = failures[0]
        others = "".join(f"\n(also {f.describe(hosts.get(f.rank))})" for f in failures[1:])
        super().__init__(
            f"{first.describe(hosts.get(first.rank))}{others}\n\n"
            f"rank {first.rank}'s traceback:\n{first.traceback.rstrip()}"
        )
        self.failures = failures
        self.rank = first.rank


def _whole(name: str, value: Any, least: int = 0) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"hvdkit.run({name}={value!r}): give a whole number >= {least}")
    return str(value)


def _argv(
    *,
    num_proc: int | None,
    min_num_proc: int | None,
    max_num_proc: int | None,
    slots: int | None,
    reset_limit: int | None,
    cooldown_range: Sequence[int] | None,
    hosts: str | None,
    hostfile: str | None,
    host_discovery_script: str | None,
    start_timeout: int | None,
    ssh_port: int | None,
    ssh_identity_file: str | None,
    output_filename: str | None,
    verbose: bool | None,
    use_gloo: bool | None,
    use_mpi: bool | None,
    mpi_args: str | None,
    network_interfaces: Iterable[str] | None,
    stall_timeout: int | None = None,
    on_stall: str = "wait",
) -> list[str]:
    """``hvdkit run``'s arguments for Horovod's keywords (pure). Horovod's own checks first,
    with its messages; each number checked here, named by its keyword."""
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    argv = ["run"]
    numbers = (("num_proc", "-np", num_proc, 1), ("min_num_proc", "--min-np", min_num_proc, 1),
               ("max_num_proc", "--max-np", max_num_proc, 1),
               ("slots", "--slots-per-host", slots, 1),
               ("reset_limit", "--reset-limit", reset_limit, 0),
               ("start_timeout", "--start-timeout", start_timeout, 1),
               ("ssh_port", "--ssh-port", ssh_port, 1),
               ("stall_timeout", "--stall-timeout", stall_timeout, 0))  # fmt: skip
    for name, flag, value, least in numbers:
        if value is not None:
            argv += [flag, _whole(name, value, least)]
    if cooldown_range is not None:
        low, high = cooldown_range
        argv += ["--blacklist-cooldown-range", _whole("cooldown_range", low),
                 _whole("cooldown_range", high)]  # fmt: skip
    for flag, text in (("-H", hosts), ("--hostfile", hostfile),
                       ("--host-discovery-script", host_discovery_script),
                       ("--ssh-identity-file", ssh_identity_file),
                       ("--output-dir", output_filename)):  # fmt: skip
        if text is not None:
            argv += [flag, str(text)]
    if network_interfaces:
        argv += ["--network-interface", ",".join(network_interfaces)]
    if mpi_args:
        argv.append(f"--mpi-args={mpi_args}")
    if on_stall not in ("wait", "stop"):
        raise ValueError(f"hvdkit.run(on_stall={on_stall!r}): give 'wait' or 'stop'")
    argv += ["--on-stall", on_stall]
    argv += ["--gloo"] if use_gloo else ["--mpi"] if use_mpi else []
    argv += ["--verbose"] if verbose else []
    return argv


def _parse(argv: list[str]) -> Any:
    """``argv`` parsed by ``hvdkit run``'s own parser; its complaint as a ValueError (argparse
    would exit the caller's process, a notebook's kernel)."""
    from hvdkit.cli import build_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return build_parser().parse_args(argv)
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or ["bad arguments"])[-1]
        raise ValueError(f"hvdkit.run: {last.removeprefix('hvdkit run: error: ')}") from None


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel writing to a cell (ipykernel's stream)."""
    module = type(sys.stdout).__module__
    return module.startswith("ipykernel")


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: Sequence[int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Iterable[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    show_ranks: int | Iterable[int] | str = RANK_ZERO_ONLY,
    stall_timeout: int | None = None,
    on_stall: str = "wait",
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` processes (Horovod's ``horovod.run``,
    0.28.1's signature and keywords) and return each rank's return value, in rank order; an
    elastic job (``min_num_proc`` or ``host_discovery_script``) returns the first
    ``min_num_proc`` ranks' values, as Horovod's does.

    ``func`` must pickle with cloudpickle (a notebook's functions and lambdas do; a function
    of a module is found by import on the ranks, which start in this process's working
    directory). ``np``, ``min_np``, ``max_np`` and ``network_interface`` are Horovod's
    deprecated spellings. hvdkit's own keywords: ``show_ranks``, the ranks whose output is
    shown (default rank 0; ``"all"``; every rank's is kept for the message when one fails);
    ``stall_timeout`` and ``on_stall``, the hang doctor's (``hvdkit run --stall-timeout``,
    ``--on-stall``: after ``stall_timeout`` s (default 60, 0: off) without a collective
    finishing, it reports who waits, who is missing and where each rank is; then ``"wait"``
    or ``"stop"``).

    Raises :class:`RankError` when a rank's function raised, ``RuntimeError`` when the job
    failed otherwise (the lines printed above name the rank and host) or the hang doctor
    stopped it, ``ValueError`` for
    arguments that cannot make a job, and ``KeyboardInterrupt`` after an interrupt has stopped
    every rank.
    """
    if network_interface:
        network_interfaces = network_interface.split(",")
        warnings.warn("network_interface is deprecated, use network_interfaces instead",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
    for old, new, value in (("np", "num_proc", np), ("min_np", "min_num_proc", min_np),
                            ("max_np", "max_num_proc", max_np)):  # fmt: skip
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning,
                          stacklevel=2)  # fmt: skip
    num_proc = np if np is not None else num_proc
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    del disable_cache  # hvdkit keeps no check cache (its build record answers)
    parsed = _parse(_argv(
        num_proc=num_proc, min_num_proc=min_num_proc, max_num_proc=max_num_proc, slots=slots,
        reset_limit=reset_limit, cooldown_range=cooldown_range, hosts=hosts, hostfile=hostfile,
        host_discovery_script=host_discovery_script, start_timeout=start_timeout,
        ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
        output_filename=output_filename, verbose=verbose, use_gloo=use_gloo, use_mpi=use_mpi,
        mpi_args=mpi_args, network_interfaces=network_interfaces, stall_timeout=stall_timeout,
        on_stall=on_stall,
    ))  # fmt: skip
    if isinstance(show_ranks, int):
        show_ranks = (show_ranks,)
    shown = None if show_ranks == "all" else frozenset(int(r) for r in show_ranks)
    return _launch(func, tuple(args), dict(kwargs or {}), parsed, executable, shown)


def _launch(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    parsed: Any,
    executable: str | None,
    shown: frozenset[int] | None,
) -> list[Any]:
    import cloudpickle

    from hvdkit.commands.run import Caller, UsageError, _local_names, launch
    from hvdkit.launch.hostfile import Host
    from hvdkit.launch.runner import View

    def call() -> Any:
        return func(*args, **kwargs)

    try:
        payload = cloudpickle.dumps(call)
    except Exception as exc:
        raise ValueError(
            f"hvdkit.run: {getattr(func, '__name__', func)!r} and its arguments cannot be "
            f"pickled for the ranks ({type(exc).__name__}: {exc}). Fix: pass what the function "
            "needs as arguments it can rebuild (paths, numbers), not open files, locks or "
            "live connections"
        ) from exc
    planned: dict[int, str] = {}
    with FuncServer(payload) as server:

        def env_for(hosts: list[Host]) -> tuple[str, ...]:
            here = _local_names() | {"127.0.0.1"}
            remote = [h.name for h in hosts if h.name not in here]
            addrs = addresses(remote, server.port, len(remote) < len(hosts), route_source)
            return (f"{ADDRS}={','.join(addrs)}", f"{KEY}={server.key}")

        caller = Caller(
            command=(executable or sys.executable, "-m", "hvdkit.launch.func_task"),
            env_for=env_for,
            view=View(ranks=shown, inline_progress=in_notebook()),
            planned=lambda plan: planned.update({s.rank: s.host for s in plan.ranks}),
        )
        try:
            code = launch(parsed, caller)
        except UsageError as exc:
            raise ValueError(f"hvdkit.run: {exc}") from None
        elastic = parsed.min_np is not None or parsed.host_discovery_script is not None
        first = (parsed.min_np or parsed.np or 1) if elastic else None
        return _results(server, code, planned, first)


def _results(
    server: FuncServer,
    code: int,
    planned: dict[int, str],
    first: int | None,
) -> list[Any]:
    """Each rank's value in rank order (an elastic job's: its ``first`` ranks'), or the
    exception that says why there are none."""
    import cloudpickle

    from hvdkit.launch import hang_doctor

    if server.errors:
        failures = []
        for rank in sorted(server.errors):
            record = cloudpickle.loads(server.errors[rank])
            exception = None
            if record["exception"] is not None:
                with contextlib.suppress(Exception):  # a class the caller cannot import
                    exception = cloudpickle.loads(record["exception"])
            failures.append(Failure(rank, record["kind"], record["message"],
                                    record["traceback"], exception))  # fmt: skip
        error = RankError(failures, planned)
        raise error from failures[0].exception
    if code == 130:
        raise KeyboardInterrupt("hvdkit.run: interrupted; every rank was stopped")
    if code == hang_doctor.EXIT_CODE:
        raise RuntimeError(
            "hvdkit.run: the hang doctor stopped the job (on_stall='stop'); its report above "
            "says which ranks waited, which were missing and where each was"
        )
    if code != 0:
        raise RuntimeError(
            f"hvdkit.run: the job failed (exit status {code}); the lines above name the rank "
            "and host that failed"
        )
    wanted = range(len(planned) if first is None else first)
    missing = [r for r in wanted if r not in server.results]
    if missing:
        raise RuntimeError(
            f"hvdkit.run: the job ended well, but rank(s) {missing} returned no result"
        )
    return [cloudpickle.loads(server.results[r]) for r in wanted]
