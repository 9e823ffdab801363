"""hvdkit run's pure parts: hostfile parsing, allocation, the exact argv, output reading."""

from __future__ import annotations

import io

import pytest
from conftest import ROOT

from hvdkit.launch.hostfile import Host, HostfileError, parse_hostfile_text, parse_hosts_arg
from hvdkit.launch.output import NO_REASON, RankOutput, failure_message
from hvdkit.launch.plan import (
    HIDDEN,
    LaunchConfig,
    LaunchError,
    build_plan,
    describe,
    forwarded_env,
)

CLUSTER = """
# four nodes, four GPUs each
server1 slots=4
server2:4            # horovodrun form
server3 slots=4 max_slots=8

10.0.0.4
fe80::1 slots=2
[fd00::2]:3
"""


def test_every_accepted_form():
    hosts = parse_hostfile_text(CLUSTER, "cluster", slots_per_host=4)
    assert [(h.name, h.slots, h.max_slots) for h in hosts] == [
        ("server1", 4, None),
        ("server2", 4, None),
        ("server3", 4, 8),
        ("10.0.0.4", 4, None),  # bare: --slots-per-host
        ("fe80::1", 2, None),
        ("fd00::2", 3, None),
    ]
    assert hosts[0].source == "cluster:3" and hosts[4].is_ipv6
    assert parse_hostfile_text("node1\n")[0].slots == 1  # bare, no --slots-per-host


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server1 slots=0", "hf:1: slots must be a whole number > 0, got '0'"),
        ("server1 slots=four", "hf:1: slots must be a whole number > 0, got 'four'"),
        ("server1:-2", "hf:1: slots must be a whole number > 0"),
        ("server1 gpus=4", "hf:1: unknown field 'gpus=4'"),
        ("ok slots=1\nbad;rm -rf slots=2", "hf:2: bad host name 'bad;rm'"),
        ("$(reboot) slots=1", "hf:1: bad host name '$(reboot)'"),
        ("user@server1 slots=1", "hf:1: bad host name 'user@server1'"),
        ("a slots=1\n\na:2", "hf:3: host 'a' is listed again (first at hf:1)"),
        ("a slots=4 max_slots=2", "hf:1: max_slots=2 is below slots=4"),
        ("a:2 slots=2", "hf:1: slots given twice"),
        ("# only comments\n\n", "hf: no hosts in it"),
    ],
)
def test_rejected_forms_name_file_line_and_fix(text, message):
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, "hf")
    assert message in str(err.value)


def test_hosts_argument():
    hosts = parse_hosts_arg("server1:4,server2:4,server3", slots_per_host=2)
    assert [(h.name, h.slots) for h in hosts] == [("server1", 4), ("server2", 4), ("server3", 2)]
    for bad, message in [
        ("a:2,,b:2", "empty host entry"),
        ("a:2,a:2", "listed again"),
        ("a b:2", "unexpected"),
        ("a:x", "slots must be"),
    ]:
        with pytest.raises(HostfileError, match=message):
            parse_hosts_arg(bad)


def plan(np=None, hosts="server1:4,server2:4,server3:4,server4:4", **kw):
    config = LaunchConfig(command=("python", "train.py", "--lr", "0.1; rm -rf /"), np=np, **kw)
    return build_plan(config, parse_hosts_arg(hosts), available=("gloo", "mpi"), environ={})


def test_golden_argv_the_seeds_16_process_job():
    p = plan(16, network_interface="eth0", start_timeout=60, ssh_port=2222, verbose=True)
    assert p.argv == [
        "horovodrun", "-np", "16", "-H", "server1:4,server2:4,server3:4,server4:4", "--mpi",
        "--network-interface", "eth0", "--start-timeout", "60", "--ssh-port", "2222",
        "--verbose", "python", "train.py", "--lr", "0.1; rm -rf /",
    ]  # fmt: skip
    assert [(s.host, s.local_rank, s.cross_rank) for s in p.ranks][4:6] == [
        ("server2", 0, 1),
        ("server2", 1, 1),
    ]


def test_np_defaults_to_all_slots_and_the_hosts_passed_on_sum_to_np():
    assert plan().argv[2:5] == ["16", "-H", "server1:4,server2:4,server3:4,server4:4"]
    assert plan(6).argv[2:5] == ["6", "-H", "server1:4,server2:2"]
    assert plan(1, controller="gloo").argv[2:6] == ["1", "-H", "server1:1", "--gloo"]


