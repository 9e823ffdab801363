"""hvdkit.run's pure parts: Horovod 0.28.1's signature, its keywords as ``hvdkit run``'s flags,
Horovod's own argument checks, the addresses the ranks try, the server's key, the message of
a rank's failure. The real jobs are in tests/test_func_run.py and tests/test_notebooks.py."""

from __future__ import annotations

import inspect
import urllib.error
import urllib.request

import pytest

import hvdkit
from hvdkit.launch import func_run
from hvdkit.launch.func_run import RankError, _argv, _parse
from hvdkit.launch.func_server import HEADER, Failure, FuncServer, addresses

HOROVOD_RUN = "horovod.runner"


def test_the_signature_is_horovods():
    """Every parameter of horovod.run, in its order, with its default: a call that works
    there binds the same here. hvdkit's one addition is keyword-only, after them."""
    runner = pytest.importorskip(HOROVOD_RUN)
    theirs = inspect.signature(runner.run).parameters
    ours = inspect.signature(hvdkit.run).parameters
    positional = [p for p in ours.values() if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in positional] == list(theirs)
    for p in positional:
        assert p.default == theirs[p.name].default, p.name
    assert [p.name for p in ours.values() if p.kind is p.KEYWORD_ONLY] == [
        "show_ranks", "stall_timeout", "on_stall"]  # fmt: skip
    assert hvdkit.run is func_run.run


def launched(monkeypatch, **kwargs):
    """What hvdkit.run would launch: the parsed ``hvdkit run`` arguments."""
    seen = {}

    def fake(func, args, kw, parsed, executable, shown):
        seen.update(parsed=parsed, args=args, kwargs=kw, executable=executable, shown=shown)
        return ["ok"]

    monkeypatch.setattr(func_run, "_launch", fake)
    assert hvdkit.run(print, **kwargs) == ["ok"]
    return seen


def test_every_keyword_becomes_its_flag(monkeypatch):
    seen = launched(monkeypatch, args=(1,), kwargs={"a": 2}, num_proc=4, min_num_proc=2,
                    max_num_proc=6, slots=2, reset_limit=3, cooldown_range=(5, 30),
                    hostfile="hosts.txt", start_timeout=45, ssh_port=2222,
                    ssh_identity_file="/k/id", output_filename="logs", verbose=True,
                    use_gloo=True, network_interfaces=["eth0", "ib0"], executable="/py",
                    stall_timeout=5, on_stall="stop")  # fmt: skip
    p = seen["parsed"]
    assert (p.np, p.min_np, p.max_np, p.slots_per_host, p.reset_limit) == (4, 2, 6, 2, 3)
    assert p.blacklist_cooldown_range == [5, 30] and p.hostfile == "hosts.txt"
    assert (p.start_timeout, p.ssh_port, p.ssh_identity_file) == (45, 2222, "/k/id")
    assert (p.output_dir, p.verbose, p.controller) == ("logs", True, "gloo")
    assert p.network_interface == "eth0,ib0" and p.command == []
    assert (p.stall_timeout, p.on_stall) == (5, "stop")
    assert seen["args"] == (1,) and seen["kwargs"] == {"a": 2} and seen["executable"] == "/py"
    assert seen["shown"] == frozenset({0})

    p = launched(monkeypatch, hosts="a:2,b:2", use_mpi=True, mpi_args="--bind-to none",
                 show_ranks="all")["parsed"]  # fmt: skip
    assert (p.hosts, p.controller, p.mpi_args) == ("a:2,b:2", "mpi", "--bind-to none")
    assert launched(monkeypatch, host_discovery_script="./d.sh")["parsed"].host_discovery_script
    assert launched(monkeypatch, show_ranks=[0, 1])["shown"] == frozenset({0, 1})


