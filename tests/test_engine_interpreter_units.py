"""hvdkit.engines.interpreter (pure): which Python Spark's workers run, the probe that asks a
worker whether it can import hvdkit (sent by value: it must unpickle where hvdkit is absent),
and the one-line messages made from what the probe and the engines report."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import sysconfig

import pytest

from hvdkit.engines import interpreter
from hvdkit.engines.interpreter import (
    lacking,
    lacking_message,
    reason,
    spark_is_local,
    spark_worker_python,
)

DRIVER = "/home/u/proj/.venv/bin/python"


@pytest.mark.parametrize(
    ("master", "local"),
    [
        ("local", True),
        ("local[2]", True),
        ("local[*]", True),
        ("local[4,3]", True),
        ("local-cluster[2,1,1024]", True),
        ("spark://head:7077", False),
        ("yarn", False),
        ("k8s://https://api:6443", False),
        ("localhost", False),
    ],
)
def test_which_masters_run_their_executors_on_this_machine(master, local):
    assert spark_is_local(master) is local


@pytest.mark.parametrize(
    ("master", "env", "conf", "expected"),
    [
        # Nothing chosen: a local master's workers run the driver's Python.
        ("local[2]", {}, {}, DRIVER),
        ("local-cluster[2,1,1024]", {"PATH": "/usr/bin"}, {}, DRIVER),
        ("local[2]", {"PYSPARK_PYTHON": ""}, {}, DRIVER),  # empty is unset
        # The user's PYSPARK_PYTHON: pyspark already uses it.
        ("local[2]", {"PYSPARK_PYTHON": "/opt/py/bin/python"}, {}, None),
        # spark.pyspark.python wins, as under spark-submit (plain python leaves it unread).
        ("local[2]", {}, {"spark.pyspark.python": "/opt/py/bin/python"}, "/opt/py/bin/python"),
        ("local[2]", {"PYSPARK_PYTHON": "/a/python"}, {"spark.pyspark.python": "/b/python"},
         "/b/python"),
        ("spark://head:7077", {}, {"spark.pyspark.python": "/b/python"}, "/b/python"),
        # A cluster keeps pyspark's default: the driver's path need not exist there.
        ("spark://head:7077", {}, {}, None),
        ("yarn", {}, {}, None),
    ],
)  # fmt: skip
def test_the_workers_python_for_each_master_env_and_conf(master, env, conf, expected):
    assert spark_worker_python(master, env, conf, DRIVER) == expected


def test_lacking_names_each_python_once_and_the_message_is_one_line():
    reports = [("a", "/usr/bin/python3", False), ("a", "/usr/bin/python3", False),
               ("b", "/venv/bin/python", True), ("c", "/usr/bin/python3", False)]  # fmt: skip
    pythons = lacking(reports)
    assert pythons == ["/usr/bin/python3 on host a", "/usr/bin/python3 on host c"]
    assert lacking([("b", "/venv/bin/python", True)]) == []
    message = lacking_message("hvdkit.spark.run", "Spark executors", pythons,
                              interpreter.spark_fix(DRIVER))  # fmt: skip
    assert message == (
        "hvdkit.spark.run: the Spark executors' Python (/usr/bin/python3 on host a, "
        "/usr/bin/python3 on host c) cannot import hvdkit. Fix: set PYSPARK_PYTHON (or "
        f"spark.pyspark.python) to a Python that has hvdkit, e.g. PYSPARK_PYTHON={DRIVER}"
    )
    many = lacking_message("RayExecutor", "Ray workers", [f"p on host h{i}" for i in range(5)],
                           interpreter.ray_fix(DRIVER))  # fmt: skip
    assert "h2 and 2 more) cannot import hvdkit" in many and "\n" not in many
    assert f"runtime_env={{'py_executable': '{DRIVER}'}}" in many


JAVA = "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:3122)"  # noqa: E501
ABORTED = (
    "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
    ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover "
    "from a failed barrier ResultStage.\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # What pyspark 4.3 raised in the probe's job (shortened): a PYSPARK_PYTHON that is
        # not there, one of another minor version, one that exits before pyspark runs.
        (ABORTED + 'java.io.IOException: Cannot run program "/nonexistent": error=2, No such '
         f"file or directory\n{JAVA}\nCaused by: java.io.IOException: error=2, No such file",
         'IOException: Cannot run program "/nonexistent": error=2, No such file or directory'),
        (ABORTED + "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An "
         "exception was thrown from the Python worker: Traceback (most recent call last):\n"
         '  File "worker.py", line 4174, in invoke_udf\n    check_python_version(v)\n'
         "pyspark.errors.exceptions.base.PySparkRuntimeError: [PYTHON_VERSION_MISMATCH] "
         f"Python in worker has different version: 3.12 than that in driver: 3.11.\n{JAVA}",
         "PySparkRuntimeError: [PYTHON_VERSION_MISMATCH] Python in worker has different "
         "version: 3.12 than that in driver: 3.11."),
        (ABORTED + "org.apache.spark.SparkException: \nError from python worker:\n  boom\n"
         "PYTHONPATH was:\n  /x/pyspark.zip\n" + JAVA, "its Python exited saying 'boom'"),
        ("something else entirely\nsecond line", "something else entirely"),
        ("", "unknown error"),
    ],
)  # fmt: skip
def test_reason_is_the_gist_of_an_engine_error(text, expected):
    assert reason(text) == expected


def python_without_hvdkit(tmp_path) -> tuple[str, dict[str, str]]:
    """The venv's base interpreter, with the venv's packages on PYTHONPATH: pyspark and Ray
    import, hvdkit (an editable install, found through a .pth that PYTHONPATH does not run)
    does not."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs hvdkit installed in a venv: its base Python then lacks hvdkit")
    base = getattr(sys, "_base_executable", "") or os.path.realpath(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    code = "import importlib.util as u; print(u.find_spec('hvdkit'))"
    has = subprocess.run([base, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    if has.stdout.strip() != "None":
        pytest.skip(f"{base} with PYTHONPATH={env['PYTHONPATH']} finds hvdkit: {has.stdout}")
    return base, env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["pyspark", "ray"])
def test_the_probe_travels_by_value_to_a_python_without_hvdkit(engine, tmp_path):
    """cloudpickle sends functions of importable modules by reference; the probe must not
    be, or unpickling it would fail on the very worker it is to diagnose."""
    cloudpickle = pytest.importorskip(f"{engine}.cloudpickle")
    base, env = python_without_hvdkit(tmp_path)
    (tmp_path / "probe.pkl").write_bytes(cloudpickle.dumps(interpreter.probe))
    code = ("import pickle, sys; rows = pickle.load(open('probe.pkl', 'rb'))(); "
            "print(rows[0][1:], 'hvdkit' in sys.modules)")  # fmt: skip
    out = subprocess.run([base, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=90)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [f"('{base}',", "False)", "False"], out.stdout


def test_pyspark_reads_python_exec_each_time_it_sends_a_function():
    """hvdkit.spark sets ``sc.pythonExec`` on a context that exists: that holds only while
    pyspark reads it per function sent (pyspark 4.3: ``rdd._wrap_function``)."""
    rdd = pytest.importorskip("pyspark.core.rdd")
    assert "sc.pythonExec" in inspect.getsource(rdd._wrap_function)
    context = pytest.importorskip("pyspark.core.context")
    assert 'os.environ.get("PYSPARK_PYTHON", "python3")' in inspect.getsource(context)


def test_the_probe_reports_this_python():
    assert interpreter.probe() == [(socket.gethostname(), sys.executable, True)]
