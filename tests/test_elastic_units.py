"""hvdkit run's elastic options: checks, horovodrun arguments, discovery parsing (pure), and
the discovery-script probe (a real subprocess: the thin part)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdkit.launch.discover import probe
from hvdkit.launch.elastic import (
    ElasticConfig,
    ElasticError,
    hostfile_discovery,
    parse_discovery_output,
)
from hvdkit.launch.hostfile import Host
from hvdkit.launch.plan import LaunchConfig, LaunchError, build_plan, describe

HOSTS = [Host("localhost", 1), Host("127.0.0.1", 1)]


def plan(elastic: ElasticConfig, hosts=HOSTS, **kw):
    config = LaunchConfig(command=("python", "t.py"), elastic=elastic, **kw)
    return build_plan(config, hosts, available=("gloo", "mpi"), horovodrun="horovodrun")


def test_elastic_argv_uses_horovods_flags_and_gloo():
    config = ElasticConfig(
        min_np=1, max_np=2, discovery="./d.sh", slots_per_host=2, reset_limit=3,
        cooldown_range=(5, 60), elastic_timeout=30,
    )  # fmt: skip
    p = plan(config)
    assert p.argv == [
        "horovodrun", "-np", "2", "--min-np", "1", "--max-np", "2",
        "--host-discovery-script", "./d.sh", "--slots-per-host", "2", "--reset-limit", "3",
        "--blacklist-cooldown-range", "5", "60", "--elastic-timeout", "30", "--gloo",
        "python", "t.py",
    ]  # fmt: skip
    assert p.controller == "gloo"  # even where MPI is available: Horovod's elastic is Gloo
    text = describe(p)
    assert "elastic: start 2 processes, keep between 1..2 (Gloo)" in text
    assert "left out for 5..60 s" not in text and "for 5..60 s, then tried again" in text
    # hvdkit's own stall timeout reaches the driver hooks through the environment.
    assert p.env["HVDKIT_ELASTIC_STALL_TIMEOUT"] == "30"
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS (default 30) + 30 s (--stall-timeout)" in text


def test_fixed_host_list_offers_every_slot_and_needs_two_hosts():
    p = plan(ElasticConfig(min_np=1), hosts=[Host("a", 2), Host("b", 2)], np=2)
    assert p.argv[:5] == ["horovodrun", "-np", "2", "-H", "a:2,b:2"]
    with pytest.raises(LaunchError, match="needs at least 2 hosts"):
        plan(ElasticConfig(min_np=1), hosts=[Host("a", 4)])


def test_every_host_of_a_fixed_elastic_list_is_checked_not_only_those_used_first():
    """Issue 49, item 15: an IPv6 literal among the hosts an elastic job had not started on yet
    reached horovodrun's -H, which cannot carry it."""
    hosts = [Host("a", 2), Host("b", 2), Host("fe80::1", 2, source="-H item 3")]
    with pytest.raises(LaunchError, match=r"^-H item 3: fe80::1 is an IPv6 literal"):
        plan(ElasticConfig(min_np=1), hosts=hosts, np=2)
    assert plan(None, hosts=hosts, np=2).argv[3:5] == ["-H", "a:2"]  # a fixed job uses 'a' only


@pytest.mark.parametrize(
    ("kwargs", "np", "message"),
    [
        ({"min_np": 3, "max_np": 2}, None, "--min-np 3 is above --max-np 2"),
        ({"min_np": 0}, None, "--min-np 0: give at least 1"),
        ({"min_np": 1, "cooldown_range": (0, 5)}, None, "1 <= MIN <= MAX <= 3600"),
        ({"min_np": 1, "reset_limit": -1}, None, "--reset-limit -1"),
        ({"min_np": 1, "stall_timeout": 0}, None, "--stall-timeout 0: give seconds >= 1"),
        ({"min_np": 2}, 1, "-np 1 is below --min-np 2"),
        ({"min_np": 1, "max_np": 1}, 2, "-np 2 is above --max-np 1"),
    ],
)
def test_bad_elastic_options_are_refused_with_the_flag(kwargs, np, message):
    with pytest.raises((ElasticError, LaunchError), match=message.replace(".", r"\.")):
        plan(ElasticConfig(discovery="./d.sh", **kwargs), np=np)


def test_elastic_with_mpi_is_refused():
    with pytest.raises(LaunchError, match="elastic mode runs on Gloo only"):
        plan(ElasticConfig(min_np=1, discovery="./d.sh"), controller="mpi")


def test_default_np_is_every_slot_up_to_max_np():
    assert ElasticConfig(min_np=1).initial_np(None, 4) == 4
    assert ElasticConfig(min_np=1, max_np=3).initial_np(None, 4) == 3
    assert ElasticConfig(min_np=2).initial_np(None, 1) == 2  # waits for the slot


