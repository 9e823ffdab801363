"""Unit tests of the build helper's pure decisions: remedies, prerequisites, cache key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from stacks import CUDA_TORCH, OLD, TODAY

from hvdkit.horovod_build.cache import cache_key
from hvdkit.horovod_build.config import BuildConfig, BuildEnv
from hvdkit.horovod_build.cuda import CudaCandidate, choose_toolkit, toolkit_fix
from hvdkit.horovod_build.prereqs import find_problems, missing_system_packages
from hvdkit.horovod_build.remedies import Remedy, plan_remedies
from hvdkit.horovod_build.versions import version_tuple

CFG = BuildConfig(cache_dir=Path("/cache"))


def keys(env: BuildEnv, cfg: BuildConfig = CFG) -> list[str]:
    return [r.key for r in plan_remedies(env, cfg)]


def test_todays_stack_gets_every_cpu_remedy():
    assert keys(TODAY) == [
        "build-isolation",
        "cmake-policy",
        "cxx17",
        "tf-hash-headers",
        "xla-builder-header",
    ]


def test_old_stack_gets_only_build_isolation():
    assert keys(OLD) == ["build-isolation"]


def test_remedies_follow_each_version_boundary():
    assert "cmake-policy" not in keys(dataclasses.replace(TODAY, cmake_version="3.31.6"))
    assert "cmake-policy" in keys(dataclasses.replace(TODAY, cmake_version="4.0.0"))
    assert "cxx17" not in keys(dataclasses.replace(TODAY, torch_version="2.0.1"))
    assert "cxx17" in keys(dataclasses.replace(TODAY, torch_version="2.1.0"))
    assert "gcc13-includes" not in keys(TODAY)
    assert "gcc13-includes" in keys(dataclasses.replace(TODAY, compiler_version="13.3.0"))
    assert "gcc13-includes" not in keys(
        dataclasses.replace(TODAY, compiler_id="clang", compiler_version="16.0.6")
    )


def test_framework_remedies_only_for_requested_frameworks():
    torch_only = BuildConfig(frameworks=("torch",), cache_dir=Path("/c"))
    assert keys(TODAY, torch_only) == ["build-isolation", "cmake-policy", "cxx17"]
    tf_only = BuildConfig(frameworks=("tensorflow",), cache_dir=Path("/c"))
    assert "cxx17" not in keys(TODAY, tf_only)


def test_missing_cmake_installs_pip_cmake_with_policy():
    remedy = next(
        r
        for r in plan_remedies(dataclasses.replace(TODAY, cmake=None), CFG)
        if r.key == "cmake-policy"
    )
    assert remedy.pip_packages == ("cmake",)
    assert remedy.env == {"CMAKE_POLICY_VERSION_MINIMUM": "3.5"}


def test_system_packages_only_those_missing():
    assert missing_system_packages(TODAY, plan_remedies(TODAY, CFG)) == [
        "libhighwayhash-dev",
        "libfarmhash-dev",
    ]
    present = dataclasses.replace(TODAY, system_highwayhash=True, system_farmhash=True)
    assert missing_system_packages(present, plan_remedies(present, CFG)) == []
    no_mpi = dataclasses.replace(present, mpi_implementation=None, compiler=None)
    assert missing_system_packages(no_mpi, plan_remedies(no_mpi, CFG)) == [
        "openmpi-bin",
        "libopenmpi-dev",
        "g++",
    ]
    gloo_only = BuildConfig(controllers=("gloo",), cache_dir=Path("/c"))
    assert missing_system_packages(no_mpi, plan_remedies(no_mpi, gloo_only)) == ["g++"]


def test_non_root_gets_one_paragraph_naming_packages():
    user = dataclasses.replace(TODAY, is_root=False, mpi_implementation=None)
    packages = missing_system_packages(user, plan_remedies(user, CFG))
    (problem,) = find_problems(user, CFG, packages)
    text = str(problem)
    assert "not running as root" in text
    assert "sudo apt-get install -y libhighwayhash-dev libfarmhash-dev openmpi-bin" in text
    assert "--controllers gloo" in text


def test_missing_framework_and_compiler_are_reported():
    env = dataclasses.replace(TODAY, tensorflow_version=None, compiler=None)
    text = "\n".join(map(str, find_problems(env, CFG, [])))
    assert "No C++ compiler found" in text and "CXX=" in text
    assert "TensorFlow is not installed" in text and "leave tensorflow out" in text


def test_gpu_build_needs_cuda_nccl_and_arch():
    gpu = BuildConfig(gpu_operations="NCCL", cache_dir=Path("/c"))
    text = "\n".join(map(str, find_problems(TODAY, gpu, [])))
    assert "CUDA toolkit" in text and "nvidia-nccl" in text and "--cuda-arch" in text
    env = dataclasses.replace(
        TODAY,
        cuda_home="/usr/local/cuda",
        cuda_version="13.0",
        nccl_version="2.28.3",
        nccl_lib_dir="/n/lib",
        nccl_include_dir="/n/include",
        gpu_compute_capabilities=("90",),
        compiler_version="13.3.0",
    )
    assert find_problems(env, gpu, []) == []
    nccl = next(r for r in plan_remedies(env, gpu) if r.key == "nccl")
    assert nccl.env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert nccl.env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert "gcc13-includes" in keys(env, gpu)
    explicit = BuildConfig(gpu_operations="NCCL", cuda_arch_list=("80", "90"), cache_dir=Path("/c"))
    nccl = next(r for r in plan_remedies(env, explicit) if r.key == "nccl")
    assert nccl.env["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"


def test_cache_key_changes_with_binary_inputs_only():
    base = cache_key(TODAY, CFG)
    assert base.startswith("horovod-0.28.1-cp311-")
    assert cache_key(TODAY, CFG) == base
    for change in (
        {"torch_version": "2.14.1"},
        {"tensorflow_version": "2.20.0"},
        {"compiler_version": "13.3.0"},
        {"python_tag": "cp312"},
        {"mpi_version": "5.0.11"},
    ):
        assert cache_key(dataclasses.replace(TODAY, **change), CFG) != base, change
    # Things that do not change the compiled wheel do not invalidate it.
    for same in (
        {"cpu_count": 16},
        {"memory_gib": 128.0},
        {"cmake_version": "3.31.0"},
        {"is_root": False},
    ):
        assert cache_key(dataclasses.replace(TODAY, **same), CFG) == base, same
    assert cache_key(TODAY, BuildConfig(cache_dir=Path("/elsewhere"))) == base
    torch_only = BuildConfig(frameworks=("torch",), cache_dir=Path("/c"))
    assert cache_key(TODAY, torch_only) != base
    # A torch-only wheel does not depend on the TensorFlow version.
    assert cache_key(
        dataclasses.replace(TODAY, tensorflow_version="2.20.0"), torch_only
    ) == cache_key(TODAY, torch_only)
    gpu = BuildConfig(gpu_operations="NCCL", cuda_arch_list=("90",), cache_dir=Path("/c"))
    gpu2 = BuildConfig(gpu_operations="NCCL", cuda_arch_list=("80",), cache_dir=Path("/c"))
    assert cache_key(TODAY, gpu) != cache_key(TODAY, gpu2) != base


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"frameworks": ("mxnet",)}, "--frameworks: mxnet"),
        ({"frameworks": ()}, "--frameworks"),
        ({"controllers": ("nccl",)}, "--controllers: nccl"),
        ({"gpu_operations": "ROCM"}, "only NCCL"),
        ({"cuda_arch_list": ("90",)}, "--cuda-arch needs --gpu-operations"),
        ({"gpu_operations": "NCCL", "cuda_arch_list": ("sm_90",)}, "compute capabilities"),
        ({"jobs": 0}, "--jobs 0"),
        ({"system_deps": "yum"}, "--system-deps yum"),
    ],
)
def test_config_rejects_bad_input_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        BuildConfig(**kwargs)


def test_version_tuple():
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert version_tuple("4.0.0-rc1") == (4, 0, 0)
    assert version_tuple("13") == (13,)
    assert version_tuple("dev") == ()


TORCH_ONLY = BuildConfig(frameworks=("torch",), cache_dir=Path("/c"))


def test_cxx_standard_follows_torch():
    def remedy(version: str) -> Remedy | None:
        env = dataclasses.replace(TODAY, torch_version=version)
        return next((r for r in plan_remedies(env, CFG) if r.key.startswith("cxx")), None)

    assert remedy("2.0.1") is None
    assert (remedy("2.1.0").key, remedy("2.1.0").cxx_std) == ("cxx17", "c++17")
    assert remedy("2.13.0+cpu").torch_cxx_std is None
    for version in ("2.14.0", "2.14.1", "2.15.0+cu132"):
        found = remedy(version)
        assert (found.key, found.cxx_std, found.torch_cxx_std) == ("cxx20", "c++17", "c++20")


def test_cuda_torch_gets_the_chosen_toolkit_for_torch_and_cmake():
    remedies = plan_remedies(CUDA_TORCH, TORCH_ONLY)
    assert [r.key for r in remedies] == [
        "build-isolation", "cmake-policy", "cxx20", "torch-cuda", "nvcc-cxx17"
    ]  # fmt: skip
    cuda = remedies[-2]
    assert cuda.env == {
        "CUDA_HOME": "/usr/local/cuda",
        "HOROVOD_CUDA_HOME": "/usr/local/cuda",
        "CUDAToolkit_ROOT": "/usr/local/cuda",
    }
    assert cuda.path_prepend == ("/usr/local/cuda/bin",)
    assert find_problems(CUDA_TORCH, TORCH_ONLY, []) == []
    # CUDA 12's nvcc still compiles Horovod's C++11 kernels.
    cuda12 = dataclasses.replace(CUDA_TORCH, torch_cuda="12.8", cuda_version="12.8")
    assert "nvcc-cxx17" not in keys(cuda12, TORCH_ONLY) and "torch-cuda" in keys(cuda12, TORCH_ONLY)
    # A CPU torch, or a build without torch, gets no CUDA.
    assert "torch-cuda" not in keys(dataclasses.replace(CUDA_TORCH, torch_cuda=None), TORCH_ONLY)


def test_cuda_torch_without_a_usable_toolkit_stops_with_the_pip_line():
    none = dataclasses.replace(CUDA_TORCH, cuda_home=None, cuda_version=None)
    assert "torch-cuda" not in keys(none, TORCH_ONLY)
    (problem,) = find_problems(none, TORCH_ONLY, [])
    text = str(problem)
    assert "CUDA 13.0 build" in text and "/usr/local (nvcc on PATH)" in text
    assert "pip install 'cuda-toolkit[nvcc,cccl]==13.0.*'" in text
    assert "CPU build of PyTorch" in text
    # torch >= 2.14 depends on the cuda-toolkit meta-package: the same release, with nvcc.
    wheels = dataclasses.replace(none, cuda_toolkit_wheels="13.0.3")
    assert "pip install 'cuda-toolkit[nvcc,cccl]==13.0.3'" in str(find_problems(wheels, TORCH_ONLY, [])[0])


def test_toolkit_choice_takes_the_first_complete_one_of_torchs_major():
    def cand(home: str, version: str | None = "13.0", headers=True, cudart=True):
        return CudaCandidate(home, home, version, headers, cudart)

    shim = cand("/usr/local", version=None, headers=False, cudart=False)
    old = cand("/opt/cuda-12", version="12.8")
    full = cand("/usr/local/cuda")
    chosen, passed = choose_toolkit((shim, old, full), "13.0")
    assert chosen == full
    assert passed == [
        "/usr/local (/usr/local): missing a working bin/nvcc, include/cuda_runtime.h, "
        "lib/libcudart",
        "/opt/cuda-12 (/opt/cuda-12): CUDA 12.8, but torch is built for CUDA 13.0",
    ]
    assert choose_toolkit((shim, old), "13.0")[0] is None
    assert choose_toolkit((old,), None)[0] == old  # a CPU torch: any complete toolkit (NCCL)
    assert toolkit_fix("12.8").startswith("install the CUDA 12 toolkit")


def test_cache_key_has_the_cuda_part_for_a_cuda_torch():
    base = cache_key(CUDA_TORCH, TORCH_ONLY)
    assert cache_key(dataclasses.replace(CUDA_TORCH, cuda_version="13.1"), TORCH_ONLY) != base
    assert cache_key(dataclasses.replace(CUDA_TORCH, torch_cuda="13.2"), TORCH_ONLY) != base
    cpu = dataclasses.replace(CUDA_TORCH, torch_cuda=None)
    assert cache_key(dataclasses.replace(cpu, cuda_version="13.1"), TORCH_ONLY) == cache_key(
        cpu, TORCH_ONLY
    )


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"python_version": "3.14.0"}, "Python 3.14.0 is outside the range"),
        ({"python_version": "3.10.13"}, "Python 3.10.13 is outside the range"),
        ({"torch_version": "2.16.0"}, "PyTorch 2.16.0 is newer than any release"),
        ({"torch_version": "1.4.0"}, "PyTorch 1.4.0 is older than Horovod 0.28.1 supports"),
        ({"tensorflow_version": "2.22.0"}, "TensorFlow 2.22.0 is newer"),
        ({"compiler_version": "9.4.0"}, "gcc 9.4.0 (/usr/bin/c++) predates it"),
    ],
)
def test_untested_versions_and_old_compilers_stop_before_the_compile(change, expected):
    env = dataclasses.replace(TODAY, **{"torch_version": "2.14.1", **change})
    text = "\n".join(map(str, find_problems(env, CFG, [])))
    assert expected in text
    untested = "--allow-untested" in text
    allowed = BuildConfig(allow_untested=True, cache_dir=Path("/c"))
    assert bool(find_problems(env, allowed, [])) != untested  # the flag lifts only the range
    # The newest known minor's patch releases are known, and 3.11 to 3.13 are tested.
    for ok in ({"torch_version": "2.15.9"}, {"python_version": "3.13.0"}):
        assert find_problems(dataclasses.replace(TODAY, **ok), CFG, []) == []
