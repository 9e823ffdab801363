"""`hvdkit run`'s hang doctor with real processes (2 ranks, Gloo, the Horovod drop-in): each
usual way a rank keeps the others waiting is named, with the rank and the cause, within the
timeout and half of it again; a job that only pauses goes on and ends as it would have; a
mismatched tensor is named in one line with every rank's shape or dtype."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")
WORKER = str(WORKERS / "hang_worker.py")
TIMEOUT = 4


def doctored(case: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run(
        [HVDKIT, "run", "-np", "2", "--gloo", "--stall-timeout", str(TIMEOUT), *flags, "--",
         sys.executable, WORKER, case],
        capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return out, time.monotonic() - start


def diagnosis(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("hvdkit run: diagnosis: ")]
    assert len(lines) == 1, out.stdout[-2000:] + out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("fewer", ["rank 1 left the training loop", "hang_worker.py:", "rank 0 waits for a "
                   "step's gradients", "different numbers of batches"]),
        ("data", ["rank 1 is loading data at", "in __getitem__", "rank 0 waits for it in "
                  "allreduce.", "data path"]),
        ("lock", ["rank 1 is waiting on a lock at", "hang_worker.py:", "rank 0 waits for it"]),
        ("names", ["the ranks submitted different collectives", "same names"]),
    ],
)  # fmt: skip
def test_a_stalled_job_says_which_rank_and_why(case, said):
    """(a) one batch fewer, (b) a rank asleep in its data loading, (c) a rank stuck on a
    lock, (d) ranks submitting different tensor names; --on-stall stop ends the job."""
    out, seconds = doctored(case, "--on-stall", "stop")
    assert out.returncode == 124, out.stdout[-2000:] + out.stderr[-3000:]
    line = diagnosis(out)
    for piece in said:
        assert piece in line, line
    assert "hang doctor: ranks have waited" in out.stderr
    assert "rank 0 (localhost): " in out.stderr and "rank 1 (localhost): " in out.stderr
    assert "stopping the job (--on-stall stop)" in out.stderr
    assert "One or more tensors were submitted" not in out.stderr  # Horovod's, said better
    assert seconds < 90  # start-up, the timeout, the report: not a stall until CI's limit


@pytest.mark.parametrize(("case", "what"), [("shapes", "[2] float32, rank 1 [3] float32"),
                                            ("dtypes", "[3] float32, rank 1 [3] float64")])
def test_a_mismatched_tensor_is_named_with_every_ranks_shape(case, what):
    """(e) one tensor in different shapes (dtypes): Horovod fails at once without naming the
    ranks; one line names each rank's."""
    out, _ = doctored(case)
    assert out.returncode == 1
    line = diagnosis(out)
    assert f"the ranks gave allreduce.metric different {case}: rank 0 {what}" in line, line


def test_a_pause_is_reported_and_the_job_goes_on_as_it_would_have():
    """Rank 1's read returns 8 s late: the doctor reports it at 4 s and keeps waiting
    (the default); the job ends with the weights of a run without the doctor."""
    out, _ = doctored("slow")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "rank 1 is loading data at" in diagnosis(out)
    assert "still waiting (--on-stall stop ends the job here)" in out.stderr
    plain = subprocess.run(
        [HVDKIT, "run", "-np", "2", "--gloo", "--stall-timeout", "0", "--", sys.executable,
         WORKER, "ok"], capture_output=True, text=True, timeout=240, cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert plain.returncode == 0 and "hang doctor" not in plain.stderr
    got, want = results(out), results(plain)
    assert got[0]["digest"] == got[1]["digest"] == want[0]["digest"] == want[1]["digest"]
