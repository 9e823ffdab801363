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
    for framework in ("PyTorch", "TensorFlow", "JAX (XLA)"):  # JAX: over Horovod's world
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
    assert "--network-interface lo" in check.fix  # the cause seen, not a generic guess
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


@pytest.mark.parametrize(
    ("output", "fix"),
    [
        ("ModuleNotFoundError: No module named 'torch'", "cannot import a framework"),
        ("RuntimeError: Gloo rendezvous failed: Connection refused", "Gloo rendezvous"),
        ("ORTE was unable to reliably start one or more daemons.", "mpirun failed"),
        ("ImportError: Extension horovod.torch has not been built", "Horovod's extension does"),
        ("UserWarning: Failed to initialize NumPy: No module named 'numpy'", "no known cause"),
        ("ValueError: No interface is found for address 127.0.0.1.", "Horovod could not use"),
        ("Segmentation fault (core dumped)", "no known cause recognised"),
    ],
)
def test_a_failed_allreduce_names_only_the_cause_seen(output, fix):
    assert checks.diagnose(f"noise\n{output}\nmore noise").startswith(fix) or fix in (
        checks.diagnose(output)
    )
    others = [f for _, f in checks.CAUSES if not f.startswith(fix) and fix not in f]
    assert checks.diagnose(output) not in others


def test_frameworks_not_installed_get_a_skip_not_an_allreduce(monkeypatch):
    """A TensorFlow-only environment: the build matrix may say torch (an old build, or
    Horovod's own check); doctor must not launch torch workers that cannot import torch."""
    matrix = checks.BuildMatrix(
        version="0.28.1",
        frameworks={"torch": True, "tensorflow": True},
        controllers={"gloo": True, "mpi": False},
        ops={},
    )
    monkeypatch.setattr(
        checks, "framework_version", lambda dist: "2.21.0" if dist == "tensorflow" else None
    )
    launched = []
    monkeypatch.setattr(
        checks, "allreduce_check", lambda fw, ctl, **_: launched.append((fw, ctl)) or None
    )
    found = [c for c in checks.allreduce_checks(matrix) if c is not None]
    assert launched == [("tensorflow", "gloo")]
    assert [c.render() for c in found] == [
        "SKIP  allreduce PyTorch: PyTorch is not installed",
        "SKIP  allreduce TensorFlow / mpi: Horovod was built without mpi",
    ]
