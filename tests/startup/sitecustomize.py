"""Measurement only (``make startup-cost``, tests/startup_cost.py): with this folder on
``PYTHONPATH`` and ``HVDKIT_STARTUP_LOG`` set, every Python process the tests start appends one
line at exit: the test that started it (``PYTEST_CURRENT_TEST``, which children inherit), the
seconds from the process's start to here (interpreter start), the seconds spent in the first
import of each heavy framework, and its whole life."""

import os

if os.environ.get("HVDKIT_STARTUP_LOG"):
    import atexit
    import builtins
    import json
    import sys
    import time

    _here = time.time()
    # The test that started this process, read now: a pytest inside a job's ranks
    # (tests/in_ranks.py) sets its own and clears it before exit.
    _test = os.environ.get("PYTEST_CURRENT_TEST", "")
    try:
        with open("/proc/self/stat") as f:
            _ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            _boot = time.time() - float(f.read().split()[0])
        _started = _boot + _ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        _started = _here
    _HEAVY = {"torch", "tensorflow", "keras", "jax", "horovod", "ray", "pyspark", "numpy"}
    _imports: dict = {}
    _depth = [0]
    _real = builtins.__import__

    def _timed(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.partition(".")[0]
        if level or _depth[0] or top not in _HEAVY or top in sys.modules:
            return _real(name, globals, locals, fromlist, level)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return _real(name, globals, locals, fromlist, level)
        finally:
            _depth[0] -= 1
            _imports[top] = _imports.get(top, 0.0) + time.perf_counter() - start

    builtins.__import__ = _timed

    def _record() -> None:
        line = {
            "test": _test or os.environ.get("PYTEST_CURRENT_TEST", ""),
            "argv": " ".join(sys.argv)[:160],
            "boot": round(_here - _started, 3),
            "imports": {k: round(v, 3) for k, v in _imports.items()},
            "life": round(time.time() - _started, 3),
        }
        with open(os.environ["HVDKIT_STARTUP_LOG"], "a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(_record)
