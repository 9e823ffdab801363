"""`make setup` and the installed stack: idempotent, cached, verified."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from hvdkit.horovod_build import builder
from hvdkit.horovod_build.remedies import KNOWN_FAILURES

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_import_hvdkit_imports_no_framework():
    code = (
        "import sys, hvdkit, hvdkit.cli, hvdkit.horovod_build.builder, hvdkit.doctor.checks\n"
        "import hvdkit.core, hvdkit.lr, hvdkit.rank_zero, hvdkit.checkpoint\n"
        "loaded = {'torch', 'tensorflow', 'keras', 'horovod', 'mpi4py'} & set(sys.modules)\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def assert_check_build_complete(bin_dir: Path) -> None:
    """`horovodrun --check-build` of that environment lists both frameworks and controllers."""
    out = subprocess.run(
        [str(bin_dir / "horovodrun"), "--check-build"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    for item in ("[X] TensorFlow", "[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert item in out, out


def test_check_build_lists_both_frameworks_and_controllers():
    assert_check_build_complete(BIN)


def test_plan_shows_remedies_for_this_machine():
    out = subprocess.run(
        [str(BIN / "hvdkit"), "build-horovod", "--plan"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "Remedies:" in out and "build-isolation" in out and "Cache key: horovod-0.28.1" in out
    # This stack (torch 2.13, pip's CMake 4, TF 2.21) needs these; see test_build_decisions.
    for key in ("cmake-policy", "cxx17", "xla-builder-header", "tf-hash-headers"):
        assert f"- {key}:" in out


def test_bad_flag_gives_clear_error():
    out = subprocess.run(
        [str(BIN / "hvdkit"), "build-horovod", "--frameworks", "mxnet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--frameworks: mxnet is not one of torch, tensorflow" in out.stderr
    assert "Traceback" not in out.stderr


def test_plan_stops_with_the_fix_when_the_build_would_fail():
    """What stops a build is said by --plan, before any compile: here a NCCL build on a machine
    with no NCCL wheel and no GPU to take the CUDA arch list from."""
    out = subprocess.run(
        [str(BIN / "hvdkit"), "build-horovod", "--plan", "--gpu-operations", "NCCL"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "error: the build would fail" in out.stdout
    assert "pip install nvidia-nccl-cu13" in out.stdout and "--cuda-arch 80,90" in out.stdout
    assert "Traceback" not in out.stderr


def test_troubleshooting_guide_covers_every_known_failure():
    guide = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text()
    for failure in KNOWN_FAILURES:
        assert failure.symptom.split(" / ")[0].split(", then")[0] in guide.replace("`", ""), (
            failure.key
        )


def _make_setup(
    cwd: Path, *args: str, timeout: float, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """``make setup ARGS`` in ``cwd``; the result and how long it took."""
    start = time.monotonic()
    out = subprocess.run(
        ["make", "setup", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return out, time.monotonic() - start


def test_second_make_setup_does_nothing():
    out, took = _make_setup(ROOT, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already installed for this key; nothing to do" in out.stdout
    assert "Compiling Horovod" not in out.stdout
    print(f"second make setup: {took:.1f} s")


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for rel in files:
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


SITE = Path(sysconfig.get_paths()["purelib"])
"""This venv's site-packages."""
NOT_LINKED = ("horovod", "horovod-", "hvdkit-", "__editable__.hvdkit-", "__editable___hvdkit_")
"""What a fresh checkout's ``make setup`` must install itself: Horovod (from the cache) and
hvdkit (editable, from that checkout)."""


def _venv_with_this_stack(venv: Path) -> None:
    """A new venv whose site-packages holds this venv's packages as hard links, less
    :data:`NOT_LINKED`: the frameworks' gigabytes are not unpacked again, and ``make setup``
    finds them installed. Every file ``make setup`` writes is a new one (pip and Python
    replace files, never write into them), so this venv's files stay as they are."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    entries = [
        str(e)
        for e in SITE.iterdir()
        if not e.name.startswith(NOT_LINKED) and e.name != "__pycache__"
    ]
    subprocess.run(["cp", "-al", *entries, str(venv / SITE.relative_to(sys.prefix))], check=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fresh_checkout_reuses_cached_wheel(tmp_path):
    """Another checkout's ``make setup`` finds this machine's Horovod wheel by its key.

    The frameworks come into its venv as hard links of this one's (``make setup``'s pip finds
    them installed): unpacking them again took 250 s of CI's 2 cores and checks nothing this
    test is about. CI's own ``make setup``, in a fresh clone with an empty venv, installs the
    whole stack on every run."""
    clone = tmp_path / "clone"
    _copy_checkout(clone)
    _venv_with_this_stack(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["PIP_NO_COMPILE"] = "1"  # a throwaway venv
    out, took = _make_setup(clone, f"VENV={tmp_path / 'venv'}", timeout=800, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Reusing cached wheel" in out.stdout, out.stdout
    assert "Compiling Horovod" not in out.stdout
    assert_check_build_complete(tmp_path / "venv/bin")
    # hvdkit is the clone's, and this venv still has its own Horovod and hvdkit
    where = subprocess.run(
        [str(tmp_path / "venv/bin/python"), "-c", "import hvdkit; print(hvdkit.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert where.startswith(str(clone)), where
    # this venv's own, untouched
    assert (SITE / "horovod").is_dir() and list(SITE.glob("__editable__*hvdkit*.pth"))
    print(f"fresh checkout setup with warm cache: {took:.1f} s")


BROKEN_SETUP = """
import subprocess, sys
from setuptools import setup
if "bdist_wheel" in sys.argv:
    for i in range(300):
        print(f"[ {i // 3:2d}%] Building CXX object noise_{i}.cc.o", flush=True)
    subprocess.run(["c++", "-std=c++14", "-c", "bad.cc", "-o", "bad.o"], check=True)
