"""What must be on the machine before Horovod can compile, and what to say when it is not.

Pure functions of :class:`BuildEnv`: each problem is one paragraph that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdkit.horovod_build.config import FRAMEWORK_NAMES, BuildConfig, BuildEnv
from hvdkit.horovod_build.cuda import toolkit_fix
from hvdkit.horovod_build.remedies import Remedy
from hvdkit.horovod_build.versions import (
    CXX20_COMPILERS,
    KNOWN_RANGES,
    PYTHON_TESTED,
    at_least,
    in_range,
)

STACK_FILE = "hvdkit/horovod_build/stack-cpu.txt"


@dataclass(frozen=True)
class Problem:
    """A missing prerequisite: what is wrong, and the command or flag that fixes it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}\n  Fix: {self.fix}"


def missing_system_packages(env: BuildEnv, remedies: list[Remedy]) -> list[str]:
    """Debian packages the chosen remedies need that are not installed yet."""
    present = set()
    if env.system_highwayhash:
        present.add("libhighwayhash-dev")
    if env.system_farmhash:
        present.add("libfarmhash-dev")
    wanted: list[str] = []
    for remedy in remedies:
        wanted += [p for p in remedy.system_packages if p not in present and p not in wanted]
    if env.compiler is None:
        wanted.append("g++")
    if not env.python_headers:
        wanted.append("python3-dev")
    return wanted


def find_problems(env: BuildEnv, cfg: BuildConfig, packages_to_install: list[str]) -> list[Problem]:
    """Everything that would make the build fail, given that ``packages_to_install`` are
    still missing (empty when they were installed or can be)."""
    problems: list[Problem] = []
    if packages_to_install:
        why = (
            "hvdkit is not running as root"
            if not env.is_root
            else (
                "apt-get is not available" if not env.has_apt else "--system-deps check was given"
            )
        )
        problems.append(
            Problem(
                f"The Horovod build needs these system packages, which are missing: "
                f"{' '.join(packages_to_install)}. They cannot be installed because {why}.",
                f"sudo apt-get install -y {' '.join(packages_to_install)} (Debian/Ubuntu), then "
                "run the build again; or run `sudo make setup` / `sudo hvdkit build-horovod`"
                " so hvdkit installs them itself."
                + (
                    " To build without MPI instead: --controllers gloo."
                    if "libopenmpi-dev" in packages_to_install
                    else ""
                ),
            )
        )
    if env.compiler is None and "g++" not in packages_to_install:
        problems.append(
            Problem(
                "No C++ compiler found (looked at $CXX, c++ and g++). Horovod is C++ and is "
                "compiled on install.",
                "apt-get install -y g++ (Debian/Ubuntu), or set CXX=/path/to/g++.",
            )
        )
    for name in cfg.frameworks:
        if not env.has_framework(name):
            pretty = FRAMEWORK_NAMES[name]
            problems.append(
                Problem(
                    f"--frameworks includes {name}, but {pretty} is not installed in this "
                    f"Python ({env.python_version}). Horovod is built against the installed "
                    "framework, so it must come first.",
                    f"pip install the pinned versions from {STACK_FILE} (or your own), or "
                    f"leave {name} out of --frameworks.",
                )
            )
    if cfg.gpu_operations == "NCCL":
        problems += _gpu_problems(env, cfg)
    if "torch" in cfg.frameworks and env.torch_cuda and env.cuda_home is None:
        problems.append(_no_toolkit_problem(env))
    problems += _compiler_problems(env, cfg)
    if not cfg.allow_untested:
        problems += _untested_problems(env, cfg)
    return problems


def _no_toolkit_problem(env: BuildEnv) -> Problem:
    looked = "; ".join(env.cuda_passed_over) or "no candidate directory exists"
    return Problem(
        f"PyTorch {env.torch_version} is a CUDA {env.torch_cuda} build, so Horovod compiles CUDA "
        "support into its PyTorch extension, and that needs a CUDA toolkit (nvcc, "
        f"cuda_runtime.h, libcudart) of CUDA {env.torch_cuda}. None was usable: {looked}.",
        f"{toolkit_fix(env.torch_cuda, env.cuda_toolkit_wheels)}; or install a CPU build of "
        "PyTorch.",
    )


def _compiler_problems(env: BuildEnv, cfg: BuildConfig) -> list[Problem]:
    minimum = CXX20_COMPILERS.get(env.compiler_id or "")
    needs_cxx20 = "torch" in cfg.frameworks and at_least(env.torch_version, "2.14")
    too_old = minimum is not None and not at_least(env.compiler_version, minimum)
    if not needs_cxx20 or env.compiler_version is None or not too_old:
        return []
    return [
        Problem(
            f"PyTorch {env.torch_version}'s headers need C++20, and {env.compiler_id} "
            f"{env.compiler_version} ({env.compiler}) predates it ({env.compiler_id} >= "
            f"{minimum} needed).",
            "install a newer compiler (e.g. apt-get install -y g++-12) and point CXX at it, or "
            "use PyTorch <= 2.13, which needs only C++17.",
        )
    ]


def _untested_problems(env: BuildEnv, cfg: BuildConfig) -> list[Problem]:
    problems = []
    low, high = PYTHON_TESTED
    if not in_range(env.python_version, low, high):
        problems.append(
            Problem(
                f"Python {env.python_version} is outside the range hvdkit's build is tested on "
                f"({low} to {high}).",
                f"use Python {low} to {high} (make setup PYTHON=python{high}), or try anyway "
                "with hvdkit build-horovod --allow-untested.",
            )
        )
    for name in cfg.frameworks:
        version = env.framework_version(name)
        low, high = KNOWN_RANGES[name]
        if version and not in_range(version, low, high):
            side = (
                "older than Horovod 0.28.1 supports"
                if not at_least(version, low)
                else "newer than any release hvdkit's build remedies are known for"
            )
            problems.append(
                Problem(
                    f"{FRAMEWORK_NAMES[name]} {version} is {side} ({low} to {high}.x).",
                    f"install {FRAMEWORK_NAMES[name]} {low} to {high} (the pins in {STACK_FILE}"
                    " are tested), or try anyway with hvdkit build-horovod --allow-untested.",
                )
            )
    return problems


def _gpu_problems(env: BuildEnv, cfg: BuildConfig) -> list[Problem]:
    problems = []
    if env.cuda_home is None:
        problems.append(
            Problem(
                "--gpu-operations NCCL needs a CUDA toolkit (nvcc, cuda_runtime.h, "
                "libcudart), and none was usable: "
                f"{'; '.join(env.cuda_passed_over) or 'no candidate directory exists'}.",
                f"{toolkit_fix(env.torch_cuda, env.cuda_toolkit_wheels)}; or build for CPU by "
                "leaving out --gpu-operations.",
            )
        )
    if env.nccl_lib_dir is None:
        problems.append(
            Problem(
                "--gpu-operations NCCL needs NCCL, and no nvidia-nccl wheel or system NCCL "
                "was found.",
                "pip install nvidia-nccl-cu13 (or -cu12, matching your CUDA), or set "
                "HOROVOD_NCCL_HOME to an NCCL install.",
            )
        )
    if not (cfg.cuda_arch_list or env.gpu_compute_capabilities):
        problems.append(
            Problem(
                "No GPU is visible here, so hvdkit cannot tell which CUDA architectures to "
                "compile for (Horovod's default list includes ones CUDA >= 12 rejects).",
                "give them explicitly, e.g. --cuda-arch 80,90 for A100 and H100.",
            )
        )
    return problems
