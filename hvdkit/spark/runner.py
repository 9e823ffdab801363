"""``hvdkit.spark.run``: one Spark barrier stage of ``num_proc`` tasks, one Horovod rank each.

The tasks are scheduled together (barrier execution mode), learn each other's executors from
``BarrierTaskContext.getTaskInfos()``, plan the world from them (:mod:`hvdkit.engines.world`;
an executor's host is a Horovod host) and join a Gloo rendezvous that the driver serves
(:mod:`hvdkit.engines.rendezvous`). Each task tells the driver when it starts, and, when ``fn``
raises, its traceback; the driver then cancels the stage at once, so neither Spark's stage
retries nor ranks waiting in a collective keep the job alive.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from hvdkit.engines import interpreter, world
from hvdkit.engines.checks import answers, pickled, require
from hvdkit.engines.rendezvous import Rendezvous, iface_holding, put
from hvdkit.launch import hang_doctor
from hvdkit.launch.hang_doctor import Doctor

_jobs = itertools.count()


class TaskError(RuntimeError):
    """``fn`` raised on a rank (its traceback is in the message); the job was cancelled."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _pyspark() -> Any:
    return require("pyspark", "hvdkit.spark", "spark")


def _check_cluster(sc: Any, num_proc: int) -> None:
    """Fail at once where Spark would wait: a standalone master that does not answer, or
    more tasks than the cluster can run at the same time (a barrier stage needs them all)."""
    master = sc.master
    if master.startswith("spark://"):
        for hostport in master[len("spark://") :].split(","):
            if not answers(hostport):
                raise ConnectionError(
                    f"hvdkit.spark.run: the Spark master {master} does not answer. Fix: "
                    "start it, or point the SparkSession at a running one"
                )
    cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    if sc.getConf().get("spark.default.parallelism") is None:
        slots = sc.defaultParallelism // cpus  # the cores of the executors (at least 2)
        if num_proc > slots:
            raise RuntimeError(
                f"hvdkit.spark.run(num_proc={num_proc}): the Spark cluster runs {slots} tasks "
                f"at a time ({sc.defaultParallelism} cores, spark.task.cpus={cpus}), and all "
                f"{num_proc} ranks must run together. Fix: num_proc <= {slots}, or add "
                "executors"
            )


def _set_worker_python(sc: Any) -> None:
    """A local master's workers run the driver's Python unless the user chose one
    (:func:`hvdkit.engines.interpreter.spark_worker_python`). pyspark reads ``sc.pythonExec``
    each time it sends a function (``rdd._wrap_function``, pyspark 4.3), so this also holds
    for a context created before."""
    conf = dict(sc.getConf().getAll())
    chosen = interpreter.spark_worker_python(sc.master, os.environ, conf, sys.executable)
    if chosen:
        sc.pythonExec = chosen


