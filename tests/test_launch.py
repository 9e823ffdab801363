"""hvdkit run with real processes on localhost, under Gloo and MPI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, interruptible, results
from test_private_env_units import bash_as_sh

from hvdkit.launch.horovodrun import launcher_argv
from hvdkit.launch.output import NO_REASON

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")
WORKER = str(WORKERS / "launch_worker.py")


def hvdkit(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [HVDKIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_run_from_the_localhost_hostfile(controller):
    out = hvdkit(
        "run", "-np", "2", "--hostfile", "hostfiles/localhost", f"--{controller}",
        "--env", "HVDKIT_TEST_VALUE=42", "--", sys.executable, WORKER,
        env={"HVDKIT_TEST_EXCLUDED": "x", "HVDKIT_ENV_EXCLUDE": "OTHER,HVDKIT_TEST_EXCLUDED"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    r = results(out)
    assert sorted(r) == [0, 1]
    for rank in (0, 1):
        assert r[rank]["sum"] == 3.0 and r[rank]["size"] == 2
        assert r[rank]["local_rank"] == rank == r[rank]["env_rank"]
        assert r[rank]["forwarded"] == "42"
        assert r[rank]["mpi_yield"] == ("1" if controller == "mpi" else None)
        assert r[rank]["excluded"] is None  # HVDKIT_ENV_EXCLUDE, under either controller


def test_a_failing_rank_fails_the_job_and_is_named():
    out = hvdkit("run", "-np", "2", "--gloo", "--", sys.executable, WORKER, "fail")
    assert out.returncode != 0
    # horovodrun names rank 0 when it exits first ("Horovod has been shut down"); hvdkit
    # names the rank that failed on its own.
    assert "hvdkit run: rank 1 on host localhost failed" in out.stderr
    assert "rank 1 is about to fail on purpose" in out.stderr.split("hvdkit run: rank 1")[1]
    assert "horovod/runner/launch.py" not in out.stderr  # horovodrun's own traceback held back


def test_with_output_dir_the_failing_rank_is_read_from_its_log(tmp_path):
    out = hvdkit("run", "-np", "2", "--gloo", "--output-dir", str(tmp_path), "--", sys.executable,
                 WORKER, "fail")  # fmt: skip
    assert out.returncode != 0
    assert "hvdkit run: rank 1 on host localhost failed" in out.stderr
    assert "rank 1 is about to fail on purpose" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.0", "rank.1"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is as good as gone
        return fh.read().split(")")[-1].split()[0] != "Z"


def read_pids(proc: subprocess.Popen, count: int, timeout: float = 120) -> list[int]:
    """The PIDs the launch worker's ranks print in ``sleep`` mode."""
    pids = []
    deadline = time.time() + timeout
    while len(pids) < count and time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        if "PID " in line:
            pids.append(json.loads(line.split("PID ", 1)[1])["pid"])
    assert len(pids) == count, proc.stderr.read() if proc.poll() is not None else "no PIDs"
    return pids


def wait_gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.5)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_stop_every_rank(sig):
    """Ctrl-C, and SIGTERM (a CI or batch-system timeout): without the latter, hvdkit ended
    alone and left horovodrun and the ranks running in their own session."""
    proc = subprocess.Popen(
        [HVDKIT, "run", "-np", "2", "--gloo", "--", sys.executable, WORKER, "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=interruptible,
    )  # fmt: skip
    pids = read_pids(proc, 2)
    proc.send_signal(getattr(signal, sig))  # SIGINT: what the terminal sends on Ctrl-C
    try:
        # communicate, not wait: the test must keep reading, or a full pipe would stop hvdkit.
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # hvdkit prints its threads' stacks (faulthandler)
        time.sleep(2)
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"hvdkit run did not stop within 60 s of {sig}:\n" + err[-6000:])
    assert proc.returncode == 130, err[-3000:]
    assert wait_gone(pids), pids


