"""hvdkit.torch with real processes: horovodrun -np 2 on localhost (Gloo, and MPI)."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_params_identical_on_all_ranks_after_training(tmp_path, controller):
    out = horovodrun(
        "torch_worker.py", "train", "--ranks-differ", "--epochs", "2", controller=controller
    )
    r = results(out)
    assert set(r) == {0, 1}
    assert r[0]["params"] == r[1]["params"]
    assert r[0]["steps"] == 2 * 4  # 64 samples / 2 ranks / batch 8 = 4 steps per epoch


def test_resume_gives_identical_weights(tmp_path):
    straight = results(
        horovodrun(
            "torch_worker.py",
            "train",
            "--epochs",
            "4",
            "--checkpoint",
            str(tmp_path / "a" / "ckpt.pt"),
        )
    )
    ckpt = str(tmp_path / "b" / "ckpt.pt")
    first = results(
        horovodrun(
            "torch_worker.py", "train", "--epochs", "4", "--stop-after", "2", "--checkpoint", ckpt
        )
    )
    assert first[0]["resumed"] is None and first[0]["steps"] == 8
    second = results(horovodrun("torch_worker.py", "train", "--epochs", "4", "--checkpoint", ckpt))
    assert second[0]["resumed"] == {"batches": 4}
    assert second[0]["steps"] == straight[0]["steps"] == 16
    assert second[0]["params"] == straight[0]["params"]
    assert second[1]["params"] == straight[1]["params"]
    # One checkpoint file, no temporary files left behind.
    assert second[0]["files"] == ["ckpt.pt"]


def test_uneven_shards_finish_and_checkpoint_once(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    r = results(
        horovodrun(
            "torch_worker.py",
            "train",
            "--samples",
            "37",
            "--epochs",
            "2",
            "--checkpoint",
            str(ckpt),
            timeout=180,
        )
    )
    assert r[0]["params"] == r[1]["params"]
    assert r[0]["files"] == ["ckpt.pt"]


def test_corrupt_checkpoint_fails_on_every_rank_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"not a checkpoint")
    out = horovodrun(
        "torch_worker.py", "train", "--checkpoint", str(ckpt), check=False, timeout=180
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"checkpoint {ckpt}: cannot be read" in text
    assert "rank 0 failed" in text  # the other rank stopped too instead of hanging


def test_horovod_script_runs_with_only_the_import_changed():
    r = results(horovodrun("torch_worker.py", "horovod_script", controller="mpi"))
    assert r[0]["params"] == r[1]["params"]
    assert r[0]["loss"] == 1.5 and r[0]["gathered"] == [0, 1]
    assert r[1]["obj"] == {"from": 0}


def test_mismatched_checkpoint_fails_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    horovodrun("torch_worker.py", "train", "--epochs", "1", "--checkpoint", ckpt)
    out = horovodrun(
        "torch_worker.py",
        "train",
        "--epochs",
        "2",
        "--hidden",
        "32",
        "--checkpoint",
        ckpt,
        check=False,
        timeout=180,
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"checkpoint {ckpt}: does not match this model/optimizer" in text
    assert "rank 0 failed" in text
