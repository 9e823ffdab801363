"""The pure part of hvdkit.ray and hvdkit.spark: the Horovod world planned from the hosts
the engine placed its workers on (hvdkit/engines/world.py), and the driver's key-value store."""

from __future__ import annotations

import pytest

from hvdkit.engines import world


def test_one_host_numbers_ranks_locally():
    slots = world.plan(["n1", "n1"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2, 0, 1),
        (1, 1, 2, 0, 1),
    ]


def test_uneven_and_interleaved_hosts_follow_horovods_rules():
    # Workers 0 and 2 on host a, 1 on b, 3 on c: local ranks count each host's workers in
    # order; cross ranks count the hosts that have a worker of that local rank.
    slots = world.plan(["a", "b", "a", "c"])
    got = [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert got == [("a", 0, 2, 0, 3), ("b", 0, 1, 1, 3), ("a", 1, 2, 0, 1), ("c", 0, 1, 2, 3)]
    assert {s.size for s in slots} == {4} and [s.rank for s in slots] == [0, 1, 2, 3]


def test_env_is_what_horovods_gloo_reads():
    (slot,) = world.plan(["node-7"])
    env = slot.env("10.0.0.1", 4242, "eth0")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["HOROVOD_HOSTNAME"] == "node-7" and env["HOROVOD_GLOO_IFACE"] == "eth0"
    assert all(isinstance(v, str) for v in env.values())
    assert "HOROVOD_GLOO_IFACE" not in slot.env("10.0.0.1", 4242, None)


def test_no_workers_is_an_error():
    with pytest.raises(ValueError):
        world.plan([])


def test_iface_for_an_address():
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["10.1.2.3"], "docker0": []}
    assert world.iface_for("10.1.2.3", interfaces) == "eth0"
    assert world.iface_for("127.0.0.1", interfaces) == "lo"
    assert world.iface_for("192.168.1.1", interfaces) is None


def test_the_drivers_store_round_trips_json():
    pytest.importorskip("horovod")
    from hvdkit.engines.rendezvous import Rendezvous, put

    server = Rendezvous(world.plan(["h", "h"]))
    try:
        assert server.read("job", "started_0") is None
        put(f"127.0.0.1:{server.port}", "job", "started_0", [1.5, "text"])
        assert server.read("job", "started_0") == [1.5, "text"]
    finally:
        server.stop()


def test_without_the_engine_installed_the_error_names_the_extra():
    """Importing needs no engine; using one without it installed says which extra to install."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None; sys.modules['pyspark'] = None\n"
        "import hvdkit.ray, hvdkit.spark\n"
        "for call in (lambda: hvdkit.ray.RayExecutor(None, num_workers=2),\n"
        "             lambda: hvdkit.spark.run(print)):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'hvdkit[ray]'" in out.stdout
    assert "pip install 'hvdkit[spark]'" in out.stdout


def test_the_host_names_an_engine_hands_over_are_checked():
    """Ray and Spark report each worker's host; the names are checked as every host name is
    (hvdkit.launch.names), naming the engine and the worker."""
    from hvdkit.engines import world
    from hvdkit.launch.names import BadInputError

    assert [s.host for s in world.plan(["10.0.0.1", "node-2"], "Ray")] == ["10.0.0.1", "node-2"]
    with pytest.raises(BadInputError, match=r"^Spark's worker 1: bad host name 'a;id'"):
        world.plan(["ok", "a;id"], "Spark")
