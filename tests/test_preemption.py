"""Preemption for real (hvdkit.preempt, hvdkit.launch.preemption): a SIGUSR1 or SIGTERM makes
every rank checkpoint at the same step and exit 75, ``hvdkit run`` exits 75, and running the
same command again resumes to the weights of a run that was never interrupted. The real Slurm
version (``--signal``, ``--requeue``) is in tests/test_slurm.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def train(checkpoint: Path, *extra: str, popen: bool = False):
    argv = [HVDKIT, "run", "-np", "2", "--gloo", "--", sys.executable,
            str(WORKERS / "torch_worker.py"), "train", "--epochs", "4",
            "--checkpoint", str(checkpoint), *extra]  # fmt: skip
    if popen:
        return subprocess.Popen(argv, cwd=ROOT, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def finished(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    by_rank = results(out)
    assert by_rank[0]["params"] == by_rank[1]["params"]
    return by_rank[0]


def test_a_signal_on_one_rank_stops_all_at_one_step_and_resume_matches(tmp_path):
    """SIGUSR1 to rank 1 alone after step 5 (of 16, 4 per epoch): both ranks checkpoint after
    step 7 (the flag's allreduce is read one step later), mid-epoch 2; the second run skips
    the 3 batches done and ends bit-identical to an uninterrupted run."""
    reference = finished(train(tmp_path / "ref" / "ckpt.pt"))
    assert reference["steps"] == 16
    stopped = train(tmp_path / "job" / "ckpt.pt", "--signal-at", "5")
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "RESULT" not in stopped.stdout  # no rank went on past the checkpoint
    assert "hvdkit: preempted (SIGUSR1) at epoch 2, batch 3 (step 7): checkpoint " in (
        stopped.stdout
    ), stopped.stdout[-2000:]
    assert "hvdkit run: the job checkpointed and every rank stopped; exit 75" in stopped.stderr
    assert "status code" not in stopped.stdout + stopped.stderr  # horovodrun's, expected here
    resumed = finished(train(tmp_path / "job" / "ckpt.pt"))
    assert resumed["steps"] == 16 and resumed["params"] == reference["params"]
    assert resumed["resumed"] == {"batches": 4}  # the user's extra, without hvdkit's own


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_hvdkit_run_reaches_the_ranks_and_exits_75(tmp_path, sig):
    """As a scheduler signals the launcher (Slurm's --signal=B:USR1@90, its time limit's
    SIGTERM): hvdkit run passes it to the ranks here; they checkpoint and stop."""
    proc = train(tmp_path / "ckpt.pt", "--step-delay", "1.0", popen=True)
    time.sleep(1.0)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ckpt.pt").exists():  # an epoch done: training is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:] + err[-3000:]
    assert f"hvdkit run: {sig}: passed on to the 2 rank(s) here" in err, err[-3000:]
    assert f"hvdkit: preempted ({sig})" in out
    resumed = finished(train(tmp_path / "ckpt.pt"))
    assert resumed["steps"] == 16
