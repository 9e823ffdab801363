"""`hvdkit doctor` for real: real horovodrun processes under Gloo and MPI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdkit.doctor.checks import FAIL, PASS, allreduce_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_doctor_passes_with_allreduce_for_both_frameworks_and_controllers():
    out = subprocess.run(
        [sys.executable, "-m", "hvdkit", "doctor"],
        capture_output=True,
        text=True,
        timeout=880,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for framework in ("PyTorch", "TensorFlow"):
        for controller in ("gloo", "mpi"):
            assert f"PASS  allreduce {framework} / {controller}: 2 ranks" in out.stdout
    assert "PASS  Horovod build: Horovod 0.28.1" in out.stdout
    assert "FAIL" not in out.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_allreduce_check_fails_with_a_fix_when_gloo_cannot_start():
    # An interface that does not exist: the run must fail, not hang, and the check say so.
    check = allreduce_check("torch", "gloo", timeout=120, network_interface="hvdkit-no-such0")
    assert check.status == FAIL
    assert "localhost" in check.fix
    assert FAIL in check.render() and "fix:" in check.render()


@pytest.mark.timeout(120)
def test_doctor_without_horovod_fails_and_names_the_fix(tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [str(venv / "bin/python"), "-m", "hvdkit", "doctor"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  Horovod: not installed" in out.stdout
    assert "fix: hvdkit build-horovod" in out.stdout
    assert "SKIP  PyTorch: not installed" in out.stdout
    assert f"{PASS}  Python:" in out.stdout