def test_discovery_output_is_parsed_and_bad_lines_named():
    hosts = parse_discovery_output("a:2\n\nb\n", "script", default_slots=3)
    assert [(h.name, h.slots) for h in hosts] == [("a", 2), ("b", 3)]
    assert parse_discovery_output("", "script", None) == []
    with pytest.raises(ElasticError, match="script: output line 2: .*host or host:slots"):
        parse_discovery_output("a:2\nb slots=2\n", "script", None)
    with pytest.raises(ElasticError, match="output line 1: .*IPv6"):
        parse_discovery_output("fe80::1\n", "script", None)


def test_hostfile_discovery_prints_the_hostfile_in_horovods_format(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=2\nnode-b\n")
    out = subprocess.run(
        hostfile_discovery(str(hostfile), slots_per_host=4), shell=True, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert out.stdout == "localhost:2\nnode-b:4\n"
    hostfile.write_text("localhost slots=two\n")  # being edited: fails, horovodrun retries
    bad = subprocess.run(hostfile_discovery(str(hostfile)), shell=True, capture_output=True,
                         text=True)  # fmt: skip
    assert bad.returncode == 1 and f"{hostfile}:1: slots must be a whole number" in bad.stderr


def test_probe_reports_missing_unexecutable_failing_and_bad_scripts(tmp_path):
    script = tmp_path / "d.sh"
    with pytest.raises(ElasticError, match="no such file"):
        probe(str(script), None)
    script.write_text("#!/bin/sh\necho localhost:2\n")
    with pytest.raises(ElasticError, match="not executable. Fix: chmod \\+x"):
        probe(str(script), None)
    script.chmod(0o755)
    assert [(h.name, h.slots) for h in probe(str(script), None)] == [("localhost", 2)]
    script.write_text("#!/bin/sh\necho 'no route' >&2\nexit 3\n")
    with pytest.raises(ElasticError, match="exited with status 3:\nno route"):
        probe(str(script), None)
    script.write_text("#!/bin/sh\necho 'localhost:x'\n")
    with pytest.raises(ElasticError, match="output line 1"):
        probe(str(script), None)
    script.write_text("#!/bin/sh\nsleep 5\n")
    with pytest.raises(ElasticError, match="still running after 1 s"):
        probe(str(script), None, timeout=1)


def test_probe_names_a_command_a_shell_cannot_read_and_output_that_is_not_text(tmp_path):
    """Issue 49, item 15: an unbalanced quote, and bytes that are not UTF-8, were tracebacks."""
    with pytest.raises(ElasticError, match=r"^--host-discovery-script '\./d\.sh: a shell cannot "
                       r"read it \(no closing quotation\)\. Fix: balance its quotes"):  # fmt: skip
        probe("'./d.sh", None)
    script = tmp_path / "d.sh"
    script.write_bytes(b"#!/bin/sh\necho localhost:1\nprintf 'caf\\351:1\\n'\n")
    script.chmod(0o755)
    with pytest.raises(ElasticError, match=r"output line 2 is not UTF-8 text\. Fix: print host"):
        probe(str(script), None)
    script.write_bytes(b"#!/bin/sh\nprintf 'caf\\351' >&2\nexit 4\n")
    with pytest.raises(ElasticError, match="exited with status 4:\ncaf\ufffd"):
        probe(str(script), None)


TWO_HOSTS = ["-H", "localhost:1,127.0.0.1:1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*TWO_HOSTS, "--max-np", "2"], "--max-np is for elastic jobs: add --min-np N"),
        ([*TWO_HOSTS, "--stall-timeout", "-1"], "--stall-timeout -1: give seconds >= 0"),
        ([*TWO_HOSTS, "--min-np", "1", "--mpi"], "Horovod's elastic mode runs on Gloo only"),
        (["--min-np", "1", "--host-discovery-script", "/nonexistent/d.sh"], "no such file"),
        (["--min-np", "1", "--host-discovery-script", "'./d.sh"], "a shell cannot read it"),
        (["-np", "1", "--env", "MY-TOKEN=abc123", "--dry-run"], "--env 'MY-TOKEN=...': "),
    ],
)
def test_hvdkit_run_refuses_before_starting(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "hvdkit", "run", *args, "--", "python", "t.py"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "abc123" not in out.stderr


@pytest.mark.parametrize("shuffle", [False, True])
def test_elastic_session_sampler_resplits_the_rest_of_the_epoch(shuffle):
    """The rest of the epoch after ``offset`` samples, split over the ranks there are now:
    every rank the same count, every remaining sample once (padding repeats the first ones);
    with offset 0 the split is DistributedSampler's."""
    from torch.utils.data import DistributedSampler

    from hvdkit.torch.session import _PositionSampler

    def rows(size, offset, rank, drop_last=False):
        sampler = _PositionSampler(10, shuffle, 7, drop_last)
        sampler.begin(3, offset, size, rank)
        return list(sampler)

    for size in (1, 2, 3):
        for r in range(size):
            reference = DistributedSampler(range(10), size, r, shuffle=shuffle, seed=7)
            reference.set_epoch(3)
            assert rows(size, 0, r) == list(reference)
    order = [i for group in zip(*(rows(2, 0, r) for r in range(2))) for i in group]
    done, rest = set(order[:4]), [rows(3, 4, r) for r in range(3)]  # 4 done at size 2, now 3
    assert len({len(part) for part in rest}) == 1
    left = [i for part in rest for i in part]
    assert set(left) == set(range(10)) - done and len(left) == 6
    assert sum(map(len, (rows(3, 5, r, drop_last=True) for r in range(3)))) == 3


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_an_elastic_restore_keeps_the_param_groups_a_scheduler_drives():
    """TorchState's optimizer restore loads into the existing param groups. Horovod's wrapped
    optimizer shares its group dicts with the one a scheduler was made on; torch's
    ``load_state_dict`` replaced them, and the scheduler went on setting an LR nothing used."""
    import torch

    from hvdkit.torch.elastic import OptimizerHandler

    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    wrapped = torch.optim.SGD(inner.param_groups, lr=0.1)  # shares the dicts, as Horovod's does
    handler = OptimizerHandler(wrapped)  # commits lr 0.1
    model(torch.ones(1, 2)).sum().backward()
    wrapped.step()
    scheduler.step()  # lr 0.05 in the shared dict
    handler.restore()
    assert wrapped.param_groups[0] is inner.param_groups[0]
    assert wrapped.param_groups[0]["lr"] == 0.1 and not wrapped.state  # the commit's
    scheduler.step()
    assert wrapped.param_groups[0]["lr"] == 0.05  # the scheduler still drives it


def test_every_discovery_output_is_checked_by_hvdkit_in_horovods_driver(tmp_path, capsys):
    """horovodrun runs the discovery script every second and splits its output itself; in
    hvdkit's horovodrun each output goes through hvdkit's parser (Horovod's own class, a real
    script): a bad name later in the job is refused with the line, said once, and the driver's
    retry rule applies (a raise keeps the hosts it had)."""
    pytest.importorskip("horovod.runner")
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    from hvdkit.launch import elastic_report

    output = tmp_path / "hosts"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {output}\n")
    script.chmod(0o755)
    original = HostDiscoveryScript.find_available_hosts_and_slots
    try:
        elastic_report.check_discovery(elastic_report.Report())
        discovery = HostDiscoveryScript(str(script), 2)
        output.write_text("node1:4\nnode2\n\n")
        assert discovery.find_available_hosts_and_slots() == {"node1": 4, "node2": 2}
        output.write_text("node1:4\n$(touch /tmp/x):1\n")
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"output line 2: bad host name '\$\(touch"):
                discovery.find_available_hosts_and_slots()
        said = capsys.readouterr().err
        assert said.count("bad host name") == 1 and "hosts kept as they were" in said
        output.write_text("node1:x\n")  # Horovod's own parser: a ValueError traceback
        with pytest.raises(RuntimeError, match="slots must be a whole number"):
            discovery.find_available_hosts_and_slots()
    finally:
        HostDiscoveryScript.find_available_hosts_and_slots = original


def test_new_hosts_take_ranks_in_the_order_they_are_listed(monkeypatch):
    """hvdkit run's elastic driver: the hostfile's order, not a set's (which changes from run
    to run); hosts already in the job keep their places ahead of new ones."""
    from horovod.runner.elastic.discovery import FixedHosts, HostManager

    from hvdkit.launch import elastic_report

    monkeypatch.setattr(HostManager, "__init__", HostManager.__init__)  # put back afterwards
    monkeypatch.setattr(HostManager, "order_available_hosts",
                        HostManager.__dict__["order_available_hosts"])  # fmt: skip
    elastic_report.keep_listed_order(HostManager)
    for order in (["hostB", "hostA", "hostC"], ["10.0.0.9", "10.0.0.1", "10.0.0.5", "10.0.0.2"]):
        manager = HostManager(FixedHosts({host: 1 for host in order}))
        manager.update_available_hosts()
        assert manager.current_hosts.host_assignment_order == order
    assert HostManager.order_available_hosts({"x", "a", "k"}, ["k", "gone"]) == ["k", "a", "x"]


def test_the_stall_timeout_sets_the_hang_doctor_for_static_jobs_too():
    """--stall-timeout was for elastic jobs only; it is the hang doctor's for every job (a
    quarter of it is Horovod's stall check), and 0 turns the doctor off."""
    def planned(*flags):
        out = subprocess.run(
            [sys.executable, "-m", "hvdkit", "run", *TWO_HOSTS, *flags, "--dry-run", "--json",
             "--", "python", "t.py"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    # (values given to the ranks this way are not shown; HangConfig's unit test checks them)
    for on in (planned("--stall-timeout", "20"), planned()):
        assert "HOROVOD_STALL_CHECK_TIME_SECONDS" in on and "HVDKIT_HANG_DIR" in on
    off = planned("--stall-timeout", "0")
    assert "HOROVOD_STALL_CHECK_TIME_SECONDS" not in off and "HVDKIT_HANG_DIR" not in off
