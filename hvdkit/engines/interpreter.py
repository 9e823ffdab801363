"""Which Python an engine's workers run, and whether it can import hvdkit.

Spark starts its Python workers with ``PYSPARK_PYTHON``, else ``python3`` from ``PATH``, not
the driver's interpreter: a driver run as ``.venv/bin/python train.py`` without the venv
activated gets workers without hvdkit, and the job dies inside a page of Java stack trace.
Ray's workers run the cluster's Python, or ``runtime_env``'s ``py_executable``. Before the real
job, hvdkit.spark and hvdkit.ray run :func:`probe` on the workers and, where one cannot import
hvdkit, say so in one line with the fix (:func:`lacking_message`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

SPARK_PYTHON_VAR = "PYSPARK_PYTHON"
SPARK_PYTHON_CONF = "spark.pyspark.python"
_LOCAL_PREFIXES = ("local[", "local-cluster[")


def spark_is_local(master: str) -> bool:
    """Whether a Spark master URL runs its executors on this machine (``local``,
    ``local[N]``, ``local[*]``, ``local[N,F]``, ``local-cluster[N,C,M]``)."""
    return master == "local" or master.startswith(_LOCAL_PREFIXES)


def spark_worker_python(
    master: str, env: Mapping[str, str], conf: Mapping[str, str], driver_python: str
) -> str | None:
    """The Python Spark's workers should run, where hvdkit is to set it; None to leave
    pyspark's choice (``env``'s ``PYSPARK_PYTHON``, else ``python3`` from ``PATH``).

    ``spark.pyspark.python`` wins, as under ``spark-submit`` (a driver started as plain
    ``python`` leaves it unread by pyspark); then ``PYSPARK_PYTHON``. With neither, a local
    master's workers run ``driver_python``: they are on this machine, and ``python3`` from
    ``PATH`` is often not the interpreter that has hvdkit. A cluster's workers keep pyspark's
    default: the driver's path need not exist there.
    """
    if conf.get(SPARK_PYTHON_CONF):
        return conf[SPARK_PYTHON_CONF]
    if env.get(SPARK_PYTHON_VAR):
        return None
    return driver_python if spark_is_local(master) else None


def probe(_: object = None) -> list[tuple[str, str, bool]]:
    """``[(host, sys.executable, whether hvdkit can be imported)]`` of the Python this runs
    in (a list: Spark's ``mapPartitions`` takes it as the partition's one row)."""
    import importlib.util
    import socket
    import sys

    return [(socket.gethostname(), sys.executable, importlib.util.find_spec("hvdkit") is not None)]


# cloudpickle sends a function of an importable module by reference, and unpickling that
# imports hvdkit: the very failure the probe is for. A function of ``__main__`` travels by
# value; the probe uses nothing but the standard library, imported inside.
probe.__module__ = "__main__"


def lacking(reports: Iterable[tuple[str, str, bool]]) -> list[str]:
    """``"<python> on host <host>"`` for each distinct worker Python that lacks hvdkit."""
    seen: dict[str, None] = {}
    for host, executable, has_hvdkit in reports:
        if not has_hvdkit:
            seen.setdefault(f"{executable} on host {host}")
    return list(seen)


def lacking_message(who: str, workers: str, pythons: list[str], fix: str) -> str:
    """One line: which workers' Python cannot import hvdkit, and ``fix``."""
    shown = ", ".join(pythons[:3]) + (f" and {len(pythons) - 3} more" if len(pythons) > 3 else "")
    return f"{who}: the {workers}' Python ({shown}) cannot import hvdkit. Fix: {fix}"


def spark_fix(driver_python: str) -> str:
    return (
        f"set {SPARK_PYTHON_VAR} (or {SPARK_PYTHON_CONF}) to a Python that has hvdkit, e.g. "
        f"{SPARK_PYTHON_VAR}={driver_python}"
    )


def ray_fix(driver_python: str) -> str:
    return (
        "start the Ray nodes with a Python that has hvdkit, or point the job's runtime_env at "
        f"one, e.g. ray.init(runtime_env={{'py_executable': '{driver_python}'}}) where that "
        "path exists on every node"
    )


def reason(error: str) -> str:
    """The gist of an engine's error (a Py4JJavaError's text: a Java stack, maybe a Python
    traceback inside): what the worker's process said, else the innermost Python exception,
    else the first Java exception with a message of its own."""
    lines = [line.rstrip() for line in error.strip().splitlines()]
    for i, line in enumerate(lines):
        if line.strip() == "Error from python worker:":  # the process died before pyspark ran
            said = next((s.strip() for s in lines[i + 1 :] if s.strip()), "")
            return f"its Python exited saying {said!r}"
    exceptions = [m for line in lines if (m := _EXCEPTION.match(line))]
    python = [m for m in exceptions if "Traceback (most recent call last)" in error
              and not m.group(1).startswith(("java.", "org.apache.", "scala."))]  # fmt: skip
    for match in python[-1:] + exceptions:
        if match.group(2) and not match.group(2).startswith("Job aborted"):
            return f"{match.group(1).rpartition('.')[2]}: {match.group(2)}"
    return lines[0] if lines else "unknown error"


_EXCEPTION = re.compile(r"^([\w.$]+(?:Error|Exception)): (.*)$")
