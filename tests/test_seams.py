"""The seam matrix (issue 38): features that each hold alone, run together for real (2 ranks,
``hvdkit run``), and compared with one oracle, tests/seams.py: an uninterrupted one-process run
on the same global batches. Each case checks the weights (to a tolerance: different paths),
the LR in force, and which samples each epoch trained. docs/development.md lists the pairs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import seams
from conftest import ROOT, WORKERS, results
from seams_check import check_like_the_oracle

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def job(
    np: int, log: Path, *args: str, expect: int | None = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    argv = [HVDKIT, "run", "-np", str(np), "--gloo", "--", sys.executable,
            str(WORKERS / "seams_worker.py"), "--log", str(log), *args]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300,
                         stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})  # fmt: skip
    if expect is not None:
        assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def assert_like_the_oracle(
    out: subprocess.CompletedProcess, log: Path | None, oracle: seams.Job, ranks: dict | None = None
) -> None:
    """:func:`seams_check.check_like_the_oracle` on the RESULT lines of ``out`` (or
    ``ranks``)."""
    ranks = ranks if ranks is not None else results(out)
    check_like_the_oracle(ranks, log, oracle, out.stdout[-2000:])


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulation_through_the_session_loop(tmp_path, accumulate):
    """The documented loop (zero_grad, then backward_and_step, per micro-batch) with
    ``backward_passes_per_step``, a scheduler and warmup: one step per N micro-batches on the
    passes' summed gradients; 6 micro-batches an epoch, so N=4 ends each epoch with a step on
    the last 2 (they do not leak into the next epoch)."""
    args = ["--accumulate", str(accumulate), "--scheduler", "--warmup-steps", "2"]
    out = job(2, tmp_path / "log", *args)
    oracle = seams.Job(accumulate=accumulate, scheduler=True, warmup_steps=2)
    assert_like_the_oracle(out, tmp_path / "log", oracle)


@pytest.mark.parametrize(("before", "after", "accumulate"), [(2, 1, 1), (1, 2, 2)])
def test_preempted_then_resumed_on_another_number_of_ranks(tmp_path, before, after, accumulate):
    """Preempted mid-epoch (SIGUSR1 to one rank), resumed with another ``-np``: every sample
    of the interrupted epoch trained exactly once across both runs, the weights, the LR
    (rescaled to the new size) and the scheduler as in one uninterrupted run that changed
    size at that step."""
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "log"
    args = ["--epochs", "3", "--accumulate", str(accumulate), "--scheduler",
            "--warmup-steps", "4", "--checkpoint", str(ckpt)]  # fmt: skip
    stopped = job(before, log, *args, "--preempt-at", "2", "--step-delay", "0.25", expect=75)
    where = re.search(r"hvdkit: preempted \(SIGUSR1\) at epoch \d+, batch \d+ \(step (\d+)\)",
                      stopped.stdout)  # fmt: skip
    assert where, stopped.stdout[-2000:]
    step = int(where.group(1))
    resumed = job(after, log, *args)
    oracle = seams.Job(
        epochs=3, accumulate=accumulate, scheduler=True, warmup_steps=4,
        segments=[seams.Segment(before, step), seams.Segment(after)],
    )  # fmt: skip
    assert_like_the_oracle(resumed, log, oracle)


@pytest.mark.parametrize(
    ("before", "after", "op"),
    [(2, 1, "average"), (2, 2, "sum"), (1, 2, "sum")],
    ids=["average-to-1-rank", "sum-same-size", "sum-to-2-ranks"],
)
def test_every_feature_at_once_across_a_preemption(tmp_path, before, after, op):
    """Accumulation, bf16 autocast with clipping (the norm of the reduced gradient), fp16
    compression, ``op`` (``sum`` with the LR unscaled), a scheduler, warmup, a preemption and
    its resume (at another size, or the same): the pairs the cases above leave out, against
    the same oracle (which rounds each rank's gradient to float16 to travel, as the
    compression does)."""
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "log"
    args = ["--epochs", "3", "--accumulate", "2", "--scheduler", "--warmup-steps", "3",
            "--checkpoint", str(ckpt), "--amp", "--compression", "fp16", "--op", op]  # fmt: skip
    stopped = job(before, log, *args, "--preempt-at", "2", "--step-delay", "0.25", expect=75)
    step = int(re.search(r"hvdkit: preempted .*\(step (\d+)\)", stopped.stdout).group(1))
    resumed = job(after, log, *args)
    oracle = seams.Job(
        epochs=3, accumulate=2, scheduler=True, warmup_steps=3, amp=True, compression="fp16",
        op=op, segments=[seams.Segment(before, step), seams.Segment(after)],
    )  # fmt: skip
    assert_like_the_oracle(resumed, log, oracle)


def killed_at_7(tmp_path: Path, *worker: str) -> tuple[subprocess.CompletedProcess, dict, int, int]:
    """An elastic seams job of 6 epochs (accumulation 2, a scheduler) on 2 ranks, one worker
    killed -9 at step 7 and its host back after the cooldown: the output, the ranks' results,
    and the steps the two resets went back to (to 1 rank, then 2)."""
    from test_elastic import elastic_job, finished

    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2",
        script="seams_worker.py",
        worker=("--elastic", "--kill-at", "7", "--epochs", "6", "--accumulate", "2",
                "--scheduler", "--step-delay", "0.3", "--log", str(tmp_path / "log"), *worker),
    )  # fmt: skip
    assert out.returncode == 0 and killed is not None, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = {r["rank"]: r for r in finished(out)}
    survivor = max(ranks.values(), key=lambda r: len(r["resets"]))
    assert len(survivor["resets"]) == 2, f"no rejoin before the end: {survivor['resets']}"
    (lost_at, lost_size), (joined_at, joined_size) = survivor["resets"]
    assert (lost_size, joined_size) == (1, 2) and lost_at <= 7 <= joined_at, survivor["resets"]
    return out, ranks, lost_at, joined_at


@pytest.mark.parametrize(
    "features",
    [["--warmup-steps", "10"], ["--amp", "--compression", "fp16", "--op", "sum"]],
    ids=["warmup", "amp-fp16-sum"],
)
def test_elastic_kill_with_accumulation_and_a_scheduler(tmp_path, features):
    """An elastic session (kill -9 of one worker at step 7, its host back after the cooldown)
    with accumulation, a scheduler, checkpoints at each epoch end, and a warmup in progress
    across both resets, or AMP with clipping, fp16 compression and ``op="sum"``: the weights
    equal one run that changed size at the steps the resets went back to. (Elastic sessions
    recover instead of stopping on a preemption signal: those two do not meet.)"""
    out, ranks, lost_at, joined_at = killed_at_7(
        tmp_path, "--checkpoint", str(tmp_path / "c.pt"), *features
    )
    oracle = seams.Job(
        epochs=6, accumulate=2, scheduler=True,
        warmup_steps=10 if "--warmup-steps" in features else 0,
        amp="--amp" in features, compression="fp16" if "fp16" in features else "none",
        op="sum" if "sum" in features else "average", elastic=True,
        segments=[seams.Segment(2, lost_at), seams.Segment(1, joined_at), seams.Segment(2)],
    )  # fmt: skip
    assert_like_the_oracle(out, None, oracle, ranks=ranks)
    assert (tmp_path / "c.pt").exists()


def test_a_plain_epoch_loop_reshuffles_every_epoch(tmp_path):
    """``for epoch in range(n)`` over ``session.shard(...)`` (what Horovod scripts write):
    each epoch its own order, as under ``session.epochs()``."""
    out = job(2, tmp_path / "log", "--epochs", "3", "--plain-loop")
    assert_like_the_oracle(out, tmp_path / "log", seams.Job(epochs=3))
    first = [json.loads(line)["indices"] for line in (tmp_path / "log" / "rank0.jsonl").open()]
    per_epoch = len(first) // 3
    assert first[:per_epoch] != first[per_epoch : 2 * per_epoch]


def one_process(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(WORKERS / "checkpoint_worker.py"), *args]
    out = subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=180,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_numpy_extra_values_and_the_grad_scaler_survive_a_resume(tmp_path):
    """``save(best=np.float64(0.5))`` resumes (it was reported corrupt), and the AMP
    GradScaler's halved loss scale comes back instead of starting over."""
    ckpt = str(tmp_path / "ckpt.pt")
    saved = results(one_process("torch", "save", "--checkpoint", ckpt))[0]
    assert saved["scale"] == 512.0  # the planted overflow halved 1024
    resumed = results(one_process("torch", "resume", "--checkpoint", ckpt))[0]
    assert resumed["resumed"] == {"best": 0.5, "count": 3}
    assert resumed["scale_before"] == 1024.0 and resumed["scale"] == 512.0