def test_guard_stops_the_rank_when_its_session_goes_away():
    # The remote shape: sshd runs `sh -c 'cd DIR ; guard -- CMD'`, and that shell outlives
    # sshd, so the guard's parent never changes; closing the output pipe is what sshd's exit does.
    proc = subprocess.Popen(
        ["sh", "-c", f"cd {ROOT} ; {sys.executable} -m hvdkit.launch.guard -- {sys.executable} "
         f"{WORKER} sleep ; true"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    pids = read_pids(proc, 1)
    assert not wait_gone(pids, timeout=2)  # still running while someone reads its output
    proc.stdout.close()
    assert wait_gone(pids), pids
    assert proc.wait(30) == 0


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_ranks_started_by_mpirun_directly_work_with_the_adapters():
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "-np", "2", sys.executable, WORKER],
        capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    r = results(out)
    assert [r[k]["env_rank"] for k in (0, 1)] == [0, 1] and r[0]["sum"] == 3.0


def test_dry_run_and_bad_input_start_nothing():
    out = hvdkit("run", "--hostfile", "hostfiles/localhost", "--gloo", "--dry-run", "--json",
                 "--", "python", "train.py")  # fmt: skip
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["np"] == 2 and plan["argv"][1:6] == ["-np", "2", "-H", "localhost:2", "--gloo"]
    too_many = hvdkit("run", "-np", "3", "--hostfile", "hostfiles/localhost", "--", "x")
    assert too_many.returncode == 2
    assert "-np 3 is more than the 2 slots listed (localhost:2)" in too_many.stderr
    missing = hvdkit("run", "--hostfile", "no/such/file", "--", "x")
    assert missing.returncode == 2 and "no/such/file: cannot read the hostfile" in missing.stderr


def test_an_allocation_host_that_cannot_be_reached_is_named_at_once():
    """A Slurm allocation (its variables) listing a host that does not resolve: horovodrun's
    ssh check fails; hvdkit names the host, ssh's reason and the fix, without a traceback."""
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "hvdkit-nohost,localhost",
           "SLURM_TASKS_PER_NODE": "1(x2)"}  # fmt: skip
    out = subprocess.run([HVDKIT, "run", "--gloo", "--", sys.executable, "-c", "print(1)"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode != 0
    # ssh's own reason; on a loaded machine ssh may print none before the check gives up.
    reasons = ("ssh: Could not resolve hostname hvdkit-nohost", NO_REASON)
    assert any(f"hvdkit run: no rank started: cannot reach hvdkit-nohost ({why}" in out.stderr
               for why in reasons), out.stderr[-2000:]  # fmt: skip
    assert "Traceback" not in out.stderr


def test_gloo_ranks_on_this_machine_get_the_environment_off_their_command_lines():
    """The local half of tests/test_launch_ssh.py's canary test: a variable of the launching
    shell is in each rank's environment and on no command line while the ranks run."""
    canary = "hvdkit-local-canary-93b1"
    proc = subprocess.Popen(
        [HVDKIT, "run", "-np", "2", "--gloo", "--", sys.executable, WORKER, "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=interruptible, env={**os.environ, "HVDKIT_TEST_VALUE": canary},
    )  # fmt: skip
    try:
        pids = read_pids(proc, 2)
        table = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True,
                               timeout=30).stdout  # fmt: skip
        assert "launch_worker.py sleep" in table and canary not in table
        for pid in pids:  # the value is in the rank's environment, where only its user reads it
            assert (
                f"HVDKIT_TEST_VALUE={canary}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
            )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert wait_gone(pids)


def test_where_sh_is_bash_an_exported_read_only_variable_does_not_stop_the_ranks(tmp_path):
    """Issue 49, item 13: where /bin/sh is bash (RHEL, Rocky, SUSE), a user's exported
    SHELLOPTS or BASHOPTS (UID and EUID on another host), read-only in bash, stopped every Gloo
    rank's shell (`SHELLOPTS: readonly variable`). Each rank's shell here is bash as sh."""
    bin_dir = bash_as_sh(tmp_path)
    out = hvdkit(
        "run", "-np", "2", "--gloo", "--", sys.executable, WORKER,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "UID": str(os.getuid()),
             "SHELLOPTS": "braceexpand:hashall:interactive-comments", "BASHOPTS": "cmdhist",
             "HVDKIT_TEST_VALUE": "under bash"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    r = results(out)
    assert sorted(r) == [0, 1] and r[0]["forwarded"] == r[1]["forwarded"] == "under bash"
    assert "readonly variable" not in out.stderr


FAKE_SSH = """#!/bin/sh
# ssh [-o OPT]... [-p PORT] [-i FILE] HOST COMMAND: runs COMMAND on this machine, in a fresh
# environment as sshd gives it, with its stdin {stdin}.
host=
while [ $# -gt 0 ]; do  # options may follow HOST, as horovodrun gives them
    case $1 in
        -o|-p|-i) shift 2 ;;
        -*) shift ;;
        *) [ -z "$host" ] || break; host=$1; shift ;;
    esac
done
exec env -i PATH="$PATH" HOME="$HOME" sh -c "$*" {redirect}
"""


@pytest.mark.parametrize("drops_stdin", [True, False])
def test_a_transport_that_drops_stdin_starts_no_rank_without_its_environment(tmp_path, drops_stdin):
    """Issue 49, item 14: a rank on another host reached through a transport that drops
    stdin (Kubeflow's kubexec.sh: kubectl exec without -i; ssh -n) ran without the forwarded
    environment. 127.0.0.2 is another host to horovodrun; an `ssh` on PATH starts its rank
    here, in a fresh environment, so the variables reach it on its stdin or not at all."""
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH.format(
        stdin="dropped (ssh -n)" if drops_stdin else "passed on",
        redirect="</dev/null" if drops_stdin else "",
    ))  # fmt: skip
    ssh.chmod(0o755)
    out = hvdkit(
        "run", "-H", "127.0.0.2:1", "--gloo", "--network-interface", "lo", "--",
        sys.executable, WORKER, timeout=180,
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "HVDKIT_TEST_VALUE": "over the wire"},
    )  # fmt: skip
    if drops_stdin:
        assert out.returncode != 0 and "RESULT" not in out.stdout, out.stdout[-2000:]
        assert "hvdkit run: rank 0 on host 127.0.0.2 failed" in out.stderr, out.stderr[-3000:]
        assert "hvdkit: rank not started: its environment did not arrive on its stdin" in out.stderr
    else:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert results(out)[0]["forwarded"] == "over the wire"


def test_a_value_that_is_not_utf8_reaches_each_rank_as_its_bytes():
    """Issue 49, item 15: a variable whose value is not UTF-8 (a Latin-1 path, say) failed
    every Gloo rank's start with UnicodeEncodeError."""
    value = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python holds such a value
    out = hvdkit("run", "-np", "1", "--gloo", "--", sys.executable, WORKER,
                 env={"HVDKIT_TEST_VALUE": value})  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert results(out)[0]["forwarded"] == value


def _processes_with(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and proc.name.isdigit() and int(proc.name) != os.getpid():
            found.append(cmdline)
    return found


def test_a_timeout_that_kills_the_launcher_leaves_no_mpirun_behind():
    """The doctor's and the bench's launches (and a caller's timeout) kill the launcher
    process only. Under MPI, horovodrun replaced itself with mpirun; hvdkit's wrapper runs
    mpirun as its child, which must die with it and take its ranks along."""
    marker = f"hvdkit-orphan-check-{os.getpid()}"
    argv = launcher_argv(["horovodrun", "-np", "2", "-H", "localhost:2", "--mpi", sys.executable,
                          "-c", "import time, sys; time.sleep(120)", marker])  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(argv, capture_output=True, timeout=8, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_with(marker)
    assert not left, left
