"""hvdkit's CPU image, built and run with whichever container engine this machine has: Docker,
else podman with the flags this kind of machine needs (``../shared/STACK.md``, "Containers on
these machines"): the runc runtime, rlimits at or below the hard ones, Docker-format builds
(so ``SHELL``'s pipefail applies) and host networking for the build's gate.

The build is docs/guides/docker.md's command with this machine's package sources as build
arguments: the
indexes, wheel folder and CA bundle from ``pip config`` (local paths mounted read-only), and
hvdkit's Horovod wheel cache mounted, so a matching wheel is installed, not compiled again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

# The checkout: .ci/run starts the prebuild with setup's interpreter, before the venv exists.
sys.path.insert(0, str(ROOT))
from hvdkit.horovod_build.config import default_cache_dir

TAG = "localhost/hvdkit:cpu-test"
TORCH_TAG = "localhost/hvdkit:cpu-torch-test"
TORCH_ONLY = ("FRAMEWORKS=torch", "KERAS_BACKEND=torch")
GPU_TAG = "localhost/hvdkit:gpu-test"
DEFAULT_BASE = "python:3.11.14-slim-bookworm"
DEBIAN_BASE = "localhost/hvdkit-python:3.11-bookworm"
PACKAGES = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}


@dataclass
class Engine:
    """``argv`` starts every command; ``run_flags``/``build_flags`` go after the subcommand."""

    name: str
    argv: list[str]
    run_flags: list[str]
    build_flags: list[str]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True):
        out = subprocess.run(
            [*self.argv, *args], capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(
                f"{self.name} {' '.join(args[:3])} ... failed ({out.returncode}):\n"
                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out

    def run(self, image: str, *args: str, flags: tuple[str, ...] = (), timeout: float = 600):
        return self("run", "--rm", *self.run_flags, *flags, image, *args, timeout=timeout,
                    check=False)  # fmt: skip


def find_engine() -> Engine | str:
    """Docker if it runs, else podman (installed from Debian when missing, as root); the reason
    when neither can be had."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0:
        return Engine("docker", [docker], [], [])
    missing = [pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return f"needs Docker, or podman: apt-get install -y {' '.join(missing)} as root"
        out = subprocess.run(
            # Lock timeout: the background image build (.ci/run) may be installing too.
            ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600", *missing],
            capture_output=True, text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )  # fmt: skip
        if out.returncode != 0:
            return f"apt-get install {' '.join(missing)} failed: {out.stderr.strip()[-300:]}"
    limits = ["--ulimit", "nproc=4096:4096", "--ulimit", "nofile=1024:1024"]
    return Engine(
        "podman",
        ["podman", "--runtime", "runc"],
        limits,
        # --uts host: Gloo (the build's gate) must resolve the host name, and a podman RUN
        # step's own name is not in its /etc/hosts.
        [*limits, "--format", "docker", "--network", "host", "--uts", "host"],
    )


LOCK = Path(tempfile.gettempdir()) / "hvdkit-image-build.lock"


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Held while a base or an image is built. CI starts the image build ahead of the tests
    (``prebuild``); the image test then waits for it and finds every layer cached, rather than
    building the same layers beside it."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the test's own timeout bounds the wait
        yield


def base_image(engine: Engine) -> tuple[str, str]:
    """The Dockerfile's default base when it can be pulled, else a Debian-made one (built
    once by ``docker/debian-python-base``); and which it is."""
    with building():
        return _base_image(engine)


def _base_image(engine: Engine) -> tuple[str, str]:
    if engine("pull", DEFAULT_BASE, timeout=120, check=False).returncode == 0:
        return DEFAULT_BASE, "pulled"
    if engine("image", "inspect", DEBIAN_BASE, check=False).returncode == 0:
        return DEBIAN_BASE, "Debian-made (kept from an earlier build)"
    env = {
        **os.environ,
        "ENGINE": " ".join(engine.argv),
        "BUILD_FLAGS": " ".join(engine.build_flags),
    }
    out = subprocess.run(
        [str(ROOT / "docker" / "debian-python-base"), DEBIAN_BASE], capture_output=True,
        text=True, timeout=900, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return DEBIAN_BASE, "Debian-made"


def pip_sources() -> tuple[list[str], list[str]]:
    """``--build-arg``s and ``-v`` mounts that give the build this machine's pip sources."""
    out = subprocess.run(["pip", "config", "list"], capture_output=True, text=True)
    config: dict[str, str] = {}
    for line in out.stdout.splitlines():
        match = re.match(r"^[\w:.]*?\.?([\w-]+)='(.*)'$", line.strip())
        if match:
            config.setdefault(match.group(1), match.group(2))
    args: list[str] = []
    mounts: list[str] = []

    def mount(path: str) -> None:
        if Path(path).exists() and f"{path}:{path}:ro" not in mounts:
            mounts.append(f"{path}:{path}:ro")

    variables = {"extra-index-url": "PIP_EXTRA_INDEX_URL", "index-url": "PIP_INDEX_URL",
                 "find-links": "PIP_FIND_LINKS"}  # fmt: skip
    for key, variable in variables.items():
        if key in config:
            args += ["--build-arg", f"{variable}={config[key]}"]
            for url in config[key].split():
                if url.startswith("file://"):
                    # A local index's pages link to files beside its simple/ folder.
                    path = Path(url.removeprefix("file://"))
                    mount(str(path.parent if path.name == "simple" else path))
                elif url.startswith("/"):
                    mount(url)
    if "cert" in config:
        # A path of its own: mounted over /etc/ssl/certs it would break apt in the image.
        mounts.append(f"{config['cert']}:/host-ca.crt:ro")
        args += ["--build-arg", "PIP_CERT=/host-ca.crt"]
    return args, mounts


def build(
    engine: Engine,
    base: str,
    tag: str = TAG,
    build_args: tuple[str, ...] = (),
    dockerfile: str = "docker/Dockerfile.cpu",
) -> tuple[float, list[str]]:
    """Build an image as docs/guides/docker.md says (plus ``build_args``, ``NAME=VALUE``), with this
    machine's sources; the seconds it took and the command (for the record). The base goes to
    both the CPU image's ``PYTHON_IMAGE`` and the GPU image's two stages."""
    args, mounts = pip_sources()
    for arg in build_args:
        args += ["--build-arg", arg]
    cache = default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    bases = [f"{name}={base}" for name in ("PYTHON_IMAGE", "BASE_IMAGE", "RUNTIME_IMAGE")]
    rest = [*[x for b in bases for x in ("--build-arg", b)], *args,
            "--build-arg", "HVDKIT_CACHE_DIR=/hvdkit-cache", "-v", f"{cache}:/hvdkit-cache",
            *[x for m in mounts for x in ("-v", m)], str(ROOT)]  # fmt: skip
    # The build stage gets a tag of its own, so that the layers the next build reuses are never
    # "dangling"; what a build replaces is removed (a few GB a commit filled this disk).
    stage = f"{tag}-build-stage"
    builds = [(stage, ["--target", "build"]), (tag, [])]
    started = time.monotonic()
    with building():
        before = {name: image_id(engine, name) for name, _ in builds}
        for name, target in builds:
            argv = ["build", *engine.build_flags, "-f", dockerfile, *target, "-t", name, *rest]
            try:
                engine(*argv, timeout=2400)
            except AssertionError as error:
                if "no space left on device" not in str(error):
                    raise
                raise AssertionError(
                    f"{error}\n\nThe disk under {engine.name}'s storage is full. Remove images "
                    f"no tag points to with `{' '.join(engine.argv)} image prune -f` (their "
                    "layers are rebuilt when needed), then run the tests again."
                ) from None
        for name, _ in builds:
            if before[name] and before[name] != image_id(engine, name):
                engine("rmi", before[name], check=False)  # still in use by a container: kept
    return time.monotonic() - started, argv


def image_id(engine: Engine, tag: str) -> str | None:
    """The ID ``tag`` names now; None when there is no such image."""
    out = engine("image", "inspect", tag, "--format", "{{.Id}}", check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def image_size(engine: Engine, tag: str = TAG) -> int:
    out = engine("image", "inspect", tag, "--format", "{{.Size}}")
    return int(out.stdout.strip())


def prebuild() -> int:
    """``python tests/containers.py``: build the base and the CPU image now, as the image
    test will (``.ci/run`` runs this in the background while the other tests run)."""
    engine = find_engine()
    if isinstance(engine, str):
        print(f"prebuild: nothing built: {engine}")
        return 0
    base, how = base_image(engine)
    seconds, _ = build(engine, base)
    print(f"prebuild: {TAG} built from {base} ({how}) in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(prebuild())
