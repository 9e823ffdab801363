"""Elastic jobs with real processes: ``hvdkit run --hostfile --min-np`` on two "hosts" of this
machine (``localhost`` and ``127.0.0.1``, as Horovod's own elastic tests do), a worker
SIGKILLed mid-epoch (tests/workers/elastic_worker.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

HVDKIT = str(Path(sys.executable).parent / "hvdkit")
COMMIT = 5


def elastic_job(
    tmp_path: Path,
    *flags: str,
    worker: tuple[str, ...] = (),
    script: str = "elastic_worker.py",
    env: dict[str, str] | None = None,
    timeout: float = 180,
    hosts: str = "localhost:1\n127.0.0.1:1\n",
):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    marker = tmp_path / "killed"
    argv = [HVDKIT, "run", "--hostfile", str(hostfile), *flags, "--", sys.executable,
            str(WORKERS / script), "--marker", str(marker), "--commit", str(COMMIT),
            *worker]  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})  # fmt: skip
    killed = json.loads(marker.read_text()) if marker.exists() else None
    return out, killed, time.monotonic() - started


def finished(out: subprocess.CompletedProcess) -> list[dict]:
    decoder = json.JSONDecoder()
    return [
        decoder.raw_decode(line, line.index("RESULT ") + 7)[0]
        for line in out.stdout.splitlines()
        if "RESULT " in line
    ]


def after_kill(out, killed, steps: str | int = "steps", commit: int = COMMIT):
    """What every kill test checks: exit 0; the kill came at step 17; both ranks end at size
    2 with identical weights; the survivor saw sizes 2, 1, 2 and the rejoined worker 2; the
    survivor replayed at most one commit interval. ``steps``: the final step count, or the
    RESULT key holding it. Returns (survivor, rejoined, replayed steps)."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert killed is not None and killed["step"] == 17, out.stderr[-3000:]
    ranks = finished(out)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["size"] == 2 for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"]
    survivor = max(ranks, key=lambda r: r["executed"])  # ran from the start
    rejoined = next(r for r in ranks if r is not survivor)
    assert survivor["sizes"] == [2, 1, 2] and rejoined["sizes"] == [2], ranks
    replayed = survivor["executed"] - (survivor[steps] if isinstance(steps, str) else steps)
    assert 0 <= replayed <= commit, replayed
    return survivor, rejoined, replayed


def test_killed_worker_costs_one_commit_interval_and_its_host_rejoins(tmp_path):
    """kill -9 at step 17 (commit every 5): the survivor restores step 15 and goes on alone;
    after the cooldown the host is listed again, a new worker joins and syncs, the job ends at
    size 2 with both ranks' weights identical, and exits 0."""
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2",
        worker=("--steps", "80", "--kill-at", "17"),
    )  # fmt: skip
    survivor, rejoined, replayed = after_kill(out, killed, steps=80)
    assert survivor["lr"] == rejoined["lr"] == pytest.approx(0.05 * 0.9**8)  # scheduler synced
    recovery = survivor["recovered"][0] - killed["time"]
    print(f"elastic recovery: {recovery:.2f} s from the kill to the first step after restore, "
          f"{replayed} step(s) replayed")  # fmt: skip
    assert "host 127.0.0.1 failed (rank" in out.stderr and "SIGKILL" in out.stderr


