"""ZeRO (``shard_optimizer``) against tests/seams.py's oracle, inside the ranks of one job:
tests/workers/seams_worker.py's session loop, called on each rank rather than launched as a
job of its own (tests/test_zero.py keeps the cases where the launch is under test:
preemption, resume at another -np, elastic kills). Each case checks that the ranks end bit
for bit alike, and the weights (to the path tolerance: a reduce-scatter sums in another order
than one process), steps, LR and the samples each epoch trained against one plain process on
the same global batches."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import seams
from ranked.conftest import gathered
from seams_check import check_like_the_oracle
from workers import seams_worker
from workers.tolerance import paths_close


@pytest.fixture
def shared(horovod):
    """A directory every rank reads and writes (rank 0's, made outside pytest's tmp_path,
    which a rank's pytest session may clean up while another rank still reads it); removed
    once every rank is done with it."""
    # The same type on every rank: allgather_object names its collective after the type.
    made = tempfile.mkdtemp(prefix="hvdkit-zero-oracle-") if horovod.rank() == 0 else ""
    path = Path(gathered(horovod, made)[0])
    yield path
    gathered(horovod, None)  # every rank has checked
    if made:
        shutil.rmtree(made, ignore_errors=True)


def trained(hvd, shared: Path, monkeypatch, name: str, *args: str) -> tuple[dict, Path]:
    """Every rank's result of the worker's loop with ``args``, by rank, and the ledger's
    directory (``shared / name``, which every rank writes into)."""
    from hvdkit.torch import zero

    monkeypatch.setattr(zero, "BUCKET", zero.BUCKET)  # the worker's --bucket, undone after
    log = shared / name
    result = seams_worker.train(seams_worker.parse(["--log", str(log), *args]))
    return {r["rank"]: r for r in gathered(hvd, result)}, log


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_sharded_optimizers_train_like_one_plain_process(horovod, shared, monkeypatch,
                                                         optimizer):  # fmt: skip
    """Momentum SGD, Adam and AdamW (weight decay), with accumulation over 2 passes, a
    scheduler and LR warmup, sharded over 2 ranks; the 195 parameters in buckets of 40 or
    more elements (3 buckets), each sent as the backward pass fills it."""
    ranks, log = trained(horovod, shared, monkeypatch, "log", "--optimizer", optimizer,
                         "--shard-optimizer", "--accumulate", "2", "--scheduler",
                         "--warmup-steps", "3", "--bucket", "40")  # fmt: skip
    oracle = seams.Job(optimizer=optimizer, accumulate=2, scheduler=True, warmup_steps=3)
    check_like_the_oracle(ranks, log, oracle)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_stage_2_trains_like_one_plain_process(horovod, shared, monkeypatch, optimizer):
    """ZeRO stage 2 (``shard_optimizer="gradients"``: each gradient let go once its buckets
    hold it), with accumulation over 2 passes, a scheduler and LR warmup, against the same
    oracle as stage 1."""
    ranks, log = trained(horovod, shared, monkeypatch, "log", "--optimizer", optimizer,
                         "--shard-optimizer", "gradients", "--accumulate", "2", "--scheduler",
                         "--warmup-steps", "3", "--bucket", "40")  # fmt: skip
    oracle = seams.Job(optimizer=optimizer, accumulate=2, scheduler=True, warmup_steps=3)
    check_like_the_oracle(ranks, log, oracle)


@pytest.mark.parametrize("stage", [[], ["gradients"]], ids=["stage1", "stage2"])
def test_bf16_autocast_with_clipping_over_the_slices(horovod, shared, monkeypatch, stage):
    """The gradient norm is the whole gradient's, summed over the ranks' slices."""
    ranks, log = trained(horovod, shared, monkeypatch, "log", "--optimizer", "adam", "--amp",
                         "--shard-optimizer", *stage)  # fmt: skip
    check_like_the_oracle(ranks, log, seams.Job(optimizer="adam", amp=True))


@pytest.mark.parametrize("stage", [[], ["gradients"]], ids=["stage1", "stage2"])
def test_fp16_with_a_grad_scaler_skips_the_same_steps_as_the_plain_optimizer(
    horovod, shared, monkeypatch, stage
):
    """fp16 autocast with a GradScaler that starts at 2^40: the first steps overflow. The
    overflow check is agreed over the ranks' slices, so every rank skips the same steps as
    the plain (allreduce) optimizer does, the scale ends the same, and the weights too (to
    the path tolerance: the sums run in another order)."""
    args = ("--scaler", "--optimizer", "adam", "--epochs", "3")
    plain, _ = trained(horovod, shared, monkeypatch, "plain", *args)
    sharded, _ = trained(horovod, shared, monkeypatch, "sharded", *args, "--shard-optimizer",
                         *stage)  # fmt: skip
    assert sharded[0]["weights"] == sharded[1]["weights"]
    assert sharded[0]["scale"] == plain[0]["scale"] < 2.0**40  # backed off, the same way
    assert sharded[0]["steps"] == plain[0]["steps"]
    assert paths_close(sharded[0]["weights"], plain[0]["weights"], steps=plain[0]["steps"])