def test_launch_errors_name_the_flag():
    with pytest.raises(LaunchError, match=r"-np 17 is more than the 16 slots"):
        plan(17)
    with pytest.raises(LaunchError, match="IPv6 literal"):
        plan(2, hosts="[fe80::1]:2")
    with pytest.raises(LaunchError, match="--mpi: this Horovod cannot use MPI"):
        build_plan(
            LaunchConfig(command=("x",), controller="mpi"),
            [Host("localhost", 2)],
            available=("gloo",),
        )
    gloo_only = build_plan(LaunchConfig(command=("x",)), [Host("a", 1)], available=("gloo",))
    assert gloo_only.controller == "gloo"


def test_env_forwarding():
    assert forwarded_env(("A=1", "B", "C="), {"B": "from shell"}) == {
        "A": "1",
        "B": "from shell",
        "C": "",
    }
    with pytest.raises(LaunchError, match="--env MISSING: MISSING is not set"):
        forwarded_env(("MISSING",), {})
    with pytest.raises(LaunchError, match="give NAME or NAME=VALUE"):
        forwarded_env(("1BAD=x",), {})
    # Issue 49, item 15: a malformed item's value (often a token) stays out of the error.
    for item, shown in [("MY-TOKEN=abc123", "'MY-TOKEN=...'"), ("=abc123", "'=...'"),
                        ("NAÏVE=abc123", "'NAÏVE=...'"), ("BAD NAME", "'BAD NAME'")]:  # fmt: skip
        with pytest.raises(LaunchError) as raised:
            forwarded_env((item,), {})
        message = str(raised.value)
        assert message.startswith(f"--env {shown}: ") and "abc123" not in message


def test_dry_run_shows_rank_map_and_environment():
    p = build_plan(
        LaunchConfig(command=("python", "t.py"), env=("HVDKIT_X=1",), controller="gloo"),
        parse_hosts_arg("a:1,b:1"),
        available=("gloo",),
        environ={},
    )
    text = describe(p)
    assert "horovodrun -np 2 -H a:1,b:1 --gloo python t.py" in text
    assert "rank 1: host b local_rank 0/1 cross_rank 1" in text
    # --env's values are the user's (tokens, keys): names only, in the text and the JSON.
    assert "\n  HVDKIT_X\n" in text and "=1\n" not in text.split("HVDKIT_X")[1][:3]
    assert "HOROVOD_RANK=1" in text and "HVDKIT_X=1" not in text
    data = p.to_dict()
    assert data["ranks"][1]["env"]["HOROVOD_HOSTNAME"] == "b" and data["np"] == 2
    assert data["env"] == {"HVDKIT_X": HIDDEN} and data["ranks"][0]["env"]["HVDKIT_X"] == HIDDEN
    assert p.env == {"HVDKIT_X": "1"}  # what the ranks do receive


def test_mpi_jobs_yield_when_idle_unless_the_user_says_otherwise():
    def env(environ, extra=()):
        config = LaunchConfig(command=("x",), env=extra, controller="mpi")
        return build_plan(config, [Host("a", 2)], available=("gloo", "mpi"), environ=environ).env

    assert env({}) == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    assert "OMPI_MCA_mpi_yield_when_idle=1" in describe(
        build_plan(LaunchConfig(command=("x",)), [Host("a", 1)], available=("gloo", "mpi"),
                   environ={})
    )  # fmt: skip
    assert env({"OMPI_MCA_mpi_yield_when_idle": "0"}) == {}  # the shell's value, forwarded
    assert env({}, ("OMPI_MCA_mpi_yield_when_idle=0",)) == {"OMPI_MCA_mpi_yield_when_idle": "0"}
    gloo = LaunchConfig(command=("x",), controller="gloo")
    assert build_plan(gloo, [Host("a", 2)], available=("gloo", "mpi"), environ={}).env == {}


GLOO_FAILURE = """[0]<stdout>:hello
[1]<stderr>:Traceback (most recent call last):
[1]<stderr>:ValueError: bad batch
RuntimeError: Horovod detected that one or more processes exited with non-zero status
Process name: 1
Exit code: 7
"""
MPI_FAILURE = """[1,0]<stderr>:boom on rank zero
  Process name: [[9913,1],0]
  Exit code:    3
"""


