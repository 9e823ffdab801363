"""Build Horovod from its source distribution against the installed frameworks, or reuse
a cached wheel, then install and verify it. The decisions are made by the pure modules
(:mod:`~hvdkit.horovod_build.remedies`, :mod:`~hvdkit.horovod_build.prereqs`,
:mod:`~hvdkit.horovod_build.recipe`); this module runs the commands.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hvdkit.horovod_build import record, system
from hvdkit.horovod_build.cache import WheelCache, cache_inputs, cache_key
from hvdkit.horovod_build.config import BuildConfig, BuildEnv
from hvdkit.horovod_build.logscan import summarize_failure
from hvdkit.horovod_build.matrix import MatrixError, read_matrix
from hvdkit.horovod_build.prereqs import Problem, find_problems, missing_system_packages
from hvdkit.horovod_build.probe import probe
from hvdkit.horovod_build.recipe import make_recipe
from hvdkit.horovod_build.remedies import Remedy, plan_remedies

"""Written into the environment after a verified install: which cache key it holds."""

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """A build that cannot proceed or failed; the message says what to do."""


@dataclass(frozen=True)
class BuildResult:
    key: str
    source: str  # "installed" (nothing to do), "cache" or "built"
    wheel: Path | None
    seconds: float


PIP_LOCK = ".hvdkit-pip.lock"
"""A file in the environment that every pip run of the builder holds: another pip run that
takes it too (``flock VENV/.hvdkit-pip.lock pip ...``, as CI installs its test tools beside
the compile) never writes into the environment at the same moment."""


@contextlib.contextmanager
def _pip_lock() -> Iterator[None]:
    try:
        lock = open(Path(sys.prefix) / PIP_LOCK, "a")
    except OSError:  # an environment this user cannot write to: nobody else installs there
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pip(*args: str, log_file: Path | None = None) -> None:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    with _pip_lock():
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if log_file is not None:
        with log_file.open("a") as fh:
            fh.write(f"$ {' '.join(argv)}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-10:])
        raise BuildError(f"`pip {' '.join(args)}` failed (exit {out.returncode}):\n{tail}")


def describe_plan(env: BuildEnv, cfg: BuildConfig, remedies: list[Remedy], key: str) -> str:
    """The lines printed before anything runs: what was found and which remedies apply."""
    torch = f"torch {env.torch_version}" if env.torch_version else "no torch"
    if env.torch_cuda:
        torch += f" (a CUDA {env.torch_cuda} build)"
    found = [
        f"Python {env.python_version}",
        torch,
        f"TensorFlow {env.tensorflow_version}" if env.tensorflow_version else "no TensorFlow",
        f"{env.compiler_id} {env.compiler_version}" if env.compiler else "no C++ compiler",
        f"CMake {env.cmake_version}" if env.cmake else "no CMake",
        f"{env.mpi_implementation} {env.mpi_version}" if env.mpi_implementation else "no MPI",
    ]
    if cfg.gpu_operations:
        found.append(f"NCCL {env.nccl_version}")
    cuda_torch = "torch" in cfg.frameworks and env.torch_cuda
    gpu_ops = cfg.gpu_operations or (
        "none (CPU collectives; CUDA tensors staged through host memory)"
        if cuda_torch
        else "none (CPU)"
    )
    lines = [
        f"hvdkit build-horovod {cfg.horovod_version}: frameworks {','.join(cfg.frameworks)}; "
        f"controllers {','.join(cfg.controllers)}; GPU ops {gpu_ops}; debug info "
        + ("yes (-g)" if cfg.debug_info else "no (--debug-info adds it)"),
        "Found: " + ", ".join(found),
    ]
    if cfg.gpu_operations or cuda_torch:
        chosen = (
            f"{env.cuda_home} ({env.cuda_source}, CUDA {env.cuda_version})"
            if env.cuda_home
            else "none usable"
        )
        lines.append(f"CUDA toolkit: {chosen}")
        lines += [f"  passed over: {why}" for why in env.cuda_passed_over]
    lines.append("Remedies:")
    lines += [f"  - {r.key}: {r.reason}" for r in remedies]
    lines.append(f"Cache key: {key}")
    return "\n".join(lines)


def _already_installed(key: str, version: str) -> bool:
    marked = record.read()
    try:
        return (
            marked is not None
            and marked.key == key
            and (importlib.metadata.version("horovod") == version)
        )
    except importlib.metadata.PackageNotFoundError:
        return False


def plan_problems(env: BuildEnv, cfg: BuildConfig) -> tuple[list[str], list[Problem]]:
    """The Debian packages the build will install, and what stops it (each with its fix)."""
    packages = missing_system_packages(env, plan_remedies(env, cfg))
    can_install = cfg.system_deps in ("auto", "apt") and env.is_root and env.has_apt
    to_install = packages if can_install else []
    return to_install, find_problems(env, cfg, [] if can_install else packages)


def _ensure_system_packages(env: BuildEnv, cfg: BuildConfig, log: Log) -> BuildEnv:
    packages, problems = plan_problems(env, cfg)
    if packages:
        try:
            system.apt_install(packages, log)
        except RuntimeError as exc:
            raise BuildError(str(exc)) from exc
        env = probe()
        problems = find_problems(env, cfg, missing_system_packages(env, plan_remedies(env, cfg)))
    if problems:
        raise BuildError("Cannot build Horovod yet:\n\n" + "\n\n".join(map(str, problems)))
    return env


def _fetch_sdist(cfg: BuildConfig, log: Log) -> Path:
    if cfg.sdist is not None:
        if not cfg.sdist.is_file():
            raise BuildError(f"--sdist {cfg.sdist}: no such file")
        return cfg.sdist
    target = cfg.sdist_dir / f"horovod-{cfg.horovod_version}.tar.gz"
    if not target.exists():
        log(f"Downloading the Horovod {cfg.horovod_version} source distribution")
        cfg.sdist_dir.mkdir(parents=True, exist_ok=True)
        _pip(
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(cfg.sdist_dir),
            f"horovod=={cfg.horovod_version}",
        )
    return target


def _compile(
    sdist: Path, build_env: dict[str, str], outdir: Path, log_path: Path, log: Log
) -> Path:
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-v",
        "-w",
        str(outdir),
        str(sdist),
    ]
    log(f"Compiling Horovod ({build_env['MAKEFLAGS']}); full log: {log_path}")
    start, last = time.monotonic(), -10
    with log_path.open("a") as fh:
        fh.write(f"$ {' '.join(argv)}\nenv: {json.dumps(build_env, indent=1)}\n")
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **build_env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            match = re.search(r"\[\s*(\d+)%\]", line)
            if match and int(match.group(1)) >= last + 10:
                last = int(match.group(1))
                log(f"  {last:3d}% after {time.monotonic() - start:.0f} s")
        code = proc.wait()
    wheels = sorted(outdir.glob("horovod-*.whl"))
    if code != 0 or not wheels:
        lines = log_path.read_text(errors="replace").splitlines()
        raise BuildError(summarize_failure(lines, str(log_path)))
    log(f"Compiled in {time.monotonic() - start:.0f} s")
    return wheels[0]


def _install(wheel: Path, cfg: BuildConfig, env: BuildEnv, key: str, log: Log) -> None:
    log(f"Installing {wheel.name}")
    _pip("install", "--no-deps", "--force-reinstall", str(wheel))
    try:
        matrix = read_matrix()
    except MatrixError as exc:
        raise BuildError(
            f"Horovod was installed but does not import:\n{exc}\n"
            f"Fix: rebuild without the cache: hvdkit build-horovod --no-cache"
        ) from exc
    missing = matrix.missing(cfg.frameworks, cfg.controllers)
    if missing:
        raise BuildError(
            f"The installed Horovod lacks {', '.join(missing)} ({matrix.describe()}).\n"
            "Fix: rebuild without the cache: hvdkit build-horovod --no-cache"
        )
    log(matrix.describe())
    record.write(record.BuildRecord(key, str(wheel), cache_inputs(env, cfg)))


def build_horovod(cfg: BuildConfig, log: Log = print, force: bool = False) -> BuildResult:
    """Make Horovod ``cfg.horovod_version`` importable in this Python with what ``cfg`` asks
    for: nothing if it already is, the cached wheel if one matches, else a fresh build.

    Raises :class:`BuildError` with a message naming the fix.
    """
    start = time.monotonic()
    env = probe()
    key = cache_key(env, cfg)
    log(describe_plan(env, cfg, plan_remedies(env, cfg), key))
    if not force and _already_installed(key, cfg.horovod_version):
        log(f"Horovod {cfg.horovod_version} is already installed for this key; nothing to do.")
        return BuildResult(key, "installed", None, time.monotonic() - start)
    env = _ensure_system_packages(env, cfg, log)
    remedies = plan_remedies(env, cfg)
    installed_key = cache_key(env, cfg)
    if installed_key != key:
        key = installed_key
        log(f"Cache key with the installed system packages: {key}")
    cache = WheelCache(cfg.wheel_dir)
    pip_packages = sorted({p for r in remedies for p in r.pip_packages})
    try:
        _pip("install", "-q", *pip_packages)
    except BuildError as exc:
        raise BuildError(
            f"{exc}\nThe build needs these Python packages first: {' '.join(pip_packages)}"
            f"{' (CMake: none was found on PATH)' if env.cmake is None else ''}.\n"
            f"Fix: make them installable (pip install {' '.join(pip_packages)}), or on Debian "
            "apt-get install -y cmake for CMake."
        ) from exc
    wheel = cache.lookup(key) if cfg.use_cache else None
    if wheel is not None:
        log(f"Reusing cached wheel {wheel}")
        _install(wheel, cfg, env, key, log)
        return BuildResult(key, "cache", wheel, time.monotonic() - start)
    if env.cmake is None:
        env = probe()  # the cmake-policy remedy just installed CMake from PyPI
    sdist = _fetch_sdist(cfg, log)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = cfg.log_dir / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="hvdkit-build-") as tmp:
        workdir = Path(tmp)
        build_env = make_recipe(env, cfg, remedies, dict(os.environ)).materialize(workdir)
        built = _compile(sdist, build_env, workdir / "dist", log_path, log)
        metadata: dict[str, object] = {
            "key": key,
            "inputs": cache_inputs(env, cfg),
            "remedies": [r.key for r in remedies],
            "log": str(log_path),
        }
        wheel = cache.store(key, built, metadata)
    log(f"Cached {wheel}")
    _install(wheel, cfg, env, key, log)
    return BuildResult(key, "built", wheel, time.monotonic() - start)
