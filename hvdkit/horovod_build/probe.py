"""Look at the machine: framework, compiler, CMake, MPI, CUDA and NCCL versions.

Frameworks are found through package metadata and file paths, never imported, so probing
takes well under a second even with TensorFlow installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from hvdkit import envvars, gpus
from hvdkit.horovod_build.config import BuildEnv
from hvdkit.horovod_build.cuda import CudaCandidate, choose_toolkit


def _run(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout + out.stderr if out.returncode == 0 else None


def dist_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def framework_version(dist: str) -> str | None:
    """The installed version of a framework (``torch``, ``tensorflow``), or of its ``-cpu``
    distribution (``tensorflow-cpu``), else None."""
    return dist_version(dist, f"{dist}-cpu")


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def tool_path(name: str) -> str | None:
    """``name`` from this Python's bin directory first (a virtualenv's CMake), then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def _compiler() -> tuple[str | None, str | None, str | None]:
    candidates = [os.environ.get(envvars.CXX), "c++", "g++", "clang++"]
    for cand in filter(None, candidates):
        path = shutil.which(cand)
        if not path:
            continue
        text = _run([path, "--version"]) or ""
        ident = "clang" if "clang" in text.lower() else "gcc"
        version = (_run([path, "-dumpfullversion", "-dumpversion"]) or "").strip() or None
        return path, ident, version
    return None, None, None


def _cmake() -> tuple[str | None, str | None]:
    path = tool_path("cmake")
    if path is None:
        return None, None
    match = re.search(r"version\s+([\d.]+)", _run([path, "--version"]) or "")
    return path, match.group(1) if match else None


def _mpi() -> tuple[str | None, str | None, str | None]:
    mpirun = shutil.which("mpirun")
    mpicxx = shutil.which("mpicxx")
    if not mpirun or not mpicxx:
        return None, None, None
    text = _run([mpirun, "--version"]) or ""
    if match := re.search(r"Open MPI\)?\s+([\d.]+)", text):
        return "openmpi", match.group(1), mpicxx
    if match := re.search(r"Version:\s+([\d.]+)", text):
        return "mpich", match.group(1), mpicxx
    return "unknown", None, mpicxx


