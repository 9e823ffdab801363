"""Training scripts started N times without a Horovod launcher, as ``srun -n 2 python
train.py`` or a bare ``mpirun`` starts them: never N jobs of size 1. Real processes with the
variables those starters set (the real ``srun`` is in tests/test_slurm.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def start_like_srun(script: str, *args: str, env: dict[str, str] | None = None) -> list:
    """Two tasks with the variables ``srun -n 2`` gives its tasks, and nothing else."""
    procs = []
    for rank in range(2):
        task = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID":
                str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
                "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0", **(env or {})}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / script), *args], cwd=ROOT, env=task, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        ))  # fmt: skip
    return [(p, *p.communicate(timeout=240)) for p in procs]


@pytest.mark.parametrize(
    "script, args, env",
    [("torch_worker.py", ("one_step",), {}),
     ("keras_worker.py", ("one_step",), {"KERAS_BACKEND": "torch"})],
    ids=["torch", "keras"],
)  # fmt: skip
def test_srun_style_start_stops_every_task_with_the_fix(script, args, env):
    for rank, (proc, stdout, stderr) in enumerate(start_like_srun(script, *args, env=env)):
        assert proc.returncode != 0, stdout
        assert "RESULT" not in stdout  # no task trained
        assert f"srun started this script as task {rank} of 2" in stderr, stderr[-2000:]
        assert "DirectStartError" in stderr and "hvdkit run -- python SCRIPT" in stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_bare_mpirun_forms_one_job_with_an_mpi_build():
    """``mpirun -np 2 python train.py`` without horovodrun: MPI gives Horovod the world, so
    one step on 2 ranks equals one process on the global batch."""
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
         str(WORKERS / "torch_worker.py"), "one_step"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    by_rank = results(out)
    assert sorted(by_rank) == [0, 1]  # one job of size 2, not two of size 1
    assert all(r["diff"] < 1e-6 and r["moved"] > 1e-3 for r in by_rank.values())