def test_failed_rank_is_named_with_host_and_stderr_tail():
    out = RankOutput()
    for line in GLOO_FAILURE.splitlines():
        out.feed(line)
    assert out.failed_rank() == (1, 7)
    message = failure_message(out, {0: "a", 1: "b"}, 1)
    assert message.startswith("hvdkit run: rank 1 on host b failed with exit code 7")
    assert "ValueError: bad batch" in message
    mpi = RankOutput()
    for line in MPI_FAILURE.splitlines():
        mpi.feed(line)
    assert mpi.failed_rank() == (0, 3)
    assert "boom on rank zero" in failure_message(mpi, {0: "a"}, 1)


def test_a_host_lost_during_the_run_is_named_with_its_ranks():
    """Open MPI's and ssh's words for a host that went away mid-run (seen 2026-11-28 when
    every process of an ssh test host was SIGKILLed): the host and its rank are the cause,
    not the survivor whose collective failed after."""
    lost = (
        "ORTE has lost communication with a remote daemon.\n"
        "  HNP daemon   : [[28587,0],0] on node vm\n"
        "  Remote daemon: [[28587,0],2] on node 10.77.0.3\n"
        "Connection to 10.77.0.3 closed by remote host.\n"
        "[1,0]<stderr>:horovod.common.exceptions.HorovodInternalError: peer disconnected"
    )
    out = RankOutput()
    for line in lost.splitlines():
        out.feed(line)
    assert out.lost_hosts() == ["10.77.0.3"]
    message = failure_message(out, {0: "10.77.0.2", 1: "10.77.0.3"}, 1)
    assert message.startswith("hvdkit run: lost host 10.77.0.3 (rank 1) during the run")
    assert "--min-np" in message


def test_a_rank_stopped_by_another_ranks_failure_is_not_blamed():
    out = RankOutput()
    for line in [
        "[1]<stderr>:ValueError: the real cause",
        "[0]<stderr>:HorovodInternalError: Horovod has been shut down. This was caused by ...",
        "Process 0 exit with status code 1.",
        "Process 1 exit with status code 3.",
        "Process name: 0",
        "Exit code: 1",
    ]:
        out.feed(line)
    assert out.failed_rank() == (1, 3)


def test_doctor_flags_a_host_name_that_resolves_to_loopback():
    from hvdkit.doctor.remote import name_check

    bad = name_check(Host("node2", 4), {"hostname": "node2", "address": "127.0.1.1"})
    assert bad.status == "FAIL" and "/etc/hosts" in bad.fix and "127.0.1.1" in bad.detail
    good = name_check(Host("node2", 4), {"hostname": "node2", "address": "10.1.2.3"})
    assert good.status == "PASS"


def test_demux_makes_whole_lines_from_mpi_and_gloo_pieces():
    from hvdkit.launch.console import Demux, Piece, render

    d = Demux()
    # MPI tags each write: print() comes as its text and then its newline, another rank between.
    pieces = d.feed("[1,0]<stdout>:test loss: 0.1259[1,1]<stdout>:other\n", "stdout")
    pieces += d.feed("[1,0]<stdout>:\n", "stdout")
    assert [(p.rank, p.text) for p in pieces] == [(1, "other"), (0, "test loss: 0.1259")]
    # Gloo: a progress bar's pieces end in \r; untagged text is horovodrun's own.
    pieces = d.feed("[0]<stderr>: 10%\r[0]<stderr>: 50%\r[0]<stderr>:100%\n", "stderr")
    assert [(p.text, p.progress) for p in pieces] == [
        (" 10%", True),
        (" 50%", True),
        ("100%", False),
    ]
    assert d.feed("Process 1 exit with status code 7.\n", "stdout") == [
        Piece(None, "stdout", "Process 1 exit with status code 7.")
    ]
    # MPI tags each write; reading horovodrun line by line also cuts at "\r", so the rest of a
    # Keras progress write ("\b...\rbar") starts the next chunk before any tag: still rank 0's.
    raw = ("[1,0]<stdout>:Epoch 1/3\n[1,0]<stdout>:\rbar1[1,0]<stdout>:\b\b\b\b\rbar2"
           "[1,0]<stdout>:\b\b\b\b\rbar3\nProcess 1 exit with status code 0.\n")  # fmt: skip
    pieces = [p for chunk in io.StringIO(raw, newline="") for p in d.feed(chunk, "stdout")]
    assert [(p.rank, p.text, p.progress) for p in pieces] == [
        (0, "Epoch 1/3", False), (0, "", True), (0, "bar1\b\b\b\b", True),
        (0, "bar2\b\b\b\b", True), (0, "bar3", False),
        (None, "Process 1 exit with status code 0.", False),
    ]  # fmt: skip
    colored = Piece(0, "stdout", "\x1b[1m16/16\x1b[0m \x1b[32m━━\x1b[0m - loss: 0.2\b\b")
    assert render(colored, terminal=False) == "16/16 ━━ - loss: 0.2"
    assert render(colored) == colored.text  # a terminal shows them
    assert d.feed("[2]<stdout>:no newline yet", "stdout") == []
    assert d.flush() == [Piece(2, "stdout", "no newline yet")]
    assert render(Piece(0, "stdout", "x")) == "x"
    assert render(Piece(0, "stderr", "x")) == "[rank 0] x"
    assert render(Piece(3, "stdout", "x")) == "[rank 3] x"


