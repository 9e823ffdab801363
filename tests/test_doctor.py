"""`hvdkit doctor` for real: real horovodrun processes under Gloo and MPI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdkit.doctor import checks
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


@pytest.mark.parametrize(
    ("backend", "installed", "status", "fix"),
    [
        ("", {"torch"}, FAIL, "export KERAS_BACKEND=torch"),  # Keras's default, no TensorFlow
        ("tensorflow", {"torch"}, FAIL, "export KERAS_BACKEND=torch"),
        ("torch", {"torch"}, PASS, ""),
        ("", {"torch", "tensorflow"}, PASS, ""),
    ],
)
def test_keras_check_fails_when_its_backend_framework_is_missing(
    monkeypatch, tmp_path, backend, installed, status, fix
):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))  # no keras.json: Keras's default
    monkeypatch.setattr(
        checks, "framework_version", lambda dist: "1.0" if dist in installed else None
    )
    check = checks.keras_check("3.15.1")
    assert check.status == status, check.render()
    assert check.fix.startswith(fix)
    assert "backend " + (backend or "tensorflow") in check.detail