@pytest.mark.parametrize("mode", ["state", "session"])
@pytest.mark.parametrize("keras_backend", ["tensorflow", "torch", "jax"])
def test_keras_killed_worker_costs_one_commit_interval_and_its_host_rejoins(
    tmp_path, keras_backend, mode
):
    """The same kill on every Keras backend, in Horovod's Keras shape (``fit`` inside
    ``hvd.elastic.run``, the three state callbacks, LR rescaled by a reset callback) and as a
    six-step session (``setup(..., elastic=True)`` and ``session.fit``: hvdkit rescales).
    On JAX each reset restarts the worker processes in place (hvdkit.elastic_restart); the
    session, which cannot resume inside ``fit``, is refused there with the fix."""
    if keras_backend == "jax" and mode == "session":
        out, _, _ = elastic_job(
            tmp_path, "--min-np", "2", "--max-np", "2", script="keras_elastic_worker.py",
            worker=("--session",), env={"KERAS_BACKEND": "jax"}, timeout=120,
        )  # fmt: skip
        assert out.returncode != 0 and "RESULT" not in out.stdout
        assert "elastic=True: the elastic session is not available on KERAS_BACKEND=jax" in (
            out.stdout + out.stderr
        )
        return
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2",
        script="keras_elastic_worker.py",
        worker=("--kill-at", "17", *(["--session"] if mode == "session" else [])),
        env={"KERAS_BACKEND": keras_backend, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    survivor, rejoined, replayed = after_kill(out, killed)
    assert survivor["steps"] == rejoined["steps"] and survivor["epoch"] == rejoined["epoch"] == 3
    assert survivor["lr"] == rejoined["lr"] == pytest.approx(0.02 * 2)  # rescaled, then synced
    # 32 batches an epoch at 2 ranks, 64 at 1: the epoch cut short after the restore ran only
    # what it had left, so the job took fewer steps than three full epochs at size 1.
    assert survivor["steps"] < 3 * 64
    if mode == "session":
        assert "hvdkit elastic: a worker was lost; 1 process(es) after" in out.stdout
        assert "LR x1" in out.stdout and "LR x2" in out.stdout
    if keras_backend == "jax":  # the survivor's process restarted at each reset
        assert "hvdkit elastic: restarted at 1 process(es)" in out.stdout
        assert "hvdkit elastic: restarted at 2 process(es)" in out.stdout
    recovery = survivor["recovered"][0] - killed["time"]
    print(f"keras ({keras_backend}, {mode}) elastic recovery: {recovery:.2f} s, {replayed} "
          "step(s) replayed")  # fmt: skip


def test_session_elastic_true_survives_a_kill_with_the_plain_session_loop(tmp_path):
    """``hvdkit.torch.setup(..., elastic=True)`` with the unchanged session loop
    (``session.epochs``, ``session.shard``, ``backward_and_step``): kill -9 mid-epoch, the
    survivor goes back to the last commit, the LR multiplier follows the size (x1 alone, x2
    again after the rejoin), the data is re-split (the last epoch covers every sample once
    between the two ranks), and the ranks end identical."""
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2",
        script="session_elastic_worker.py", worker=("--kill-at", "17"),
    )  # fmt: skip
    survivor, rejoined, replayed = after_kill(out, killed)
    ranks = [survivor, rejoined]
    assert survivor["steps"] == rejoined["steps"]
    assert all(r["epoch"] == 4 and r["multiplier"] == 2.0 for r in ranks)
    # The scheduler still drives the optimizer after the restore: 4 epochs of gamma 0.5.
    assert all(r["lr_in_force"] == r["scheduler_lr"] == 0.02 * 0.5**4 for r in ranks), ranks
    assert "a worker was lost; 1 process(es) after" in out.stdout
    assert "LR x1" in out.stdout and "workers were added; 2 process(es)" in out.stdout
    if all(r["last_epoch_sizes"] == [2] for r in ranks):  # the rejoin came before it began
        indices = sorted(i for part in survivor["last_epoch_indices"] for i in part)
        assert indices == list(range(512))
    recovery = survivor["recovered"][0] - killed["time"]
    print(f"session elastic recovery: {recovery:.2f} s, {replayed} step(s) replayed")