def test_a_mismatched_torch_model_names_the_keys_and_shapes(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    one_process("torch", "save", "--checkpoint", ckpt)
    out = one_process("torch", "resume", "--checkpoint", ckpt, "--hidden", "5", expect=1)
    assert "does not match this model/optimizer" in out.stderr
    assert "size mismatch for 0.weight" in out.stderr, out.stderr[-2000:]
    assert "torch.Size([3, 4])" in out.stderr and "torch.Size([5, 4])" in out.stderr


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_a_keras_resume_into_changed_layers_names_them(tmp_path, monkeypatch, backend):
    """A checkpoint of [encoder, decoder] resumed into [new_adapter, encoder] (same shapes):
    matched by variable path, refused naming both layers, instead of the new layer silently
    getting the old encoder's weights."""
    monkeypatch.setenv("KERAS_BACKEND", backend)
    ckpt = str(tmp_path / "ckpt.npz")
    one_process("keras", "save", "--checkpoint", ckpt)
    out = one_process("keras", "resume", "--checkpoint", ckpt, expect=1)
    assert "model variables differ" in out.stderr, out.stderr[-2000:]
    assert "new_adapter/kernel" in out.stderr and "decoder/kernel" in out.stderr


def test_save_called_on_rank_0_only_fails_with_the_fix(tmp_path):
    """``if hvd.rank() == 0: session.save()`` (a Horovod habit) waited forever: save() is
    collective. Rank 0 now fails after HVDKIT_SAVE_TIMEOUT, naming the fix, and the job ends."""
    started = time.monotonic()
    out = job(2, tmp_path / "log", "--checkpoint", str(tmp_path / "c.pt"), "--rank0-saves",
              expect=None, env={"HVDKIT_SAVE_TIMEOUT": "3"})  # fmt: skip
    assert out.returncode != 0
    assert "save() is collective" in out.stdout + out.stderr, out.stderr[-3000:]
    assert "Fix: call session.save() on every rank" in out.stdout + out.stderr
    assert time.monotonic() - started < 90
    assert not (tmp_path / "c.pt").exists()  # nothing written