def test_startup_noise_is_recognised_and_real_messages_are_not():
    from hvdkit.launch.console import is_noise

    noise = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1795476190.639061    6410 port.cc:153] oneDNN custom operations are on.",
        "I0000 00:00:1795476190.639599    6410 cudart_stub.cc:31] Could not find cuda drivers",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
        "TensorFlow with the appropriate compiler flags.",
    ]
    cuinit = ("E0000 00:00:1795478753.244837   32252 cuda_platform.cc:52] failed call to cuInit: "
              "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)")  # fmt: skip
    assert all(is_noise(line) for line in noise)
    assert is_noise(cuinit) and not is_noise(cuinit, gpu=True)
    real = [
        "Traceback (most recent call last):",
        "E0000 00:00:1795478753.2 32252 some_op.cc:52] Invalid argument: shapes differ",
        "W0000 00:00:1795478753.2 32252 op_kernel.cc:1] OUT_OF_RANGE: End of sequence",
        "UserWarning: Do not pass an `input_shape`/`input_dim` argument to a layer.",
        "test accuracy: 0.9526",
    ]
    assert not any(is_noise(line) for line in real)


def test_hosts_horovodrun_could_not_reach_are_named_with_ssh_s_reason():
    out = RankOutput()
    for line in ("ssh not successful for host node7:",
                 "ssh: Could not resolve hostname node7: Name or service not known", "",
                 "Traceback (most recent call last):",
                 "RuntimeError: could not connect to some hosts via ssh"):  # fmt: skip
        out.feed(line)
    assert out.unreachable() == {"node7": "ssh: Could not resolve hostname node7: Name or "
                                 "service not known"}  # fmt: skip
    message = failure_message(out, {0: "node7"}, 1)
    assert message.startswith("hvdkit run: no rank started: cannot reach node7 (ssh: Could not")
    assert "hvdkit doctor --hostfile FILE" in message
    # ssh silent (seen in CI under load): horovodrun's traceback is not the reason.
    silent = RankOutput()
    for line in ("ssh not successful for host node7:", "", "Traceback (most recent call last):",
                 '  File "launch.py", line 1, in <module>',
                 "RuntimeError: could not connect to some hosts via ssh"):  # fmt: skip
        silent.feed(line)
    assert silent.unreachable() == {"node7": NO_REASON}


def test_the_launch_package_has_no_import_cycle():
    """Every import between hvdkit.launch's modules, function-level ones included, goes one
    way (shared names live in one home, not in modules that need each other)."""
    import ast

    package = ROOT / "hvdkit" / "launch"
    names = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("hvdkit.launch."):
                    other = target.split(".")[2]
                    if other in names and other != name:
                        edges[name].add(other)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n}))
                   for n in edges[start])  # fmt: skip

    cycles = sorted(f"{a} <-> {b}" for a in names for b in edges[a] if reaches(b, a, {b}))
    assert not cycles, cycles


def test_a_plan_of_more_ranks_than_hvdkit_lists_is_refused_at_once():
    from hvdkit.launch.plan import MAX_RANKS

    hosts = [Host(f"h{i}", 4096) for i in range(40)]  # 163,840 slots
    with pytest.raises(LaunchError, match=f"hvdkit plans at most {MAX_RANKS} ranks"):
        build_plan(LaunchConfig(command=("x",), controller="gloo"), hosts, available=("gloo",))
    assert len(build_plan(LaunchConfig(command=("x",), np=8, controller="gloo"), hosts,
                          available=("gloo",)).ranks) == 8  # fmt: skip
