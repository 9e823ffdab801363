"""Unit tests of the build helper's pure decisions: remedies, prerequisites, cache key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from stacks import OLD, TODAY

from hvdkit.build.cache import cache_key
from hvdkit.build.config import BuildConfig, BuildEnv
from hvdkit.build.prereqs import find_problems, missing_system_packages
from hvdkit.build.remedies import plan_remedies, version_tuple

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
