"""hvdkit run, doctor and bench across two hosts over real ssh: two network namespaces on this
machine, each with its own sshd (see tests/netns.py). Needs root; in CI it must run, not skip."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import WORKERS, results
from netns import TwoHosts, ensure_tools
from test_elastic import after_kill
from test_keras_jax import check as check_keras_jax
from test_launch import read_pids, wait_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


@pytest.fixture
def two_hosts(tmp_path):
    reason = "needs root (network namespaces)" if os.geteuid() != 0 else ensure_tools()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the two-host ssh test must run in CI: {reason}")
        pytest.skip(reason)
    hosts = TwoHosts(tmp_path)
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()


def test_hvdkit_run_and_doctor_across_two_ssh_hosts(two_hosts, capsys):
    hostfile = str(two_hosts.hostfile())
    out = two_hosts.run_in_launcher(
        [HVDKIT, "run", "--hostfile", hostfile, "--gloo", "--network-interface", "hvd0",
         "--env", "HVDKIT_TEST_VALUE=over-ssh", "--", sys.executable,
         str(WORKERS / "launch_worker.py")]
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = results(out)
    namespaces = [two_hosts.netns_id(ns) for ns in two_hosts.hosts]
    assert [r[0]["netns"], r[1]["netns"]] == namespaces  # each rank in its own "host"
    assert r[0]["sum"] == r[1]["sum"] == 3.0 and r[1]["forwarded"] == "over-ssh"

    doctor = two_hosts.run_in_launcher(
        [HVDKIT, "doctor", "--hostfile", hostfile, "--network-interface", "hvd0"]
    )
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    for addr in two_hosts.hosts.values():
        assert f"PASS  host {addr}: reachable over ssh" in doctor.stdout
        assert f"PASS  versions on {addr}" in doctor.stdout
        assert f"PASS  host name on {addr}" in doctor.stdout
    assert "PASS  allreduce across hosts" in doctor.stdout

    # hvdkit bench's allreduce across the hosts, through the same launcher plan.
    report = two_hosts.tmp / "bench.json"
    bench = two_hosts.run_in_launcher(
        [HVDKIT, "bench", "--only", "allreduce", "--np", "2", "--quick", "--controllers", "gloo",
         "--hostfile", hostfile, "--network-interface", "hvd0", "--no-progress",
         "--json", str(report)], timeout=600,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["complete"] and doc["machine"]["rank_hosts"] == [
        f"{addr}:1" for addr in two_hosts.hosts.values()
    ]
    across = next(r for r in doc["records"] if r["label"] == "allreduce np=2 gloo")["result"]
    assert across["ranks"] == 2 and all(t > 0 for t in across["seconds"]["horovod"])
    series = doc["summary"]["allreduce"]["series"]
    busbw = next(x["busbw_gbps"] for x in series if x["name"] == "horovod gloo np=2")

    # Ctrl-C on the launcher stops the ranks on both hosts (sshd alone would not).
    sleeper = two_hosts.start_in_launcher(
        [HVDKIT, "run", "--hostfile", hostfile, "--gloo", "--", sys.executable,
         str(WORKERS / "launch_worker.py"), "sleep"]
    )  # fmt: skip
    pids = read_pids(sleeper, 2)
    sleeper.send_signal(signal.SIGINT)
    assert sleeper.wait(60) == 130
    assert wait_gone(pids), pids

    second = list(two_hosts.hosts)[1]
    two_hosts.stop_sshd(second)
    broken = two_hosts.run_in_launcher([HVDKIT, "doctor", "--hostfile", hostfile])
    assert broken.returncode == 1
    addr = two_hosts.hosts[second]
    assert f"FAIL  host {addr}: unreachable: exit 255" in broken.stdout
    assert f"fix: check that sshd runs on {addr}" in broken.stdout
    assert "SKIP  allreduce across hosts" in broken.stdout
    with capsys.disabled():
        print(
            f"\n[two-host ssh test] ranks ran in {namespaces} via sshd at "
            f"{list(two_hosts.hosts.values())}; allreduce {r[0]['sum']}; doctor named {addr} "
            f"once its sshd was stopped; bench busbw across them {max(busbw):.2f} GB/s peak"
        )


def test_keras_on_jax_across_two_ssh_hosts(two_hosts):
    """JAX's runtime across hosts: its coordinator on rank 0's host, the compiled step's
    collectives over the hosts' network; the worker's oracle checks (tests/test_keras_jax.py)."""
    out = two_hosts.run_in_launcher(
        [HVDKIT, "run", "--hostfile", str(two_hosts.hostfile()), "--gloo",
         "--network-interface", "hvd0", "--env", "KERAS_BACKEND=jax", "--", sys.executable,
         str(WORKERS / "keras_jax_worker.py")], timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = results(out)
    assert [r[0]["netns"], r[1]["netns"]] == [two_hosts.netns_id(ns) for ns in two_hosts.hosts]
    first = next(iter(two_hosts.hosts.values()))
    assert r[0]["coordinator"] == r[1]["coordinator"]
    assert r[0]["coordinator"].startswith(f"{first}:"), r[0]["coordinator"]
    check_keras_jax(r)


def test_elastic_kill_across_two_ssh_hosts(two_hosts, capsys):
    """The elastic kill of tests/test_elastic.py across the two sshd hosts: the worker on the
    second host is SIGKILLed at step 17 (commit every 5); the survivor restores step 15 and goes
    on alone, the host is listed again after its cooldown, a new worker starts there over ssh,
    and the job ends at size 2 with identical weights on both hosts."""
    hostfile = str(two_hosts.hostfile())
    first, second = two_hosts.hosts.values()  # HOROVOD_HOSTNAME: the name in the hostfile
    marker = two_hosts.tmp / "killed"  # one filesystem: only the network is namespaced
    commit = 5
    started = time.monotonic()
    out = two_hosts.run_in_launcher(
        [HVDKIT, "run", "--hostfile", hostfile, "--min-np", "1", "--max-np", "2",
         "--blacklist-cooldown-range", "1", "2", "--", sys.executable,
         str(WORKERS / "elastic_worker.py"), "--marker", str(marker), "--commit", str(commit),
         "--steps", "80", "--kill-at", "17", "--kill-host", second, "--print-netns"],
        timeout=400,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    killed = json.loads(marker.read_text()) if marker.exists() else None
    survivor, rejoined, replayed = after_kill(out, killed, steps=80, commit=commit)
    assert survivor["lr"] == rejoined["lr"] == pytest.approx(0.05 * 0.9**8)  # scheduler synced
    # The survivor stayed on the first host; its replacement started on the second, over ssh.
    namespaces = [two_hosts.netns_id(ns) for ns in two_hosts.hosts]
    assert [survivor["netns"], rejoined["netns"]] == namespaces, (survivor, rejoined)
    tail = out.stderr[-3000:]
    assert f"host {second} failed (rank" in out.stderr and "SIGKILL" in out.stderr, tail
    recovery = survivor["recovered"][0] - killed["time"]
    with capsys.disabled():
        print(
            f"\n[two-host ssh elastic] {second} killed at step 17; the survivor on {first} went "
            f"on {recovery:.2f} s after the kill, {replayed} step(s) replayed; the host rejoined "
            f"and the job ended at size 2 ({elapsed:.1f} s in all)"
        )


def test_a_host_killed_under_a_static_launch_is_named(two_hosts):
    """(f) of the hang doctor's faults: mid-run, every process of the second host (its
    sshd, the rank) is SIGKILLed, as a host's loss takes them. The job ends (no hang: the
    survivor's collective fails) and the failure names the host and its rank."""
    hostfile = str(two_hosts.hostfile())
    _, second = two_hosts.hosts.values()
    marker = two_hosts.tmp / "step2"
    proc = two_hosts.start_in_launcher(
        [HVDKIT, "run", "--hostfile", hostfile, "--stall-timeout", "10", "--", sys.executable,
         str(WORKERS / "hang_worker.py"), "long", str(marker)]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the job did not reach its third step"
        ns = list(two_hosts.hosts)[1]
        for pid in two_hosts._pids(ns):
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    named = [ln for ln in stderr.splitlines() if ln.startswith("hvdkit run:")]
    assert any(second in ln and "rank 1" in ln for ln in named), stderr[-3000:]


@pytest.mark.parametrize("scheduler", ["PBS", "MPIJob"])
def test_a_schedulers_host_file_gives_the_hosts(two_hosts, scheduler):
    """Inside a PBS job (PBS_NODEFILE: one line per slot) or a Kubeflow MPIJob's launcher
    (its hostfile, named by OMPI_MCA_orte_default_hostfile), ``hvdkit run`` with no hosts
    runs one rank on each of the two hosts those files list."""
    addrs = list(two_hosts.hosts.values())
    path = two_hosts.tmp / f"{scheduler}-hosts"
    if scheduler == "PBS":
        path.write_text("".join(f"{addr}\n" for addr in addrs))
        env = [f"PBS_NODEFILE={path}", "PBS_JOBID=4242.pbs"]
        said = f"hosts from the PBS job 4242.pbs allocation (PBS_NODEFILE={path})"
    else:
        path.write_text("".join(f"{addr} slots=1\n" for addr in addrs))
        env = [f"OMPI_MCA_orte_default_hostfile={path}"]
        said = f"hosts from the Kubernetes MPIJob allocation ({path})"
    out = two_hosts.run_in_launcher(
        ["env", *env, HVDKIT, "run", "--gloo", "--network-interface", "hvd0", "--",
         sys.executable, str(WORKERS / "launch_worker.py")]
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"hvdkit run: {said}: {addrs[0]}:1, {addrs[1]}:1" in out.stderr, out.stderr[-2000:]
    r = results(out)
    assert [r[0]["netns"], r[1]["netns"]] == [two_hosts.netns_id(ns) for ns in two_hosts.hosts]
    assert r[0]["sum"] == r[1]["sum"] == 3.0


CANARY = "hvdkit-canary-5e1f"


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_no_environment_value_on_any_command_line_or_log(two_hosts, elastic, capsys):
    """A canary in the launching shell (and one named by --env) reaches both ranks, each on
    its own host over ssh, under Gloo, static and elastic; while they run, `ps` on each host
    (and on the launcher's) never shows it, and neither do --verbose's output, the console or
    the per-rank logs (horovodrun alone puts every value on the ranks' command lines)."""
    hostfile = str(two_hosts.hostfile())
    logs = two_hosts.tmp / f"logs-{'elastic' if elastic else 'static'}"
    argv = [HVDKIT, "run", "--hostfile", hostfile, "--gloo", "--verbose", "--output-dir",
            str(logs), "--network-interface", "hvd0"]  # fmt: skip
    if elastic:
        argv += ["--min-np", "2", "--max-np", "2"]
    # `--env NAME` forwards the shell's value (`--env NAME=VALUE` would put it on hvdkit's own
    # command line, the user's choice).
    argv += ["--env", "HVDKIT_TEST_SECOND", "--", sys.executable,
             str(WORKERS / "launch_worker.py"), "slow"]  # fmt: skip
    job = two_hosts.start_in_launcher(
        argv,
        env={"HVDKIT_TEST_VALUE": CANARY, "HVDKIT_TEST_SECOND": f"{CANARY}-by-flag",
             "HVDKIT_TEST_EXCLUDED": "left out", "HVDKIT_ENV_EXCLUDE": "HVDKIT_TEST_EXCLUDED"},
    )  # fmt: skip
    seen_ranks, samples = 0, 0
    try:
        while job.poll() is None:
            for ns in ["", two_hosts.launcher, *two_hosts.hosts]:
                prefix = ["ip", "netns", "exec", ns] if ns else []
                table = subprocess.run(
                    [*prefix, "ps", "-eww", "-o", "args"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
                samples += 1
                assert CANARY not in table, [line for line in table.splitlines()
                                             if CANARY in line]  # fmt: skip
                ranks = [
                    line
                    for line in table.splitlines()
                    if "launch_worker.py slow" in line and "hvdkit" not in line
                ]
                seen_ranks = max(seen_ranks, len(ranks))
            time.sleep(0.2)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    out = subprocess.CompletedProcess(argv, job.returncode, stdout, stderr)
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    r = results(out)
    assert [r[0]["netns"], r[1]["netns"]] == [two_hosts.netns_id(ns) for ns in two_hosts.hosts]
    digest = {v: hashlib.sha256(v.encode()).hexdigest() for v in (CANARY, f"{CANARY}-by-flag")}
    assert [r[k]["forwarded"] for k in (0, 1)] == [digest[CANARY]] * 2
    assert [r[k]["second"] for k in (0, 1)] == [digest[f"{CANARY}-by-flag"]] * 2
    assert r[0]["sum"] == r[1]["sum"] == 3.0
    assert r[0]["excluded"] is None and r[1]["excluded"] is None  # HVDKIT_ENV_EXCLUDE
    # The two ranks were seen running (their python, started by sshd's shells) while sampled.
    assert seen_ranks >= 2, seen_ranks
    # --verbose printed the rank commands and the names forwarded, never a value.
    assert "hvdkit-env env HOROVOD_HOSTNAME=" in stdout + stderr
    assert " HVDKIT_TEST_VALUE " in stdout + stderr
    logged = [p for p in logs.rglob("*") if p.is_file()]
    assert logged, "no per-rank logs written"
    texts = [stdout, stderr, *(p.read_text(errors="replace") for p in logged)]
    assert not [t for t in texts if CANARY in t], "the canary is in a log"
    with capsys.disabled():
        print(
            f"\n[private env, {'elastic' if elastic else 'static'}] the canary reached both "
            f"ranks over ssh; {samples} ps tables (launcher, both hosts, this machine) and "
            f"{len(logged) + 2} logs without it"
        )
