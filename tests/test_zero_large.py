"""A sharded optimizer state above 2 GiB resumes at another world size (issue 51): saved at
one rank, resumed at two (tests/workers/zero_large_worker.py). Horovod's ``broadcast_object``
sends the whole state as one pickle, whose size is a 32-bit int: above 2 GiB the root failed in
``setup()`` while the others waited. hvdkit sends the state's structure, then each tensor by
itself; each rank keeps its slice.

Checked: every rank's slices are the saved state, a step after the resume gives every element
Adam's value (from Adam on a small tensor), and what the resume holds at its peak beyond what a
rank keeps afterwards stays within 2x the state (the root holds the checkpoint it read: the
state and the weights)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from hvdkit.launch.horovodrun import launcher_argv

WORKER = ROOT / "tests" / "workers" / "zero_large_worker.py"


def run(np: int, mode: str, checkpoint) -> list[dict]:
    argv = launcher_argv(["horovodrun", "-np", str(np), sys.executable, str(WORKER), mode,
                          str(checkpoint)])  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line.split("ZERO_LARGE ", 1)[1] for line in out.stdout.splitlines()
             if "ZERO_LARGE " in line]  # fmt: skip
    # mpirun may glue its next tag onto the end of a line: only the JSON is read.
    records = [json.JSONDecoder().raw_decode(line)[0] for line in lines]
    return sorted(records, key=lambda r: r["rank"])


def adam_twice() -> float:
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        w.sum().backward()
        opt.step()
    return float(w.detach()[0])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.extra  # 6 GB a process, about a minute; make test-all runs it
@pytest.mark.timeout(1200)
def test_a_sharded_state_above_2_gib_resumes_at_another_world_size(tmp_path, capsys):
    checkpoint = tmp_path / "large.pt"
    (saved,) = run(1, "save", checkpoint)
    assert checkpoint.stat().st_size > 2**31 + saved["state_bytes"] // 2
    resumed = run(2, "resume", checkpoint)
    with capsys.disabled():
        print("\n" + "\n".join(json.dumps(r) for r in resumed))
    assert [r["rank"] for r in resumed] == [0, 1]
    want = adam_twice()
    for r in resumed:
        assert r["state_bytes"] > 2**31
        assert r["slice_bytes"] >= r["state_bytes"] // 2  # its half (padding aside)
        assert r["slices"] == {"exp_avg": True, "exp_avg_sq": True, "step": [1.0]}, r
        assert r["weight"] == pytest.approx([want], rel=1e-6), r
        assert r["resume_extra_bytes"] <= 2 * r["state_bytes"], r