def test_deprecated_spellings_warn_and_count(monkeypatch):
    with pytest.warns(DeprecationWarning) as caught:
        p = launched(monkeypatch, np=3, min_np=1, max_np=4, network_interface="eth0")["parsed"]
    assert (p.np, p.min_np, p.max_np, p.network_interface) == (3, 1, 4, "eth0")
    assert {str(w.message) for w in caught} == {  # Horovod's words
        "np is deprecated, use num_proc instead", "min_np is deprecated, use min_num_proc instead",
        "max_np is deprecated, use max_num_proc instead",
        "network_interface is deprecated, use network_interfaces instead"}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hosts": "a:1", "hostfile": "f"}, "Argument hosts and hostfile only allow one provided."),
        ({"use_gloo": True, "use_mpi": True}, "Argument use_gloo and use_mpi only allow one set"),
        ({"num_proc": 0}, r"hvdkit.run\(num_proc=0\): give a whole number >= 1"),
        ({"num_proc": 2.5}, r"num_proc=2.5"),
        ({"num_proc": True}, r"num_proc=True"),
        ({"cooldown_range": (5, -1)}, r"cooldown_range=-1"),
        ({"slots": "2"}, r"slots='2'"),
        ({"on_stall": "kill"}, r"on_stall='kill'\): give 'wait' or 'stop'"),
        ({"stall_timeout": -1}, r"stall_timeout=-1"),
    ],
)
def test_horovods_checks_and_each_number_named(monkeypatch, kwargs, message):
    monkeypatch.setattr(func_run, "_launch", lambda *a: pytest.fail("launched"))
    with pytest.raises(ValueError, match=message):
        hvdkit.run(print, **kwargs)


def test_what_hvdkit_run_refuses_is_a_value_error_not_an_exit():
    # Two host sources at once: argparse's complaint, which would exit a notebook's kernel.
    with pytest.raises(ValueError, match="not allowed with argument"):
        _parse(_argv(**{**dict.fromkeys(ARGV_KEYWORDS), "hosts": "a:1",
                        "host_discovery_script": "./d"}))  # fmt: skip


ARGV_KEYWORDS = [n for n, p in inspect.signature(_argv).parameters.items() if p.default is p.empty]


def test_addresses_route_first_then_loopback():
    routes = {"10.0.0.2": "10.0.0.1", "10.0.0.3": "10.0.0.1", "gpu7": "192.168.1.5"}
    assert addresses(["10.0.0.2", "10.0.0.3", "gpu7"], 5000, False, routes.get) == [
        "10.0.0.1:5000", "192.168.1.5:5000"]  # fmt: skip
    assert addresses(["10.0.0.2"], 5000, True, routes.get) == ["10.0.0.1:5000", "127.0.0.1:5000"]
    assert addresses([], 5000, True, routes.get) == ["127.0.0.1:5000"]
    # A host that does not resolve here: loopback is still tried (it may be this machine).
    assert addresses(["nowhere"], 7, False, routes.get) == ["127.0.0.1:7"]


def test_the_server_wants_its_key_and_keeps_each_ranks_last_write():
    with FuncServer(b"payload") as server:
        base = f"http://127.0.0.1:{server.port}"

        def call(path, key, body=None):
            request = urllib.request.Request(base + path, data=body,
                                             method="GET" if body is None else "PUT",
                                             headers={HEADER: key})  # fmt: skip
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read()

        with pytest.raises(urllib.error.HTTPError, match="403"):
            call("/func", "not-the-key")
        with pytest.raises(urllib.error.HTTPError, match="403"):
            call("/result/0", "", b"forged")
        assert call("/func", server.key) == (200, b"payload")
        assert call("/result/1", server.key, b"first")[0] == 204
        assert call("/result/1", server.key, b"second")[0] == 204
        assert call("/error/0", server.key, b"e")[0] == 204
        with pytest.raises(urllib.error.HTTPError, match="404"):
            call("/result/x", server.key, b"?")
        assert server.results == {1: b"second"} and server.errors == {0: b"e"}
        assert len(server.key) == 64


def test_a_rank_error_names_the_rank_host_and_the_others():
    one = Failure(1, "ValueError", "bad shape", "Traceback ...\nValueError: bad shape\n",
                  ValueError("bad shape"))  # fmt: skip
    two = Failure(3, "KeyError", "'x'", "Traceback ...\n")
    error = RankError([one, two], {1: "node1", 3: "node2"})
    text = str(error)
    assert text.startswith("rank 1 (host node1) raised ValueError: bad shape")
    assert "(also rank 3 (host node2) raised KeyError: 'x')" in text
    assert "rank 1's traceback:\nTraceback ...\nValueError: bad shape" in text
    assert isinstance(error, RuntimeError) and error.rank == 1