def test_stopped_worker_is_counted_failed_within_a_bounded_time(tmp_path):
    """SIGSTOP leaves the worker alive, so Horovod's driver alone would wait for it for ever:
    the survivor's collective times out (HOROVOD_GLOO_TIMEOUT_SECONDS), and --stall-timeout s
    after it registers again the stopped worker is counted failed, killed, and the job ends at
    size 1 from the last commit."""
    gloo, stall = 10, 10
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--stall-timeout", str(stall),
        worker=("--steps", "40", "--kill-at", "12", "--signal", "SIGSTOP"),
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(gloo)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert killed is not None
    (survivor,) = finished(out)
    assert survivor["sizes"] == [2, 1] and survivor["step"] == 40
    assert 0 <= survivor["executed"] - 40 <= COMMIT
    detected = survivor["recovered"][0] - killed["time"]
    print(f"stopped worker: job went on after {detected:.1f} s ({gloo} s Gloo timeout + {stall} s)")
    assert detected < gloo + stall + 20, detected
    assert re.search(
        r"host 127\.0\.0\.1 failed \(rank \d stopped answering: not back 10 s after the "
        r"others \(--stall-timeout\)\)",
        out.stderr,
    ), out.stderr[-3000:]


def test_survivors_below_min_np_fail_naming_the_lost_host(tmp_path):
    out, killed, elapsed = elastic_job(
        tmp_path, "--min-np", "2", "--elastic-timeout", "5", worker=("--kill-at", "10")
    )
    assert killed is not None and out.returncode != 0
    assert (
        "hvdkit run: elastic job stopped: 1 slot(s) left, below --min-np 2, for 5 s "
        "(--elastic-timeout). Hosts lost: 127.0.0.1 (rank" in out.stderr
    ), out.stderr[-3000:]
    assert "localhost (" not in out.stderr.split("Hosts lost:")[1]  # stopped by the driver
    assert "on host ?" not in out.stderr  # no guessed rank
    assert elapsed < 90


def test_one_host_elastic_job_starts_at_once_on_the_loopback_interface(tmp_path):
    """Every host this machine and no --network-interface: Horovod's driver would wait out
    --elastic-timeout (600 s) for a second host to compare interfaces; hvdkit gives it lo."""
    out, killed, elapsed = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", worker=("--steps", "20"), hosts="localhost:2\n"
    )
    assert out.returncode == 0 and killed is None, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every host is this machine: --network-interface lo" in out.stderr
    ranks = finished(out)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and ranks[0]["digest"] == ranks[1]["digest"]
    assert elapsed < 120


def test_an_elastic_job_waiting_for_a_second_host_says_why(tmp_path):
    """One other host and no --network-interface: a warning at once, and when the wait ends the
    reason (not "a worker failed") with the fix."""
    out, killed, elapsed = elastic_job(
        tmp_path, "--min-np", "1", "--elastic-timeout", "5", hosts="hvdkit-nohost:2\n"
    )
    assert out.returncode != 0 and killed is None
    err = out.stderr
    assert "hvdkit run: warning: one host so far (hvdkit-nohost) and no --network-interface" in err
    assert "hvdkit run: elastic job stopped: no start within 5 s (--elastic-timeout): Horovod's " \
        "elastic driver waits for 2 hosts to compare their network interfaces" in err, err[-3000:]
    assert "a worker failed" not in err and "Fix: --network-interface IFACE" in err
    assert elapsed < 90


def test_reset_limit_exceeded_fails_naming_the_limit_and_host(tmp_path):
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--reset-limit", "1", "--blacklist-cooldown-range", "1", "2",
        worker=("--steps", "80", "--kill-at", "10"),
    )  # fmt: skip
    assert killed is not None and out.returncode != 0
    assert "hvdkit run: elastic job stopped: --reset-limit 1 exceeded" in out.stderr
    assert "Hosts lost: 127.0.0.1 (rank" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("example", ["pytorch_elastic.py", "keras_elastic.py --backend torch"])
def test_elastic_example_trains_on_two_hosts(tmp_path, example):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:1\n127.0.0.1:1\n")
    script, *options = example.split()
    out = subprocess.run(
        [HVDKIT, "run", "--hostfile", str(hostfile), "--min-np", "1", "--max-np", "2", "--",
         sys.executable, str(ROOT / "examples" / script), "--epochs", "2", *options],
        capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hvdkit elastic: 2 process(es) on" in out.stderr
    assert "weights identical on all 2 ranks" in out.stdout
    assert float(re.search(r"test accuracy: ([\d.]+)", out.stdout).group(1)) > 0.9
