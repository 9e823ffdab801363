"""Which fixes a Horovod build needs on this machine: a pure function of :class:`BuildEnv`.

Every remedy answers one failure measured on today's toolchain (see docs/guides/troubleshooting.md's
troubleshooting table, generated from :data:`KNOWN_FAILURES`). Remedies are chosen only when
the probed versions call for them, so a machine that does not need a fix does not get it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hvdkit.horovod_build.config import BuildConfig, BuildEnv
from hvdkit.horovod_build.versions import at_least


@dataclass(frozen=True)
class KnownFailure:
    """A build error seen in the wild: how to recognise it in a log and what fixes it."""

    key: str
    pattern: str
    symptom: str
    cause: str
    fix: str

    def matches(self, line: str) -> bool:
        return re.search(self.pattern, line) is not None


KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    KnownFailure(
        "cmake-policy",
        r"Compatibility with CMake < 3\.5 has been removed",
        "Compatibility with CMake < 3.5 has been removed from CMake",
        "CMake >= 4 rejects Gloo's old cmake_minimum_required",
        "hvdkit sets CMAKE_POLICY_VERSION_MINIMUM=3.5 when CMake >= 4; by hand, export it "
        "or point HOROVOD_CMAKE at a CMake 3.x",
    ),
    KnownFailure(
        "cxx17",
        r"C\+\+17 or later compatible compiler is required",
        "#error C++17 or later compatible compiler is required to use PyTorch",
        "Horovod 0.28.1 compiles its PyTorch extension as C++14; PyTorch >= 2.1 needs C++17",
        "hvdkit builds through a compiler wrapper that turns -std=c++11/14 into -std=c++17",
    ),
    KnownFailure(
        "cxx20",
        r"C\+\+20 or later compatible compiler is required",
        "ATen/ATen.h: #error C++20 or later compatible compiler is required to use ATen",
        "PyTorch >= 2.14's headers need C++20 (concepts, operator<=>); Horovod asks for C++14",
        "hvdkit's compiler wrapper gives -std=c++20 to the units that include PyTorch when "
        "torch >= 2.14 (gcc or clang >= 10 needed); rebuild with this hvdkit",
    ),
    KnownFailure(
        "torch-cuda",
        r"Could NOT find CUDAToolkit",
        "Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART), from "
        "horovod/torch/CMakeLists.txt (add_cuda)",
        "torch is a CUDA build, so Horovod adds CUDA; torch found a CUDA home (an nvcc on PATH) "
        "whose prefix has no headers or libcudart",
        "hvdkit chooses a complete toolkit and gives it to torch and CMake (CUDA_HOME, "
        "HOROVOD_CUDA_HOME); `hvdkit build-horovod --plan` shows which, or says what to install",
    ),
    KnownFailure(
        "nvcc-cxx17",
        r"error: a constexpr function must contain exactly one return statement",
        "error: a constexpr function must contain exactly one return statement (bits/utility.h, "
        "compiling cuda_kernels.cu)",
        "Horovod compiles its CUDA kernels as C++11 (CMAKE_CUDA_STANDARD 11); CUDA 13's nvcc "
        "and today's libstdc++ need C++17",
        "hvdkit gives CMake an nvcc wrapper that turns -std=c++11/14 into -std=c++17 for "
        "CUDA >= 13",
    ),
    KnownFailure(
        "cuda-wheels",
        r"cannot find -l(cudadevrt|cudart_static)",
        "ld: cannot find -lcudadevrt / -lcudart_static (CMake's CUDA compiler check, nvcc "
        "from the nvidia wheels)",
        "the nvidia wheels put CUDA's libraries in lib/, where nvcc's own profile looks in "
        "lib64/, and ship libcudart.so.N without the libcudart.so CMake looks for",
        "hvdkit adds the wheels' lib/ to the linker's path (LIBRARY_PATH) and a libcudart.so "
        "link for CMake when the toolkit is the nvidia wheels",
    ),
    KnownFailure(
        "build-isolation",
        r"ModuleNotFoundError: No module named '(packaging|torch|tensorflow)'",
        "No module named 'packaging' / torch not found during the build",
        "pip's build isolation hides the installed frameworks from Horovod's setup.py",
        "install the frameworks first, then build with pip --no-build-isolation "
        "(hvdkit always does)",
    ),
    KnownFailure(
        "gcc13-includes",
        r"'(string|runtime_error|invalid_argument)' (in namespace 'std' )?does not name a type|"
        r"'std::(string|runtime_error)' has not been declared",
        "'string' in namespace 'std' does not name a type (group_table.h)",
        "gcc >= 13 no longer includes <string>/<stdexcept> transitively",
        "hvdkit force-includes <string> and <stdexcept> when the compiler is gcc >= 13",
    ),
    KnownFailure(
        "tf-hash-headers",
        r"(highwayhash/[a-z_]+\.h|farmhash\.h): No such file",
        "highwayhash/arch_specific.h: No such file, then farmhash.h: No such file",
        "TensorFlow's wheel ships headers that include highwayhash and farmhash, but not them",
        "install Debian's libhighwayhash-dev and libfarmhash-dev (hvdkit does so as root)",
    ),
    KnownFailure(
        "xla-builder-header",
        r"tensorflow/compiler/xla/client/xla_builder\.h: No such file",
        "tensorflow/compiler/xla/client/xla_builder.h: No such file (xla_mpi_ops.cc)",
        "XLA moved the header to xla/hlo/builder/xla_builder.h",
        "hvdkit puts a one-line forwarding header on the include path",
    ),
    KnownFailure(
        "setup-requires",
        r"(Could not find a version that satisfies the requirement cffi|"
        r"No matching distribution found for cffi)",
        "setup fails fetching cffi>=1.4.0 without internet",
        "Horovod's setup.py lists cffi in setup_requires",
        "hvdkit installs cffi (and Horovod's runtime dependencies) before building",
    ),
    KnownFailure(
        "out-of-memory",
        r"(Killed signal terminated program cc1plus|internal compiler error: Killed)",
        "c++: fatal error: Killed signal terminated program cc1plus",
        "too many parallel compile jobs for the memory (TensorFlow units take ~2-3 GiB each)",
        "lower the parallelism: hvdkit build-horovod --jobs 1 (or HVDKIT_BUILD_JOBS=1)",
    ),
)

BUILD_REQUIREMENTS = ("cffi", "packaging", "pyyaml", "cloudpickle", "psutil", "setuptools", "wheel")
"""Installed before the build (setup_requires and runtime deps that --no-deps leaves out)."""

MPI_PACKAGES = ("openmpi-bin", "libopenmpi-dev")
TF_HASH_PACKAGES = ("libhighwayhash-dev", "libfarmhash-dev")
GPU_GCC = "13"


@dataclass(frozen=True)
class Remedy:
    """One fix applied to the build, with the reason it was chosen for this machine."""

    key: str
    reason: str
    env: dict[str, str] = field(default_factory=dict)
    cxx_std: str | None = None
    torch_cxx_std: str | None = None  # for the units that include PyTorch's headers
    nvcc_std: str | None = None  # for nvcc's own -std (the CUDA kernels)
    path_prepend: tuple[str, ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()  # (path in the build dir, target)
    force_includes: tuple[str, ...] = ()
    forward_headers: tuple[tuple[str, str], ...] = ()
    system_packages: tuple[str, ...] = ()
    pip_packages: tuple[str, ...] = ()


def plan_remedies(env: BuildEnv, cfg: BuildConfig) -> list[Remedy]:
    """The remedies this machine needs to build ``cfg``, in the order they are applied."""
    plan: list[Remedy] = [
        Remedy(
            "build-isolation",
            "always: Horovod compiles against the installed frameworks, which pip's build "
            "isolation would hide",
            pip_packages=BUILD_REQUIREMENTS,
        )
    ]
    if env.cmake is None:
        plan.append(
            Remedy(
                "cmake-policy",
                "no CMake found: installing CMake from PyPI (4.x), which needs the policy floor",
                env={"CMAKE_POLICY_VERSION_MINIMUM": "3.5"},
                pip_packages=("cmake",),
            )
        )
    elif at_least(env.cmake_version, "4"):
        plan.append(
            Remedy(
                "cmake-policy",
                f"CMake {env.cmake_version} >= 4 rejects Gloo's cmake_minimum_required",
                env={"CMAKE_POLICY_VERSION_MINIMUM": "3.5"},
            )
        )
    if "torch" in cfg.frameworks and at_least(env.torch_version, "2.14"):
        plan.append(
            Remedy(
                "cxx20",
                f"PyTorch {env.torch_version} >= 2.14's headers need C++20; Horovod asks for "
                "C++14: units that include PyTorch get -std=c++20, the rest -std=c++17",
                cxx_std="c++17",
                torch_cxx_std="c++20",
            )
        )
    elif "torch" in cfg.frameworks and at_least(env.torch_version, "2.1"):
        plan.append(
            Remedy(
                "cxx17",
                f"PyTorch {env.torch_version} >= 2.1 needs C++17; Horovod asks for C++14",
                cxx_std="c++17",
            )
        )
    if "torch" in cfg.frameworks and env.torch_cuda and env.cuda_home:
        plan.append(_torch_cuda_remedy(env))
    if env.compiler_id == "gcc" and at_least(env.compiler_version, GPU_GCC):
        plan.append(
            Remedy(
                "gcc13-includes",
                f"gcc {env.compiler_version} >= 13 no longer includes <string>/<stdexcept> "
                "transitively",
                force_includes=("string", "stdexcept"),
            )
        )
    if "tensorflow" in cfg.frameworks and env.tensorflow_version is not None:
        missing = not (env.tf_has_highwayhash and env.tf_has_farmhash)
        if missing:
            plan.append(
                Remedy(
                    "tf-hash-headers",
                    f"TensorFlow {env.tensorflow_version}'s headers include highwayhash and "
                    "farmhash but its wheel does not ship them",
                    system_packages=TF_HASH_PACKAGES,
                )
            )
        if not env.tf_has_legacy_xla_builder and env.tf_has_moved_xla_builder:
            plan.append(
                Remedy(
                    "xla-builder-header",
                    f"TensorFlow {env.tensorflow_version} moved xla_builder.h to xla/hlo/builder/",
                    forward_headers=(
                        (
                            "tensorflow/compiler/xla/client/xla_builder.h",
                            "xla/hlo/builder/xla_builder.h",
                        ),
                    ),
                )
            )
    if "mpi" in cfg.controllers and env.mpi_implementation is None:
        plan.append(
            Remedy(
                "mpi",
                "MPI controller requested and no MPI found: installing Open MPI",
                system_packages=MPI_PACKAGES,
            )
        )
    if cfg.gpu_operations == "NCCL":
        plan.append(_nccl_remedy(env, cfg))
    uses_nvcc = any(r.key in ("torch-cuda", "nccl") for r in plan)
    if uses_nvcc and env.cuda_source == "nvidia wheels":
        plan.append(_cuda_wheels_remedy(env))
    if uses_nvcc and at_least(env.cuda_version, "13"):
        plan.append(
            Remedy(
                "nvcc-cxx17",
                f"CUDA {env.cuda_version}'s nvcc no longer compiles C++11, which Horovod asks for "
                "its CUDA kernels: an nvcc wrapper turns -std=c++11/14 into -std=c++17",
                nvcc_std="c++17",
            )
        )
    return plan


def _torch_cuda_remedy(env: BuildEnv) -> Remedy:
    home = env.cuda_home or ""
    return Remedy(
        "torch-cuda",
        f"PyTorch {env.torch_version} is a CUDA {env.torch_cuda} build, so Horovod compiles "
        f"CUDA support into its extension: with the toolkit hvdkit chose, {home} "
        f"(CUDA {env.cuda_version}), given to both torch and CMake",
        env={"CUDA_HOME": home, "HOROVOD_CUDA_HOME": home, "CUDAToolkit_ROOT": home},
        path_prepend=(f"{home}/bin",),
    )


def _cuda_wheels_remedy(env: BuildEnv) -> Remedy:
    lib = f"{env.cuda_home}/lib"
    major = (env.cuda_version or "13").split(".")[0]
    return Remedy(
        "cuda-wheels",
        "the CUDA toolkit is the nvidia wheels, whose libraries are in lib/ (nvcc looks in "
        "lib64/) with no libcudart.so: their lib/ goes on the linker's path, and a "
        "libcudart.so link is made for CMake",
        env={
            "LIBRARY_PATH": f"{lib}:{{workdir}}/cuda-lib",
            "CMAKE_LIBRARY_PATH": f"{{workdir}}/cuda-lib:{lib}",
        },
        symlinks=(("cuda-lib/libcudart.so", f"{lib}/libcudart.so.{major}"),),
    )


def _nccl_remedy(env: BuildEnv, cfg: BuildConfig) -> Remedy:
    archs = cfg.cuda_arch_list or env.gpu_compute_capabilities
    gpu_env = {"HOROVOD_GPU_OPERATIONS": "NCCL"}
    if archs:
        # Horovod's default arch list starts at sm_35, which CUDA >= 12 cannot compile.
        gpu_env["HOROVOD_BUILD_CUDA_CC_LIST"] = ",".join(archs)
    if env.cuda_home:
        gpu_env["HOROVOD_CUDA_HOME"] = env.cuda_home
    reason = f"NCCL build for compute capabilities {','.join(archs) or '(none found)'}"
    links: tuple[tuple[str, str], ...] = ()
    if env.nccl_lib_dir and env.nccl_include_dir:
        # The nvidia-nccl wheel ships only libnccl.so.2; the linker wants libnccl.so.
        reason += f"; NCCL {env.nccl_version} from the nvidia-nccl wheel (libnccl.so link added)"
        lib = f"{env.nccl_lib_dir}/libnccl.so.2"
        links = (("nccl/include", env.nccl_include_dir), ("nccl/lib/libnccl.so", lib),
                 ("nccl/lib/libnccl.so.2", lib))  # fmt: skip
        gpu_env.update(HOROVOD_NCCL_HOME="{workdir}/nccl", HOROVOD_NCCL_LINK="SHARED")
    return Remedy("nccl", reason, env=gpu_env, symlinks=links)


def first_known_failure(line: str) -> KnownFailure | None:
    """The known failure a log line shows, if any."""
    for failure in KNOWN_FAILURES:
        if failure.matches(line):
            return failure
    return None