setup(name="horovod", version="0.0.1")
"""


@pytest.mark.timeout(300)
def test_failed_build_prints_first_error_and_log_path(tmp_path):
    """A real failing compile (a source that needs C++17) through the builder."""
    src = tmp_path / "horovod-0.0.1"
    src.mkdir()
    (src / "setup.py").write_text(BROKEN_SETUP)
    (src / "bad.cc").write_text(
        "#if __cplusplus < 201703L\n"
        "#error C++17 or later compatible compiler is required to use PyTorch.\n"
        "#endif\n"
    )
    sdist = tmp_path / "horovod-0.0.1.tar.gz"
    subprocess.run(["tar", "czf", str(sdist), "-C", str(tmp_path), "horovod-0.0.1"], check=True)
    out = subprocess.run(
        [
            str(BIN / "hvdkit"),
            "build-horovod",
            "--horovod-version",
            "0.0.1",
            "--sdist",
            str(sdist),
            "--no-cache",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--frameworks",
            "torch",
            "--controllers",
            "gloo",
            "--system-deps",
            "check",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    err = out.stderr
    assert "Horovod build failed." in err and "First error" in err
    assert "bad.cc:2:2: error: #error C++17 or later" in err
    assert "Fix: hvdkit builds through a compiler wrapper" in err
    logs = list((tmp_path / "cache/logs").glob("*.log"))
    assert len(logs) == 1 and f"Full log: {logs[0]}" in err
    assert "noise_250" in logs[0].read_text() and "noise_250" not in err
    assert len(err.splitlines()) < 15
    assert not (tmp_path / "cache/wheels").exists() or not any(
        (tmp_path / "cache/wheels").iterdir()
    )


def test_make_setup_without_python311_names_the_fix(tmp_path):
    out = subprocess.run(
        ["make", "setup", "PYTHON=hvdkit-no-such-python3.11", f"VENV={tmp_path / 'v'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode != 0
    assert "hvdkit-no-such-python3.11 not found" in out.stdout
    assert "make setup PYTHON=/path/to/python3.11" in out.stdout
    assert not (tmp_path / "v").exists()


def test_make_setup_refuses_a_python_outside_the_tested_range(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from matrix import find_python

    old = find_python("3.10")
    if old is None:
        pytest.skip("no Python 3.10 here to be refused")
    out = subprocess.run(
        ["make", "setup", f"PYTHON={old}", f"VENV={tmp_path / 'v'}"], cwd=ROOT,
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode != 0
    assert "outside the 3.11 to 3.13" in out.stdout and "python3.12" in out.stdout, out.stdout
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    ("frameworks", "kept", "left_out"),
    [
        (None, ("torch==", "tensorflow-cpu==", "tf-keras==", "keras=="), ()),
        ("torch", ("torch==", "keras==", "mpi4py=="), ("tensorflow-cpu", "tf-keras")),
        ("tensorflow", ("tensorflow-cpu==", "tf-keras==", "keras=="), ("torch==",)),
    ],
)
def test_make_stack_installs_the_pins_of_the_frameworks_asked_for(
    tmp_path, frameworks, kept, left_out
):
    # A stand-in venv python records what pip is asked to install (and answers the Makefile's
    # question of which Python made the venv as the real one would).
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec python3.11 "$@"\n'
                      f'echo "$@" >> {tmp_path / "calls"}\n')  # fmt: skip
    python.chmod(0o755)
    extra = [f"FRAMEWORKS={frameworks}"] if frameworks else []
    out = subprocess.run(
        ["make", "--no-print-directory", "stack", f"VENV={venv}", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"-r {venv / 'stack.txt'}" in (tmp_path / "calls").read_text()
    pins = [line.split()[0] for line in (venv / "stack.txt").read_text().splitlines()
            if line and not line.startswith("#")]  # fmt: skip
    for pin in kept:
        assert any(p.startswith(pin) for p in pins), (pin, pins)
    for pin in left_out:
        assert not any(p.startswith(pin) for p in pins), (pin, pins)
    assert any(p.startswith("pytest==") for p in pins)  # untagged lines are always kept


def test_the_builders_pip_waits_for_another_pip_run_holding_the_venvs_lock(tmp_path, monkeypatch):
    """CI installs the tests' tools beside Horovod's compile under ``flock VENV/.hvdkit-pip.lock``:
    the builder's own pip runs wait for it, so two never write into the venv at once; where
    the environment cannot hold the lock file, the builder runs pip without it."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    holder = subprocess.Popen(
        ["flock", str(tmp_path / builder.PIP_LOCK), "sh", "-c", "echo held; sleep 3"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    start = time.monotonic()
    builder._pip("--version")
    assert time.monotonic() - start > 2  # it began only once the holder let go
    assert holder.wait(10) == 0
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "not" / "here"))
    builder._pip("--version")
