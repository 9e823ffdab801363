"""hvdkit as a user installs it: ``python -m build`` makes an sdist and a wheel that pass
``twine check``; the wheel installs into a fresh venv with no framework, brings numpy (what
``import hvdkit.torch`` and the examples' data need), carries the stack file, and its commands
answer with the fix where nothing is installed yet."""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_setup import _copy_checkout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(*argv: str | Path, cwd: Path | None = None, check: bool = True):
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if check:
        assert out.returncode == 0, f"{argv}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_sdist_and_wheel_build_pass_twine_and_install_into_a_fresh_venv(tmp_path):
    src, dist, tools, user = (tmp_path / d for d in ("src", "dist", "tools", "user"))
    _copy_checkout(src)
    _run(sys.executable, "-m", "venv", tools)
    _run(tools / "bin/python", "-m", "pip", "install", "-q", "build", "twine")
    _run(tools / "bin/python", "-m", "build", "--sdist", "--wheel", "--outdir", dist, src)
    (sdist,), (wheel,) = dist.glob("hvdkit-*.tar.gz"), dist.glob("hvdkit-*.whl")
    checked = _run(tools / "bin/twine", "check", "--strict", sdist, wheel)
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = email.message_from_bytes(
            zf.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        )
    assert "hvdkit/horovod_build/stack-cpu.txt" in names
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
    requires = meta.get_all("Requires-Dist")
    assert [r for r in requires if "extra ==" not in r] == ["numpy>=1.24"], requires
    # A tensorflow-cpu user is never handed `tensorflow`, nor a torch user a second torch.
    assert not any(r.startswith(("tensorflow", "torch")) and "extra ==" not in r for r in requires)
    cpu_extra = [r for r in requires if 'extra == "tensorflow-cpu"' in r]
    assert cpu_extra and not any(r.startswith("tensorflow>") for r in cpu_extra), requires
    assert {"examples", "torch", "tensorflow", "tensorflow-cpu", "keras"} <= set(
        meta.get_all("Provides-Extra")
    )

    _run(sys.executable, "-m", "venv", user)
    python = user / "bin/python"
    _run(python, "-m", "pip", "install", "-q", wheel)
    _run(python, "-c", "import numpy, hvdkit.data, hvdkit.horovod_build.builder")
    help_text = _run(user / "bin/hvdkit", "--help").stdout
    assert "build-horovod" in help_text and "doctor" in help_text
    plan = _run(user / "bin/hvdkit", "build-horovod", "--plan", check=False)
    assert plan.returncode == 2, plan.stdout + plan.stderr
    assert "neither PyTorch nor TensorFlow is installed" in plan.stderr
    assert "Traceback" not in plan.stderr
    # The sdist installs too (what pip builds when no wheel fits).
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", sdist)
    _run(python, "-c", "import hvdkit.horovod_build.config")
