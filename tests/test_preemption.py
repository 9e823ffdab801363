"""Preemption for real (hvdkit.preempt, hvdkit.launch.preemption): a SIGUSR1 or SIGTERM makes
every rank checkpoint at the same step and exit 75, ``hvdkit run`` exits 75, and running the
same command again resumes to the weights of a run that was never interrupted. The real Slurm
version (``--signal``, ``--requeue``) is in tests/test_slurm.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def train(checkpoint: Path, *extra: str, popen: bool = False, run_options=(), env=None):
    argv = [HVDKIT, "run", "-np", "2", "--gloo", *run_options, "--", sys.executable,
            str(WORKERS / "torch_worker.py"), "train", "--epochs", "4",
            "--checkpoint", str(checkpoint), *extra]  # fmt: skip
    if popen:
        return subprocess.Popen(argv, cwd=ROOT, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300,
                          stdin=subprocess.DEVNULL, env=env)  # fmt: skip


def slurm_requeue_that_kills(bin_dir: Path) -> dict:
    """An ``scontrol`` that does what Slurm does on ``scontrol requeue`` of a running batch job
    (it ends the batch script, hvdkit run here, with SIGTERM), before it returns; the
    environment of a Slurm job that runs it."""
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/asked"\n'
                        'kill -TERM "$PPID"\nsleep 1\n')  # fmt: skip
    scontrol.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def finished(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    by_rank = results(out)
    assert by_rank[0]["params"] == by_rank[1]["params"]
    return by_rank[0]


def test_a_signal_on_one_rank_stops_all_at_one_step_and_resume_matches(tmp_path):
    """SIGUSR1 to rank 1 alone after step 5 (of 16, 4 per epoch; 0.2 s a step): both ranks
    checkpoint at the same later step, mid-training, and ``--requeue`` requeues the Slurm job;
    the second run skips the batches done in that epoch and ends bit-identical to an
    uninterrupted run."""
    reference = finished(train(tmp_path / "ref" / "ckpt.pt"))
    assert reference["steps"] == 16
    env = slurm_requeue_that_kills(tmp_path / "bin")
    stopped = train(tmp_path / "job" / "ckpt.pt", "--signal-at", "5", "--step-delay", "0.2",
                    run_options=["--requeue"], env=env)  # fmt: skip
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    # Slurm's SIGTERM that the requeue brings does not cut the line that says so.
    assert (tmp_path / "bin" / "asked").read_text() == "requeue 4242\n"
    assert "hvdkit run: requeued Slurm job 4242 (`scontrol requeue 4242`)" in stopped.stderr
    assert "RESULT" not in stopped.stdout  # no rank went on past the checkpoint
    where = re.search(r"hvdkit: preempted \(SIGUSR1\) at epoch \d, batch \d \(step (\d+)\): "
                      r"checkpoint ", stopped.stdout)  # fmt: skip
    assert where and 5 < int(where.group(1)) < 16, stopped.stdout[-2000:]
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


@pytest.mark.parametrize("keras_backend", ["torch", "jax"])
def test_keras_checkpoints_after_the_signal_and_the_next_run_repeats_that_epoch(
    tmp_path, keras_backend
):
    """hvdkit.keras.setup's checkpoint callback: rank 1 alone signalled after step 5 (4 steps
    an epoch, 0.2 s each); both ranks checkpoint at the same later step and exit 75; the next
    run starts that epoch again (Keras's fit cannot start mid-epoch) and ends with equal
    weights on both ranks."""
    argv = [HVDKIT, "run", "-np", "2", "--gloo", "--", sys.executable,
            str(WORKERS / "keras_worker.py"), "resume", str(tmp_path), "3"]  # fmt: skip
    env = {**os.environ, "KERAS_BACKEND": keras_backend}
    stopped = subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300,
                             env={**env, "HVDKIT_TEST_SIGNAL_AT": "5",
                                  "HVDKIT_TEST_STEP_DELAY": "0.2"})  # fmt: skip
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    where = re.search(r"hvdkit: preempted \(SIGUSR1\) at epoch (\d), batch \d \(step (\d+)\)",
                      stopped.stdout)  # fmt: skip
    assert where and 5 < int(where.group(2)) < 12, stopped.stdout[-2000:]
    epoch = int(where.group(1)) - 1  # the epoch it stopped in, from 0
    assert "RESULT" not in stopped.stdout
    resumed = subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    by_rank = results(resumed)
    assert by_rank[0]["ran"] == by_rank[1]["ran"] == list(range(epoch, 3))  # from its start
    # ...from the state of the step it stopped at (on JAX, the trainer's live state)
    assert by_rank[0]["steps_at"][0] == by_rank[1]["steps_at"][0] == int(where.group(2))
    assert by_rank[0]["digest"] == by_rank[1]["digest"]