def _torch_cuda(torch_dir: Path | None) -> str | None:
    """The CUDA a CUDA build of torch was made for (its version.py), without importing it."""
    try:
        text = (torch_dir / "version.py").read_text() if torch_dir else ""
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([\d.]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


def _cuda_candidate(home: Path, source: str) -> CudaCandidate:
    nvcc = home / "bin" / "nvcc"
    text = _run([str(nvcc), "--version"]) if nvcc.exists() else None
    match = re.search(r"release\s+([\d.]+)", text or "")
    libs = [home / d for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    return CudaCandidate(
        home=str(home),
        source=source,
        version=match.group(1) if match else None,
        has_headers=(home / "include" / "cuda_runtime.h").exists(),
        has_cudart=any(any(d.glob("libcudart.so*")) for d in libs if d.is_dir()),
    )


def cuda_candidates() -> tuple[CudaCandidate, ...]:
    """Every place a CUDA toolkit may be, in hvdkit's order (:mod:`hvdkit.horovod_build.cuda`)."""
    places: list[tuple[Path, str]] = []
    nvidia = _package_dir("nvidia")
    if nvidia is not None:
        # CUDA 13's wheels share one prefix per major version (nvidia/cu13/{bin,include,lib}).
        places += [(p, "nvidia wheels") for p in sorted(nvidia.glob("cu[0-9]*"), reverse=True)]
    if os.environ.get(envvars.CUDA_HOME):
        places.append((Path(os.environ[envvars.CUDA_HOME]), "$CUDA_HOME"))
    places.append((Path("/usr/local/cuda"), "/usr/local/cuda"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        places.append((Path(nvcc).parent.parent, "nvcc on PATH"))
        # A link (update-alternatives, conda) names the toolkit it points into.
        places.append((Path(nvcc).resolve().parent.parent, "nvcc on PATH, resolved"))
    seen: set[str] = set()
    found = []
    for home, source in places:
        if home.is_dir() and str(home) not in seen:
            seen.add(str(home))
            found.append(_cuda_candidate(home, source))
    return tuple(found)


def _nccl() -> tuple[str | None, str | None, str | None]:
    version = dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
    base = _package_dir("nvidia")
    if version is None or base is None:
        return None, None, None
    nccl = base / "nccl"
    return version, str(nccl / "lib"), str(nccl / "include")


def _gpu_capabilities() -> tuple[str, ...]:
    # Every GPU of the machine, whatever this shell's CUDA_VISIBLE_DEVICES hides.
    return tuple(sorted({gpu.capability for gpu in gpus.probe(env={}).gpus}))


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 4.0


def probe() -> BuildEnv:
    """Everything the build decisions depend on, for the running Python."""
    tf_dir = _package_dir("tensorflow")
    tf_include = tf_dir / "include" if tf_dir else None
    tf_version = dist_version("tensorflow", "tensorflow-cpu", "tensorflow-gpu")
    if tf_version is None or tf_include is None or not tf_include.is_dir():
        tf_version, tf_include = None, None
    compiler, compiler_id, compiler_version = _compiler()
    cmake, cmake_version = _cmake()
    mpi_impl, mpi_version, mpicxx = _mpi()
    torch_dir = _package_dir("torch")
    torch_version = dist_version("torch")
    torch_cuda = _torch_cuda(torch_dir) if torch_version else None
    toolkit, passed_over = choose_toolkit(cuda_candidates(), torch_cuda)
    nccl_version, nccl_lib, nccl_include = _nccl()

    def tf_has(rel: str) -> bool:
        return tf_include is not None and (tf_include / rel).exists()

    include_dir = Path(sysconfig.get_paths()["include"])
    return BuildEnv(
        python_version=platform.python_version(),
        python_tag=f"cp{sys.version_info.major}{sys.version_info.minor}",
        platform=f"{sys.platform}-{platform.machine()}",
        torch_version=torch_version,
        torch_include_dir=str(torch_dir / "include") if torch_version and torch_dir else None,
        torch_cuda=torch_cuda,
        cuda_toolkit_wheels=dist_version("cuda-toolkit"),
        tensorflow_version=tf_version,
        tf_include_dir=str(tf_include) if tf_include else None,
        tf_has_highwayhash=tf_has("highwayhash/arch_specific.h"),
        tf_has_farmhash=tf_has("farmhash.h"),
        tf_has_legacy_xla_builder=tf_has("tensorflow/compiler/xla/client/xla_builder.h"),
        tf_has_moved_xla_builder=tf_has("xla/hlo/builder/xla_builder.h"),
        system_highwayhash=Path("/usr/include/highwayhash/arch_specific.h").exists(),
        system_farmhash=Path("/usr/include/farmhash.h").exists(),
        compiler=compiler,
        compiler_id=compiler_id,
        compiler_version=compiler_version,
        cmake=cmake,
        cmake_version=cmake_version,
        mpi_implementation=mpi_impl,
        mpi_version=mpi_version,
        mpicxx=mpicxx,
        cuda_home=toolkit.home if toolkit else None,
        cuda_version=toolkit.version if toolkit else None,
        cuda_source=toolkit.source if toolkit else None,
        cuda_passed_over=tuple(passed_over),
        nccl_version=nccl_version,
        nccl_lib_dir=nccl_lib,
        nccl_include_dir=nccl_include,
        gpu_compute_capabilities=_gpu_capabilities(),
        cpu_count=len(os.sched_getaffinity(0)),
        memory_gib=_memory_gib(),
        is_root=os.geteuid() == 0,
        has_apt=shutil.which("apt-get") is not None,
        python_headers=(include_dir / "Python.h").exists(),
    )
