"""Probed machines used by the unit tests."""

import dataclasses

from hvdkit.horovod_build.config import BuildEnv

# This project's CI machine as probed (Debian 12, gcc 12, pip's CMake 4, TF 2.21, torch 2.13).
TODAY = BuildEnv(
    python_version="3.11.7",
    python_tag="cp311",
    platform="linux-x86_64",
    torch_version="2.13.0+cpu",
    tensorflow_version="2.21.0",
    tf_include_dir="/tf/include",
    tf_has_highwayhash=False,
    tf_has_farmhash=False,
    tf_has_legacy_xla_builder=False,
    tf_has_moved_xla_builder=True,
    compiler="/usr/bin/c++",
    compiler_id="gcc",
    compiler_version="12.2.0",
    cmake="/venv/bin/cmake",
    cmake_version="4.4.4",
    mpi_implementation="openmpi",
    mpi_version="4.1.4",
    mpicxx="/usr/bin/mpicxx",
    cpu_count=2,
    memory_gib=23.4,
    is_root=True,
    has_apt=True,
)
# What Horovod 0.28.1 was released against: nothing needs fixing.
OLD = dataclasses.replace(
    TODAY,
    torch_version="2.0.1",
    tensorflow_version="2.12.0",
    tf_has_highwayhash=True,
    tf_has_farmhash=True,
    tf_has_legacy_xla_builder=True,
    tf_has_moved_xla_builder=False,
    cmake_version="3.25.1",
)
# A new user's venv (issue 24): Python 3.12, PyPI's default torch (a CUDA 13 build), no GPU,
# the toolkit hvdkit chose from the nvidia wheels beside torch; TensorFlow not installed.
CUDA_TORCH = dataclasses.replace(
    TODAY,
    python_version="3.12.1",
    python_tag="cp312",
    torch_version="2.15.0",
    torch_include_dir="/venv/lib/python3.12/site-packages/torch/include",
    torch_cuda="13.0",
    tensorflow_version=None,
    cuda_home="/usr/local/cuda",
    cuda_version="13.0",
    cuda_source="/usr/local/cuda",
    cuda_passed_over=("/usr/local (nvcc on PATH): missing a working bin/nvcc",),
)
