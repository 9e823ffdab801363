"""Pure pieces of the six steps: LR scaling and warmup, atomic checkpoint writes, rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hvdkit import rank_zero
from hvdkit.checkpoint import atomic_write
from hvdkit.core import SetupConfig
from hvdkit.lr import Warmup, scale_factor, warmup_steps


def test_scale_factor_policies():
    assert scale_factor("size", 8, 4) == 8.0
    assert scale_factor("local_size", 8, 4) == 4.0
    assert scale_factor("none", 8, 4) == 1.0
    with pytest.raises(ValueError, match="lr_scaling='linear'"):
        scale_factor("linear", 8, 4)


def test_warmup_ramps_linearly_to_the_factor():
    w = Warmup(factor=4.0, steps=100)
    assert w.multiplier(0) == 1.0
    assert w.multiplier(50) == 2.5
    assert w.multiplier(99) == pytest.approx(3.97)
    assert w.multiplier(100) == w.multiplier(10_000) == 4.0
    assert Warmup(factor=4.0).multiplier(0) == 4.0


def test_warmup_length_from_epochs_or_steps():
    assert warmup_steps(epochs=5, steps_per_epoch=100) == 500
    assert warmup_steps(epochs=0.5, steps_per_epoch=3) == 2
    assert warmup_steps(steps=7) == 7
    with pytest.raises(ValueError, match="not both"):
        warmup_steps(epochs=1, steps=1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        warmup_steps(epochs=1)


def test_setup_config_validates_early():
    with pytest.raises(ValueError, match="op='max'"):
        SetupConfig(op="max")
    with pytest.raises(ValueError, match="compression='int8'"):
        SetupConfig(compression="int8")
    assert SetupConfig(compression="bf16").compression == "bf16"  # issue 41
    with pytest.raises(ValueError, match="steps_per_epoch"):
        SetupConfig(warmup_epochs=5)


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "sub" / "ckpt.bin"
    atomic_write(path, lambda fh: fh.write(b"first"))
    atomic_write(path, lambda fh: fh.write(b"second"))
    assert path.read_bytes() == b"second"
    assert os.listdir(path.parent) == ["ckpt.bin"]


def test_atomic_write_error_keeps_previous(tmp_path):
    path = tmp_path / "ckpt.bin"
    atomic_write(path, lambda fh: fh.write(b"good"))

    def failing(fh):
        fh.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, failing)
    assert path.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["ckpt.bin"]


WRITER = """
import sys, time
from hvdkit.checkpoint import atomic_write
def slow(fh):
    fh.write(b"x" * 1_000_000)
    fh.flush()
    print("writing", flush=True)
    time.sleep(60)
atomic_write(sys.argv[1], slow)
"""


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.bin"
    atomic_write(path, lambda fh: fh.write(b"previous"))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert path.read_bytes() == b"previous"
    # Only a hidden temporary remains, never a file under the checkpoint's name.
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["ckpt.bin"]


def test_rank_from_launcher_environment(monkeypatch):
    monkeypatch.setattr(rank_zero, "_rank", None)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    assert rank_zero.rank() == 3 and not rank_zero.is_rank_zero()
    assert rank_zero.print0("hidden") is None
    rank_zero.set_rank(0)
    assert rank_zero.is_rank_zero()


def test_print0_only_on_rank_zero(monkeypatch, capsys):
    monkeypatch.setattr(rank_zero, "_rank", 1)
    rank_zero.print0("from rank 1")
    monkeypatch.setattr(rank_zero, "_rank", 0)
    rank_zero.print0("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"


def test_more_ranks_than_gpus_share_them_except_under_nccl():
    from hvdkit.core import Topology
    from hvdkit.devices import gpu_for

    assert gpu_for(Topology(rank=5, size=8, local_rank=1, local_size=2, cross_rank=2), 2, True) == 1
    four = Topology(rank=3, size=4, local_rank=3, local_size=4, cross_rank=0)
    assert gpu_for(four, 2, nccl=False) == 1  # Gloo/MPI: two ranks per GPU
    with pytest.raises(RuntimeError, match="rank 3: 4 processes on this host but 2 GPU"):
        gpu_for(four, 2, nccl=True)


def test_atomic_path_keeps_suffix_and_cleans_up(tmp_path):
    from hvdkit.checkpoint import atomic_path

    target = tmp_path / "sub" / "model.weights.h5"
    with atomic_path(target) as tmp:
        assert tmp.name.endswith(".weights.h5") and tmp.parent == target.parent
        tmp.write_bytes(b"w")
    assert target.read_bytes() == b"w"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash mid-save")
    assert target.read_bytes() == b"w"
    assert [p.name for p in target.parent.iterdir()] == ["model.weights.h5"]


def test_one_ramp_serves_every_lr_path():
    from hvdkit.lr import Warmup, ramp

    assert [ramp(s, 4, 0.5) for s in range(6)] == [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    assert [ramp(s, 4, 0.5, offset=1) for s in range(4)] == [0.625, 0.75, 0.875, 1.0]  # Horovod's
    assert ramp(0, 0, 0.25) == 1.0  # no warmup: the full value from the first step
    assert [Warmup(factor=4.0, steps=4).multiplier(s) for s in (0, 2, 4, 9)] == [1.0, 2.5, 4.0, 4.0]
    assert Warmup(factor=3.0).multiplier(0) == 3.0
    # With a framework's minimum on a tensor step (the Keras schedule's way).
    import numpy as np

    assert float(ramp(np.float32(2.0), 4, 0.5, minimum=np.minimum)) == 0.75


def test_the_facades_typed_options_are_setup_configs_fields():
    import dataclasses
    import typing

    from hvdkit.core import SetupConfig, SetupOptions

    fields = {f.name for f in dataclasses.fields(SetupConfig)} - {"checkpoint"}
    assert set(SetupOptions.__annotations__) == fields
    hints = typing.get_type_hints(SetupConfig)
    assert typing.get_args(hints["op"]) == ("average", "sum", "adasum")
    with pytest.raises(ValueError, match="op='max'"):
        SetupConfig(op="max")  # type: ignore[arg-type]  # what an untyped caller can still pass
