"""The checks of ``hvdkit doctor``: versions, Horovod's build matrix, GPUs, and a real
2-process allreduce per built framework and controller. Each yields one :class:`Check`."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hvdkit import __version__, envvars
from hvdkit.doctor.worker import PREFIX
from hvdkit.horovod_build import record
from hvdkit.horovod_build.config import CONTROLLERS, FRAMEWORK_NAMES, Controller
from hvdkit.horovod_build.matrix import BuildMatrix, MatrixError, read_matrix
from hvdkit.horovod_build.probe import dist_version, framework_version
from hvdkit.launch.horovodrun import launcher_argv, without_end
from hvdkit.launch.hostfile import Host
from hvdkit.launch.plan import LaunchConfig, build_plan

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
REBUILD = "hvdkit build-horovod --force (or `make setup` in an hvdkit checkout)"


@dataclass(frozen=True)
class Check:
    """One line of the report; ``fix`` is printed under a failure."""

    status: str
    name: str
    detail: str
    fix: str = ""

    def render(self) -> str:
        line = f"{self.status}  {self.name}: {self.detail}"
        return line + (f"\n      fix: {self.fix}" if self.fix and self.status == FAIL else "")


def _keras_backend() -> tuple[str, str]:
    """The backend Keras will use, and where that choice comes from (Keras's own order)."""
    if os.environ.get(envvars.KERAS_BACKEND):
        return os.environ[envvars.KERAS_BACKEND], envvars.KERAS_BACKEND
    config = Path(os.environ.get(envvars.KERAS_HOME, Path.home() / ".keras")) / "keras.json"
    try:
        return json.loads(config.read_text())["backend"], str(config)
    except (OSError, ValueError, KeyError):
        return "tensorflow", "default"


def keras_check(keras: str) -> Check:
    """Keras ``keras`` and its backend, which fails when the backend's framework is missing
    (a PyTorch-only install, where Keras's default TensorFlow backend cannot import)."""
    backend, source = _keras_backend()
    detail = f"{keras}, backend {backend} ({source})"
    if backend in FRAMEWORK_NAMES and not framework_version(backend):
        others = [name for name in FRAMEWORK_NAMES if framework_version(name)]
        fix = f"export KERAS_BACKEND={others[0]}" if others else "install a framework"
        return Check(
            FAIL,
            "Keras",
            f"{detail}, but {FRAMEWORK_NAMES[backend]} is not installed",
            f"{fix} (or install {FRAMEWORK_NAMES[backend]})",
        )
    return Check(PASS, "Keras", detail)


def _mpi_version() -> str | None:
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return None
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.strip().splitlines() or ["mpirun (unknown version)"])[0]


def version_checks() -> Iterator[Check]:
    """Python, hvdkit, Horovod, the frameworks, Keras and MPI."""
    yield Check(PASS, "Python", f"{platform.python_version()} ({sys.executable})")
    yield Check(PASS, "hvdkit", __version__)
    horovod = dist_version("horovod")
    yield (
        Check(PASS, "Horovod", horovod)
        if horovod
        else Check(FAIL, "Horovod", "not installed", "hvdkit build-horovod (or `make setup`)")
    )
    for dist, name in FRAMEWORK_NAMES.items():
        version = framework_version(dist)
        yield Check(PASS, name, version) if version else Check(SKIP, name, "not installed")
    keras = dist_version("keras")
    yield keras_check(keras) if keras else Check(SKIP, "Keras", "not installed")
    mpi = _mpi_version()
    yield Check(PASS, "MPI", mpi) if mpi else Check(SKIP, "MPI", "mpirun not found")


def build_checks() -> tuple[list[Check], BuildMatrix | None]:
    """Horovod's build matrix, and whether it was built for the frameworks now installed."""
    if dist_version("horovod") is None:
        return [], None
    try:
        matrix = read_matrix()
    except MatrixError as exc:
        return [Check(FAIL, "Horovod build", f"cannot load Horovod: {exc}", REBUILD)], None
    checks = [Check(PASS, "Horovod build", matrix.describe())]
    built_for = _built_for()
    for dist, name in FRAMEWORK_NAMES.items():
        installed = framework_version(dist)
        if installed and not matrix.frameworks.get(dist):
            checks.append(
                Check(
                    FAIL,
                    f"Horovod for {name}",
                    f"{name} {installed} is installed but Horovod was built without it",
                    REBUILD,
                )
            )
        elif dist in built_for and built_for[dist] != installed:
            checks.append(
                Check(
                    FAIL,
                    f"Horovod for {name}",
                    f"built against {name} {built_for[dist]}, but {installed} is installed",
                    REBUILD,
                )
            )
    mpi_missing = matrix.controllers.get("mpi") and not shutil.which("mpirun")
    if mpi_missing:
        checks.append(
            Check(
                FAIL,
                "MPI runtime",
                "Horovod was built with MPI but mpirun is not on PATH",
                "apt-get install -y openmpi-bin (or add MPI to PATH)",
            )
        )
    return checks, matrix


def _built_for() -> dict[str, str]:
    built = record.read()
    inputs = built.inputs if built is not None else {}
    return {k: inputs[k] for k in FRAMEWORK_NAMES if k in inputs}


def _horovodrun() -> str | None:
    local = Path(sys.executable).parent / "horovodrun"
    return str(local) if local.exists() else shutil.which("horovodrun")