def _check_worker_python(sc: Any, num_proc: int, timeout: float) -> None:
    """Runs :func:`hvdkit.engines.interpreter.probe` on ``num_proc`` executor slots (a
    barrier stage, as the job's own): an executor whose Python cannot import hvdkit is said
    in one line with the fix, not as a ModuleNotFoundError inside Spark's Java trace."""
    group = f"hvdkit.spark.probe.{os.getpid()}.{next(_jobs)}"
    outcome: dict[str, Any] = {}

    def collect() -> None:
        sc.setJobGroup(group, "hvdkit.spark.run: the executors' Python", interruptOnCancel=True)
        rdd = sc.parallelize(range(num_proc), num_proc).barrier()
        try:
            outcome["reports"] = rdd.mapPartitions(interpreter.probe).collect()
        except Exception as exc:  # noqa: BLE001  (reported below, shortened)
            outcome["error"] = exc

    thread = threading.Thread(target=collect, name=group, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        sc.cancelJobGroup(group)
        thread.join(30)
        raise TimeoutError(
            f"hvdkit.spark.run: {num_proc} tasks did not start within start_timeout="
            f"{timeout:g} s. Fix: free executors' cores for {num_proc} tasks at once, or a "
            "larger start_timeout"
        )
    if "error" in outcome:
        raise RuntimeError(
            f"hvdkit.spark.run: the Spark executors could not run Python "
            f"({interpreter.SPARK_PYTHON_VAR}={sc.pythonExec}): "
            f"{interpreter.reason(str(outcome['error']))}. Fix: set "
            f"{interpreter.SPARK_PYTHON_VAR} (or {interpreter.SPARK_PYTHON_CONF}) to a Python "
            f"{sys.version_info.major}.{sys.version_info.minor} that has hvdkit on every "
            "executor"
        ) from None
    pythons = interpreter.lacking(outcome["reports"])
    if pythons:
        raise RuntimeError(
            interpreter.lacking_message("hvdkit.spark.run", "Spark executors", pythons,
                                        interpreter.spark_fix(sys.executable))
        )  # fmt: skip


def _shutdown_horovod() -> None:
    """Python workers are reused for later tasks: leave no Horovod initialised for them."""
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            module.shutdown()


def _task(payload: bytes, driver: str, port: int, scope: str, env: dict[str, str],
          nics: list[str] | None) -> Callable[[Iterator[int]], Iterator[Any]]:  # fmt: skip
    address = f"{driver}:{port}"

    def run_rank(_: Iterator[int]) -> Iterator[Any]:
        from pyspark import BarrierTaskContext, cloudpickle

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        hosts = [info.address.rpartition(":")[0] for info in ctx.getTaskInfos()]
        put(address, scope, f"started_{rank}", hosts[rank])
        slot = world.plan(hosts, "Spark")[rank]
        iface = nics[0] if nics else iface_holding(slot.host)
        os.environ.update({**slot.env(driver, port, iface), **env})
        fn, args, kwargs = cloudpickle.loads(payload)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            put(address, scope, f"error_{rank}", [time.time(), traceback.format_exc()])
            raise
        finally:
            _shutdown_horovod()
        yield rank, result

    return run_rank


def run(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    nics: Any = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Horovod ranks (default: the context's
    ``defaultParallelism``), one Spark task each, in the active SparkContext; returns the
    results in rank order.

    ``start_timeout`` (default ``$HOROVOD_SPARK_START_TIMEOUT`` or 600 s): how long the tasks
    may take to start. ``env``: set in each task before ``fn``. ``nics``: the interface Gloo
    uses (the first one given).

    Differs from Horovod: ranks run with Gloo only, inside Spark's Python workers (``use_mpi``,
    ``extra_mpi_args`` and ``executable`` are refused; there is no separate process to start),
    and their output stays in the executors' logs (``stdout``, ``stderr`` and
    ``prefix_output_with_timestamp`` are accepted and unused). A rank whose ``fn`` raises
    cancels the job at once and :class:`TaskError` carries its traceback; Horovod leaves
    Spark to retry the stage. No ``pyarrow`` pin, and no Spark estimators.

    The executors' Python: with a local master (``local[N]``, ``local-cluster[...]``) and
    neither ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, the context's workers run
    the driver's interpreter (``sys.executable``) rather than ``python3`` from ``PATH``. Before
    the job, one task per rank checks that its Python can import hvdkit; one that cannot is
    a RuntimeError naming that Python and its host, and the fix.
    """
    pyspark = _pyspark()
    from pyspark import cloudpickle

    if use_mpi or extra_mpi_args or executable:
        raise ValueError(
            "hvdkit.spark.run runs its ranks with Gloo in Spark's own Python workers: "
            "use_mpi, extra_mpi_args and executable are not supported. Fix: leave them unset"
        )
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(
            "hvdkit.spark.run: no active SparkContext. Fix: create one first, e.g. "
            "SparkSession.builder.master('local[2]').getOrCreate()"
        )
    num_proc = num_proc or sc.defaultParallelism
    _check_cluster(sc, num_proc)
    payload = pickled(cloudpickle.dumps, fn, (fn, tuple(args), dict(kwargs or {})),
                      "hvdkit.spark.run")  # fmt: skip
    if start_timeout is None:
        start_timeout = float(os.environ.get("HOROVOD_SPARK_START_TIMEOUT", "600"))
    _set_worker_python(sc)
    _check_worker_python(sc, num_proc, start_timeout)
    nic_list = sorted(nics) if nics else None
    driver = sc.getConf().get("spark.driver.host") or socket.gethostbyname(socket.gethostname())
    group = f"hvdkit.spark.run.{os.getpid()}.{next(_jobs)}"
    scope = group.replace(".", "_")
    rendezvous = Rendezvous()
    outcome: dict[str, Any] = {}
    hang = hang_doctor.engine_config("hvdkit.spark.run")
    folder, hang_env = hang_doctor.engine_folder(hang)
    host_of = dict.fromkeys(range(num_proc), "?")
    with hang_doctor.watching(hang, folder, host_of, lambda: sc.cancelJobGroup(group)) as doctor:

        def collect() -> None:
            sc.setJobGroup(group, "hvdkit.spark.run", interruptOnCancel=True)
            task_env = {**hang_env, **dict(env or {})}
            task = _task(payload, driver, rendezvous.port, scope, task_env, nic_list)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            try:
                outcome["results"] = rdd.collect()
            except Exception as exc:  # noqa: BLE001  (re-raised by the caller's thread)
                outcome["error"] = exc

        thread = threading.Thread(target=collect, name=group, daemon=True)
        started_at = time.monotonic()
        thread.start()
        try:
            return _wait(sc, thread, outcome, rendezvous, scope, group, num_proc, start_timeout,
                         started_at, doctor)  # fmt: skip
        finally:
            rendezvous.stop()
            if folder is not None and not (doctor and doctor.reports):
                shutil.rmtree(folder, ignore_errors=True)  # nothing to look at: no stall


def _failed_rank(rendezvous: Rendezvous, scope: str, num_proc: int) -> tuple[int, str] | None:
    """The rank that raised first (the others often raise because it stopped), and its
    traceback."""
    errors = [(e[0], rank, e[1]) for rank in range(num_proc)
              if (e := rendezvous.read(scope, f"error_{rank}"))]  # fmt: skip
    if not errors:
        return None
    _, rank, text = min(errors)
    return rank, text


def _wait(sc: Any, thread: threading.Thread, outcome: dict[str, Any], rendezvous: Rendezvous,
          scope: str, group: str, num_proc: int, start_timeout: float,
          started_at: float, doctor: Doctor | None = None) -> list[Any]:  # fmt: skip
    all_started = False
    while thread.is_alive():
        thread.join(0.5)
        failed = _failed_rank(rendezvous, scope, num_proc)
        if failed:
            sc.cancelJobGroup(group)
            thread.join(30)
            rank, text = failed
            raise TaskError(
                rank,
                f"hvdkit.spark.run: rank {rank} raised; the job was cancelled. Its traceback "
                f"(on its executor):\n{text}",
            )
        if not all_started:
            hosts = {r: rendezvous.read(scope, f"started_{r}") for r in range(num_proc)}
            started = sum(1 for host in hosts.values() if host is not None)
            all_started = started == num_proc
            if doctor is not None:  # where each rank runs, for its report
                doctor.host_of.update({r: str(h) for r, h in hosts.items() if h is not None})
            if not all_started and time.monotonic() - started_at > start_timeout:
                sc.cancelJobGroup(group)
                thread.join(30)
                raise TimeoutError(
                    f"hvdkit.spark.run: {started} of {num_proc} tasks started within "
                    f"start_timeout={start_timeout:g} s. Fix: free executors' cores for "
                    f"{num_proc} tasks at once, or a larger start_timeout"
                )
    if doctor is not None and doctor.stopped:
        raise RuntimeError(
            "hvdkit.spark.run: the hang doctor cancelled the job (HVDKIT_ON_STALL=stop); its "
            "report above says which ranks waited, which were missing and where each was"
        )
    if "error" in outcome:
        failed = _failed_rank(rendezvous, scope, num_proc)
        if failed:
            rank, text = failed
            raise TaskError(rank, f"hvdkit.spark.run: rank {rank} raised:\n{text}")
        raise outcome["error"]
    by_rank = dict(outcome["results"])
    return [by_rank[rank] for rank in range(num_proc)]
