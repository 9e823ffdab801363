"""ZeRO stage 1 (``hvdkit.torch.setup(..., shard_optimizer=True)``, hvdkit/torch/zero.py) with
real processes, against tests/seams.py's oracle: one plain process on the same global batches.
Each case checks that the ranks end bit-identical and that the weights, steps and LR equal the
oracle's (to the path tolerance: a reduce-scatter sums in another order than one process).
Here the cases that launch jobs of their own (a preemption and a resume at another -np, an
elastic kill, Horovod's and Keras's scripts, bf16 on the wire); the optimizers, stage 2 and
mixed precision against the oracle run inside the ranks of one job
(tests/ranked/test_zero_oracle.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import seams
import torch
from conftest import ROOT, WORKERS, results
from test_seams import assert_like_the_oracle, job, killed_at_7
from workers.bf16_worker import targets

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


@pytest.mark.parametrize(("before", "after"), [((2, True), (1, False)), ((1, False), (2, True))])
def test_a_checkpoint_moves_between_sharded_and_plain_runs_at_another_np(
    tmp_path, before, after
):
    """Preempted sharded at -np 2, resumed plain at -np 1, and the other way round: Adam's
    state goes through rank 0's one file (the gathered, plain layout) both ways, and the
    weights end as one uninterrupted run that changed size at that step."""
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "log"
    common = ["--optimizer", "adam", "--epochs", "3", "--checkpoint", str(ckpt)]

    def flags(sharded: bool) -> list[str]:
        return common + (["--shard-optimizer"] if sharded else [])

    stopped = job(before[0], log, *flags(before[1]), "--preempt-at", "2", "--step-delay", "0.25",
                  expect=75)  # fmt: skip
    where = re.search(r"hvdkit: preempted \(SIGUSR1\) at epoch \d+, batch \d+ \(step (\d+)\)",
                      stopped.stdout)  # fmt: skip
    assert where, stopped.stdout[-2000:]
    saved = torch.load(ckpt, weights_only=True)["optimizer"]
    assert sorted(saved["state"]) == [0, 1, 2, 3]  # per parameter, as a plain Adam keys it
    assert saved["state"][0]["exp_avg"].shape == (16, 8)
    resumed = job(after[0], log, *flags(after[1]))
    oracle = seams.Job(
        optimizer="adam", epochs=3,
        segments=[seams.Segment(before[0], int(where.group(1))), seams.Segment(after[0])],
    )  # fmt: skip
    assert_like_the_oracle(resumed, log, oracle)


@pytest.mark.parametrize("shard", [None, [], ["gradients"]], ids=["plain", "stage1", "stage2"])
def test_bf16_gradients_match_the_oracle_that_rounds_them(tmp_path, shard):
    """compression="bf16": each rank's gradient rounded to bf16, summed in float32, the mean
    rounded once; the oracle does exactly that in one process, with accumulation and a
    scheduler. Also through ZeRO's reduce-scatter, stage 1 and stage 2 (whose buckets are
    filled from the gradients as autograd finishes them)."""
    args = ["--compression", "bf16", "--accumulate", "2", "--scheduler", "--optimizer", "adam"]
    if shard is not None:
        args += ["--shard-optimizer", *shard]
    out = job(2, tmp_path / "log", *args)
    oracle = seams.Job(compression="bf16", accumulate=2, scheduler=True, optimizer="adam")
    assert_like_the_oracle(out, tmp_path / "log", oracle)


def bf16_run(mode: str, controller: str = "--gloo", backend: str = "tensorflow") -> dict:
    out = subprocess.run(
        [HVDKIT, "run", "-np", "2", controller, "--", sys.executable,
         str(WORKERS / "bf16_worker.py"), mode],
        cwd=ROOT, text=True, capture_output=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = results(out)
    assert ranks[0] == {**ranks[1], "rank": 0}  # the ranks end identical
    return ranks[0]


def assert_reduced_in_bf16(got: list[float], which: int, dtype: torch.dtype) -> None:
    """``got`` is minus (the two ranks' gradients rounded to bf16, averaged in float32,
    rounded once), to the bit, and differs from the plain average."""
    sent = [torch.from_numpy(targets(r)[which]).to(dtype) for r in (0, 1)]
    wire = [s.bfloat16().float() for s in sent]
    expected = -((wire[0] + wire[1]) / 2).bfloat16().to(dtype)
    got_t = torch.tensor(got, dtype=dtype)
    assert torch.equal(got_t, expected), (got_t - expected).abs().max()
    assert not torch.equal(got_t, -(sent[0] + sent[1]) / 2)  # it did travel as bf16


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_horovods_torch_loop_with_compression_bf16_on_gloo_and_mpi(controller):
    """``hvd.DistributedOptimizer(..., compression=hvd.Compression.bf16)``: each parameter
    reduced in bf16 and back in its own dtype (float32, float64), a parameter without a
    gradient left at zero, whichever controller carries it."""
    r = bf16_run("torch", controller)
    assert_reduced_in_bf16(r["weight"], 0, torch.float32)
    assert_reduced_in_bf16(r["bias"], 1, torch.float64)
    assert r["unused"] == [0.0, 0.0] and r["dtypes"] == ["torch.float32", "torch.float64"]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_distributed_optimizer_with_compression_bf16(backend):
    assert_reduced_in_bf16(bf16_run("keras", backend=backend)["weight"], 0, torch.float32)


def test_a_tensorflow_tape_with_compression_bf16_inside_tf_function():
    assert_reduced_in_bf16(bf16_run("tape")["weight"], 0, torch.float32)


@pytest.mark.parametrize("sharded", [False, True, "gradients"],
                         ids=["plain", "sharded", "stage2"])  # fmt: skip
def test_an_elastic_kill_re_cuts_the_slices_for_each_world(tmp_path, sharded):
    """Sharded Adam in an elastic session (kill -9 of one worker at step 7, its host back
    after the cooldown) with accumulation, a scheduler and warmup: each commit gathers the
    whole state, each reset re-cuts it for the new world (2 ranks, then 1, then 2 again, the
    joiner getting rank 0's), and the weights equal one plain run that changed size at the
    steps the resets went back to."""
    out, ranks, lost_at, joined_at = killed_at_7(
        tmp_path, "--warmup-steps", "10", "--optimizer", "adam", "--bucket", "40",
        *(["--shard-optimizer"] if sharded else []),
        *(["gradients"] if sharded == "gradients" else []),
    )
    oracle = seams.Job(
        epochs=6, accumulate=2, scheduler=True, warmup_steps=10, optimizer="adam", elastic=True,
        segments=[seams.Segment(2, lost_at), seams.Segment(1, joined_at), seams.Segment(2)],
    )  # fmt: skip
    assert_like_the_oracle(out, None, oracle, ranks=ranks)
