"""The pure parts of issue 38's seams: the training position and its arithmetic at a changed
world size, the checkpoint's extra values and file mode, the setup options refused, the sync
guard's fingerprint a chunk at a time, and the seam matrix's own oracle."""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import seams

from hvdkit.checkpoint import atomic_write, plain_extra
from hvdkit.core import SetupConfig
from hvdkit.position import Position, epoch_order, remaining, shard_length


def test_position_round_trips_and_reads_older_states():
    position = Position(epoch=2, samples=48, step=17, micro_step=1)
    again = Position()
    again.load_state_dict(position.state_dict())
    assert again == position
    again.load_state_dict({"epoch": 3, "step": 9})  # a commit from before micro-steps
    assert again == Position(epoch=3, samples=0, step=9, micro_step=0)
    again.end_epoch()
    assert (again.epoch, again.samples) == (4, 0)


@pytest.mark.parametrize("length", [96, 100, 7])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (4, 2), (3, 3)])
def test_a_resume_at_any_size_trains_each_sample_of_the_epoch_once(length, before, after):
    """A run at ``before`` ranks stops after k steps of batch B; the resume at ``after`` ranks
    trains the rest: together every sample once, beyond what padding the split adds (fewer
    than ``after`` repeats, and only when the rest does not divide)."""
    order = epoch_order(length, epoch=5, seed=3, shuffle=True)
    assert sorted(order) == list(range(length))
    batch = 4
    for steps in range(0, length // (batch * before) + 1):
        done = steps * batch * before
        first = [i for r in range(before) for i in remaining(order, 0, before, r, False)[:steps * batch]]  # fmt: skip
        rest = [i for r in range(after) for i in remaining(order, done, after, r, False)]
        assert sorted(first) == sorted(order[:done])  # a rank's first k batches: the slice
        counts = Counter(first + rest)
        assert set(counts) == set(range(length))
        assert sum(counts.values()) - length < after
        shares = {len(remaining(order, done, after, r, False)) for r in range(after)}
        assert len(shares) == 1  # the same number of batches on every rank


def test_drop_last_and_bad_ranks():
    order = list(range(10))
    assert sum(len(remaining(order, 3, 3, r, True)) for r in range(3)) == 6
    with pytest.raises(ValueError, match="rank 2 of 2"):
        remaining(order, 0, 2, 2, False)


def test_extra_values_are_checked_when_saving():
    import torch

    allowed = (type(None), bool, int, float, str, bytes, torch.Tensor)
    plain = plain_extra(
        {"best": np.float64(0.5), "step": np.int32(3), "ok": np.bool_(True),
         "nested": {"a": [np.float32(0.25), "x"]}, "t": torch.ones(2)},
        allowed,
    )  # fmt: skip
    assert plain["best"] == 0.5 and type(plain["best"]) is float
    assert type(plain["step"]) is int and plain["ok"] is True
    assert plain["nested"] == {"a": [0.25, "x"]}
    with pytest.raises(TypeError, match=r"extra 'out' is a pathlib\.PosixPath.*str\(path\)"):
        plain_extra({"out": Path("/tmp/x")}, allowed)
    with pytest.raises(TypeError, match=r"extra 'h'\['arr'\] is a numpy\.ndarray"):
        plain_extra({"h": {"arr": np.zeros(3)}}, allowed)


def test_checkpoint_files_get_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o002)
    try:
        path = atomic_write(tmp_path / "shared" / "ckpt.pt", lambda fh: fh.write(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temporary left


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"op": "adasum"}, "op='adasum' is not supported by setup()"),
        ({"op": "sum"}, "Fix: pass lr_scaling='none' with op='sum'"),
    ],
)
def test_setup_refuses_combinations_that_go_wrong(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SetupConfig(**options)
    SetupConfig(op="sum", lr_scaling="none")  # summed gradients, the user's LR: allowed


def test_the_sync_fingerprint_a_chunk_at_a_time_equals_the_whole(monkeypatch):
    import torch

    from hvdkit import sync
    from hvdkit.torch.session import _fingerprint

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype("float32") for n in (1, 2, 1000, 4099)]
    whole = np.array(
        [[a.sum(dtype=np.float64), a.astype(np.float64) @ np.linspace(1.0, 2.0, a.size),
          np.abs(a).sum(dtype=np.float64)] for a in arrays]
    )  # fmt: skip
    monkeypatch.setattr(sync, "CHUNK", 256)
    assert np.allclose(sync.fingerprint(arrays), whole, rtol=1e-12)
    on_torch = np.stack([_fingerprint(torch.from_numpy(a)).numpy() for a in arrays])
    assert np.allclose(on_torch, whole, rtol=1e-12)


def test_the_oracle_counts_every_sample_once_and_changes_size_where_told():
    from workers.seams_worker import Indexed, make_model

    job = seams.Job(epochs=1, segments=[seams.Segment(2, 2), seams.Segment(1)])
    result = seams.run(job, Indexed(), make_model())
    assert Counter(result["trained"][0]) == Counter(range(96))
    assert result["steps"] == 2 + (96 - 2 * 16) // 8
    assert result["lr_in_force"] == pytest.approx(0.05)  # size 1 now: the LR unscaled


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("length", "size"), [(41, 2), (40, 2), (7, 3), (2, 4)])
def test_shard_length_is_what_a_pass_from_the_start_gives_each_rank(length, size, drop_last):
    order = epoch_order(length, 0, 0, True)
    expected = {len(remaining(order, 0, size, r, drop_last)) for r in range(size)}
    assert expected == {shard_length(length, size, drop_last)}


def test_a_resume_at_the_same_size_pads_as_the_run_it_resumes():
    """Issue 49: the padding of a resumed epoch repeats the epoch's first samples, as the
    uninterrupted run's did, so both train the same last batch."""
    order = epoch_order(41, 1, 0, True)
    whole = [remaining(order, 0, 2, r, False) for r in range(2)]
    resumed = [remaining(order, 16, 2, r, False) for r in range(2)]
    assert [rows[8:] for rows in whole] == resumed
