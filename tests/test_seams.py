"""The seam matrix (issue 38): features that each hold alone, run together for real (2 ranks,
``hvdkit run``), and compared with one oracle, tests/seams.py: an uninterrupted one-process run
on the same global batches. Each case checks the weights (to a tolerance: different paths),
the LR in force, and which samples each epoch trained. docs/development.md lists the pairs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import seams
from conftest import ROOT, WORKERS, results
from workers.seams_worker import Indexed, make_model
from workers.tolerance import max_difference, paths_close

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def job(np: int, log: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    argv = [HVDKIT, "run", "-np", str(np), "--gloo", "--", sys.executable,
            str(WORKERS / "seams_worker.py"), "--log", str(log), *args]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def logged(log: Path) -> dict[int, Counter]:
    """Every sample index trained in each epoch, over every rank and run that logged there."""
    trained: dict[int, Counter] = {}
    for path in sorted(log.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            trained.setdefault(entry["epoch"], Counter()).update(entry["indices"])
    return trained


def assert_like_the_oracle(out: subprocess.CompletedProcess, log: Path, oracle: seams.Job):
    ranks = results(out)
    sizes = {r["size"] for r in ranks.values()}
    assert sorted(ranks) == list(range(sizes.pop())), out.stdout[-2000:]
    assert len({json.dumps(r["weights"]) for r in ranks.values()}) == 1  # ranks: bit for bit
    mine = ranks[0]
    expected = seams.run(oracle, Indexed(), make_model())
    assert mine["steps"] == expected["steps"]
    assert paths_close(mine["weights"], expected["weights"], steps=expected["steps"]), (
        max_difference(mine["weights"], expected["weights"])
    )
    assert mine["lr_in_force"] == pytest.approx(expected["lr_in_force"], rel=1e-12)
    if mine["scheduler_lr"] is not None:
        assert mine["scheduler_lr"] == pytest.approx(oracle.lr * 0.5**oracle.epochs, rel=1e-12)
    trained = logged(log)
    assert sorted(trained) == list(range(oracle.epochs))
    for epoch, counts in trained.items():
        assert counts == Counter(expected["trained"][epoch]), epoch
        assert set(counts) == set(range(len(Indexed())))  # every sample, every epoch


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


def test_a_plain_epoch_loop_reshuffles_every_epoch(tmp_path):
    """``for epoch in range(n)`` over ``session.shard(...)`` (what Horovod scripts write):
    each epoch its own order, as under ``session.epochs()``."""
    out = job(2, tmp_path / "log", "--epochs", "3", "--plain-loop")
    assert_like_the_oracle(out, tmp_path / "log", seams.Job(epochs=3))
    first = [json.loads(line)["indices"] for line in (tmp_path / "log" / "rank0.jsonl").open()]
    per_epoch = len(first) // 3
    assert first[:per_epoch] != first[per_epoch : 2 * per_epoch]