CAUSES: tuple[tuple[str, str], ...] = (
    (
        r"(ModuleNotFoundError|ImportError): No module named '(torch|tensorflow|keras|numpy)",
        "a worker cannot import a framework it needs: install it in this Python, or rebuild "
        "Horovod for the frameworks you have (hvdkit build-horovod --force)",
    ),
    (
        r"(Extension horovod\.\w+ has not been built|undefined symbol|cannot open shared object)",
        "Horovod's extension does not load with the installed framework: " + REBUILD,
    ),
    (
        r"No interface is found for address|[Nn]etwork interface|NICs?\b",
        "Horovod could not use the network interface: give one that exists and carries "
        "localhost (hvdkit doctor --network-interface lo), or leave the option out",
    ),
    (
        r"(gloo|Gloo|rendezvous|Rendezvous).*?(refused|timed? ?out|failed|Connection)|"
        r"gethostbyname|Name or service not known",
        "Gloo rendezvous on localhost failed: check that `localhost` resolves to 127.0.0.1 and "
        "that no firewall blocks loopback ports; try hvdkit doctor --network-interface lo",
    ),
    (
        r"(ORTE|orted|mpirun (was unable|noticed|detected)|There are not enough slots|"
        r"MPI_Init|PMIX|pmix)",
        "mpirun failed: check `mpirun -np 2 hostname` works; in containers set "
        "OMPI_MCA_btl_vader_single_copy_mechanism=none; see the output above",
    ),
)
"""What a failed allreduce's output shows, and the fix for it: only a cause seen is named."""


def diagnose(text: str) -> str:
    """The fix for the first known cause in a failed run's output, else a pointer to it."""
    for pattern, fix in CAUSES:
        if re.search(pattern, text):
            return fix
    return "no known cause recognised; read the output in the line above"


ATTEMPTS = 2
"""Horovod 0.28.1's start-up rarely loses a race on a loaded 2-core machine (STACK.md); a
failure that recurs is real, one that does not is reported as passing on the second try."""


def _launch(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return -1, f"{partial}\ntimed out after {timeout:.0f} s"
    return out.returncode, without_end(out.stdout + out.stderr)


def allreduce_check(
    framework: str,
    controller: Controller,
    np: int = 2,
    timeout: float = 180,
    network_interface: str | None = None,
    hosts: list[Host] | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
) -> Check:
    """A real allreduce + broadcast: ``np`` ranks on localhost, or one per slot of ``hosts``."""
    where = "" if hosts is None else " across hosts"
    name = f"allreduce{where} {CHECKED_NAMES[framework]} / {controller}"
    horovodrun = _horovodrun()
    if horovodrun is None:
        return Check(FAIL, name, "horovodrun not found", "hvdkit build-horovod")
    config = LaunchConfig(
        command=(sys.executable, "-m", "hvdkit.doctor.worker", framework),
        np=np if hosts is None else None,
        controller=controller,
        network_interface=network_interface,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
    )
    plan = build_plan(
        config,
        hosts or [Host("localhost", np)],
        available=(controller,),
        horovodrun=horovodrun,
    )
    argv, np = launcher_argv(plan.argv), len(plan.ranks)
    failures: list[str] = []
    for _ in range(ATTEMPTS):
        code, text = _launch(argv, timeout)
        results = re.findall(rf"{PREFIX} {framework} rank (\d+)/(\d+) (\w+)", text)
        oks = {int(rank) for rank, _, status in results if status == "ok"}
        if code == 0 and oks == set(range(np)):
            retried = (
                f" (passed on try {len(failures) + 1}; before: {failures[0]})" if failures else ""
            )
            return Check(PASS, name, f"{np} ranks, sum and broadcast correct{retried}")
        wrong = [line for line in text.splitlines() if PREFIX in line and "WRONG" in line]
        if wrong:
            return Check(
                FAIL,
                name,
                f"wrong result: {wrong[0].strip()}",
                "Horovod computed a wrong value: rebuild it (" + REBUILD + ")",
            )
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-4:])
        failures.append(f"exit {code}, ranks ok: {sorted(oks)}; {tail[-600:]}")
    return Check(FAIL, name, failures[-1], diagnose(text))


# JAX has no Horovod binding: its check starts JAX's runtime over Horovod's torch world and
# sums in one XLA program across the processes (Keras on JAX's gradient path).
CHECKED_NAMES = {**FRAMEWORK_NAMES, "jax": "JAX (XLA)"}


def allreduce_checks(matrix: BuildMatrix, network_interface: str | None = None) -> Iterator[Check]:
    """One allreduce per framework and controller that Horovod was built with, and JAX's over
    each controller when JAX is installed."""
    for framework, pretty in FRAMEWORK_NAMES.items():
        if not matrix.frameworks.get(framework):
            continue
        if not framework_version(framework):
            yield Check(SKIP, f"allreduce {pretty}", f"{pretty} is not installed")
            continue
        for controller in CONTROLLERS:
            if not matrix.controllers.get(controller):
                yield Check(
                    SKIP,
                    f"allreduce {pretty} / {controller}",
                    f"Horovod was built without {controller}",
                )
                continue
            yield allreduce_check(framework, controller, network_interface=network_interface)
    if dist_version("jax") and matrix.frameworks.get("torch") and framework_version("torch"):
        for controller in CONTROLLERS:
            if matrix.controllers.get(controller):
                yield allreduce_check("jax", controller, network_interface=network_interface)
