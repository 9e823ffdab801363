"""Typed inputs of the Horovod build: what the user asked for and what the machine has."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from hvdkit import envvars

HOROVOD_VERSION = "0.28.1"
FRAMEWORKS = ("torch", "tensorflow")
FRAMEWORK_NAMES = {"torch": "PyTorch", "tensorflow": "TensorFlow"}
Controller = Literal["gloo", "mpi"]
CONTROLLERS: tuple[Controller, ...] = get_args(Controller)
SystemDeps = Literal["auto", "apt", "check"]
SYSTEM_DEPS_MODES: tuple[str, ...] = get_args(SystemDeps)


def default_cache_dir() -> Path:
    """``$HVDKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdkit``, else ``~/.cache/hvdkit``."""
    if os.environ.get(envvars.CACHE_DIR):
        return Path(os.environ[envvars.CACHE_DIR])
    base = os.environ.get(envvars.XDG_CACHE_HOME) or str(Path.home() / ".cache")
    return Path(base) / "hvdkit"


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """What to build. Frameworks default to those installed; controllers to Gloo and MPI.

    Example::

        BuildConfig(frameworks=("torch",), controllers=("gloo",), gpu_operations="NCCL",
                    cuda_arch_list=("90",))
    """

    horovod_version: str = HOROVOD_VERSION
    frameworks: tuple[str, ...] = FRAMEWORKS
    controllers: tuple[Controller, ...] = CONTROLLERS
    gpu_operations: Literal["NCCL"] | None = None
    cuda_arch_list: tuple[str, ...] = ()
    cache_dir: Path = field(default_factory=default_cache_dir)
    use_cache: bool = True
    system_deps: SystemDeps = "auto"
    jobs: int | None = None
    sdist: Path | None = None
    allow_untested: bool = False
    debug_info: bool = False
    """Compile with ``-g``, as Horovod's own build does (``RelWithDebInfo``). Left out by
    default, deliberately: the C++ compiles in less time and the wheel is a fraction of the
    size (docs/guides/install.md has the figures); keep it to step through Horovod's C++ in
    a debugger."""

    def __post_init__(self) -> None:
        unknown = set(self.frameworks) - set(FRAMEWORKS)
        if unknown or not self.frameworks:
            raise ValueError(
                f"--frameworks: {','.join(sorted(unknown)) or '(none)'} is not one of "
                f"{', '.join(FRAMEWORKS)}; give at least one, e.g. --frameworks torch,tensorflow"
            )
        unknown_controllers = set(self.controllers) - set(CONTROLLERS)
        if unknown_controllers or not self.controllers:
            raise ValueError(
                f"--controllers: {','.join(sorted(unknown_controllers)) or '(none)'} is not one of "
                f"{', '.join(CONTROLLERS)}; e.g. --controllers gloo,mpi"
            )
        if self.gpu_operations not in (None, "NCCL"):
            raise ValueError(
                f"--gpu-operations {self.gpu_operations}: only NCCL is supported (or leave it out "
                "for a CPU build)"
            )
        if self.cuda_arch_list and not self.gpu_operations:
            raise ValueError("--cuda-arch needs --gpu-operations NCCL")
        for arch in self.cuda_arch_list:
            if not arch.isdigit():
                raise ValueError(f"--cuda-arch {arch}: expected compute capabilities like 80,90")
        if self.system_deps not in SYSTEM_DEPS_MODES:
            raise ValueError(f"--system-deps {self.system_deps}: use one of {SYSTEM_DEPS_MODES}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs}: must be at least 1")

    @property
    def wheel_dir(self) -> Path:
        return self.cache_dir / "wheels"

    @property
    def sdist_dir(self) -> Path:
        return self.cache_dir / "sdist"

    @property
    def log_dir(self) -> Path:
        return self.cache_dir / "logs"


@dataclass(frozen=True, kw_only=True)
class BuildEnv:
    """What was found on the machine (see :func:`hvdkit.horovod_build.probe.probe`). All
    versions are strings as the tools print them, ``None`` when absent."""

    python_version: str
    python_tag: str
    platform: str
    torch_version: str | None = None
    torch_cxx11_abi: bool | None = None
    torch_include_dir: str | None = None
    torch_cuda: str | None = None  # the CUDA a CUDA build of torch was made for, e.g. "13.0"
    cuda_toolkit_wheels: str | None = None  # the `cuda-toolkit` meta-package installed, if any
    tensorflow_version: str | None = None
    tf_include_dir: str | None = None
    tf_has_highwayhash: bool = True
    tf_has_farmhash: bool = True
    tf_has_legacy_xla_builder: bool = True
    tf_has_moved_xla_builder: bool = False
    system_highwayhash: bool = False
    system_farmhash: bool = False
    compiler: str | None = None
    compiler_id: str | None = None
    compiler_version: str | None = None
    cmake: str | None = None
    cmake_version: str | None = None
    mpi_implementation: str | None = None
    mpi_version: str | None = None
    mpicxx: str | None = None
    cuda_home: str | None = None  # the toolkit hvdkit chose (horovod_build.cuda); None if none
    cuda_version: str | None = None
    cuda_source: str | None = None
    cuda_passed_over: tuple[str, ...] = ()  # candidates not chosen, each with why
    nccl_version: str | None = None
    nccl_lib_dir: str | None = None
    nccl_include_dir: str | None = None
    gpu_compute_capabilities: tuple[str, ...] = ()
    cpu_count: int = 1
    memory_gib: float = 4.0
    is_root: bool = False
    has_apt: bool = False
    python_headers: bool = True

    def framework_version(self, name: str) -> str | None:
        """The installed version of framework ``name`` (``torch``, ``tensorflow``)."""
        return {"torch": self.torch_version, "tensorflow": self.tensorflow_version}[name]

    def has_framework(self, name: str) -> bool:
        return self.framework_version(name) is not None
