"""The concrete build: environment, the compiler wrapper (executed for real), forwarding
headers, the wheel cache, and the first-error summary of a failed build log."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

from stacks import CUDA_TORCH, TODAY

from hvdkit.horovod_build.cache import WheelCache, cache_inputs, cache_key
from hvdkit.horovod_build.config import BuildConfig
from hvdkit.horovod_build.logscan import first_error, summarize_failure
from hvdkit.horovod_build.recipe import compile_jobs, make_recipe, wrapper_script
from hvdkit.horovod_build.remedies import plan_remedies


def _fake_compiler(tmp_path: Path) -> Path:
    fake = tmp_path / "fake-g++"
    fake.write_text('#!/bin/sh\nfor a; do echo "$a"; done\n')
    fake.chmod(0o755)
    return fake


def test_wrapper_rewrites_old_standards_and_keeps_other_args(tmp_path):
    wrapper = tmp_path / "c++"
    wrapper.write_text(wrapper_script(str(_fake_compiler(tmp_path)), "c++17", ("string",)))
    wrapper.chmod(0o755)
    args = ["-std=c++11", "-O3", "-std=gnu++14", "-DX=a b", "-std=c++20", "-c", "x.cc"]
    out = subprocess.run([str(wrapper), *args], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "-include",
        "string",
        "-std=c++17",
        "-O3",
        "-std=c++17",
        "-DX=a b",
        "-std=c++20",
        "-c",
        "x.cc",
    ]


def test_recipe_for_todays_stack(tmp_path):
    cfg = BuildConfig(cache_dir=tmp_path)
    recipe = make_recipe(TODAY, cfg, plan_remedies(TODAY, cfg), {"PATH": "/usr/bin"})
    env = recipe.materialize(tmp_path)
    assert env["HOROVOD_WITH_PYTORCH"] == env["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert env["HOROVOD_WITH_GLOO"] == env["HOROVOD_WITH_MPI"] == "1"
    assert env["HOROVOD_WITHOUT_MXNET"] == "1"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert env["CXX"] == f"{tmp_path}/bin/c++"
    assert env["MAKEFLAGS"] == "-j2"
    assert env["CPLUS_INCLUDE_PATH"] == f"{tmp_path}/include"
    forward = tmp_path / "include/tensorflow/compiler/xla/client/xla_builder.h"
    assert forward.read_text() == '#include "xla/hlo/builder/xla_builder.h"\n'
    assert "std=c++17" in (tmp_path / "bin/c++").read_text()


def test_wrapper_drops_debug_info_flags_unless_asked(tmp_path):
    args = ["-O3", "-g", "-DNDEBUG", "-g3", "-ggdb", "-gdwarf-4", "-gsplit-dwarf", "-Dg=-g", "-c",
            "x.cc"]  # fmt: skip
    for std in ("c++17", None):  # with the standard's rewrite, and alone
        wrapper = tmp_path / f"c++-{std}"
        wrapper.write_text(wrapper_script(str(_fake_compiler(tmp_path)), std, (),
                                          drop_debug_info=True))  # fmt: skip
        wrapper.chmod(0o755)
        out = subprocess.run([str(wrapper), *args], capture_output=True, text=True, check=True)
        # -gsplit-dwarf asks for no debug info by itself (it only splits what -g makes).
        assert out.stdout.splitlines() == ["-O3", "-DNDEBUG", "-gsplit-dwarf", "-Dg=-g", "-c",
                                           "x.cc"]  # fmt: skip
    for debug_info in (True, False):
        cfg = BuildConfig(cache_dir=tmp_path, debug_info=debug_info)
        script = make_recipe(TODAY, cfg, plan_remedies(TODAY, cfg), {"PATH": "/b"}).files["bin/c++"]
        assert ("-g|" in script) is not debug_info


def test_debug_info_is_its_own_cache_key():
    with_g, without = (cache_key(TODAY, BuildConfig(debug_info=d)) for d in (True, False))
    assert with_g != without
    assert "debug_info" not in cache_inputs(TODAY, BuildConfig())


def test_recipe_without_remedies_leaves_compiler_alone(tmp_path):
    env = dataclasses.replace(TODAY, torch_version="2.0.1", cmake_version="3.25.1")
    cfg = BuildConfig(frameworks=("torch",), controllers=("gloo",), cache_dir=tmp_path,
                      debug_info=True)  # fmt: skip
    built = make_recipe(env, cfg, plan_remedies(env, cfg), {"PATH": "/usr/bin"}).materialize(
        tmp_path
    )
    assert "CXX" not in built and "CMAKE_POLICY_VERSION_MINIMUM" not in built
    assert built["HOROVOD_WITHOUT_TENSORFLOW"] == built["HOROVOD_WITHOUT_MPI"] == "1"


def test_nccl_links_make_libnccl_so(tmp_path):
    wheel = tmp_path / "wheel"
    (wheel / "lib").mkdir(parents=True)
    (wheel / "include").mkdir()
    (wheel / "lib/libnccl.so.2").write_text("lib")
    env = dataclasses.replace(
        TODAY,
        nccl_lib_dir=str(wheel / "lib"),
        nccl_include_dir=str(wheel / "include"),
        nccl_version="2.28.3",
        cuda_home="/usr/local/cuda",
        gpu_compute_capabilities=("90",),
    )
    cfg = BuildConfig(frameworks=("torch",), gpu_operations="NCCL", cache_dir=tmp_path)
    work = tmp_path / "work"
    built = make_recipe(env, cfg, plan_remedies(env, cfg), {}).materialize(work)
    assert built["HOROVOD_NCCL_HOME"] == f"{work}/nccl"
    assert (work / "nccl/lib/libnccl.so").read_text() == "lib"
    assert built["HOROVOD_GPU_OPERATIONS"] == "NCCL"


def test_jobs_bounded_by_memory():
    cfg = BuildConfig(cache_dir=Path("/c"))
    assert compile_jobs(dataclasses.replace(TODAY, cpu_count=16, memory_gib=8), cfg, {}) == 2
    assert compile_jobs(dataclasses.replace(TODAY, cpu_count=16, memory_gib=1), cfg, {}) == 1
    assert compile_jobs(TODAY, cfg, {"HVDKIT_BUILD_JOBS": "5"}) == 5
    assert compile_jobs(TODAY, BuildConfig(jobs=3, cache_dir=Path("/c")), {}) == 3


def test_wheel_cache_store_and_lookup(tmp_path):
    cache = WheelCache(tmp_path / "wheels")
    assert cache.lookup("k") is None
    built = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    built.write_bytes(b"wheel")
    stored = cache.store("k", built, {"inputs": {"torch": "2.13.0"}})
    assert cache.lookup("k") == stored and stored.read_bytes() == b"wheel"
    assert json.loads((stored.parent / "build.json").read_text())["inputs"]["torch"] == "2.13.0"
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == ["k"]  # no staging left


LOG = """\
-- Configuring done
[ 40%] Building CXX object horovod/torch/CMakeFiles/pytorch.dir/mpi_ops_v2.cc.o
warning: treat warnings as errors with -Werror is off
In file included from /venv/torch/include/c10/util/C++17.h:1,
/venv/torch/include/c10/util/C++17.h:13:2: error: #error C++17 or later compatible compiler is required to use PyTorch.
   13 | #error C++17 or later compatible compiler is required to use PyTorch.
      |  ^~~~~
compilation terminated.
/x/y.cc:9:1: error: later error
make[2]: *** [CMakeFiles/pytorch.dir/build.make:76] Error 1
"""


def test_first_error_and_known_fix():
    lines = LOG.splitlines()
    found = first_error(lines)
    assert found is not None and found.line_number == 5
    assert found.known is not None and found.known.key == "cxx17"
    text = summarize_failure(lines, "/cache/logs/x.log")
    assert "(log line 5)" in text and "later error" not in text
    assert "-std=c++17" in text and "Full log: /cache/logs/x.log" in text
    assert len(text.splitlines()) < 12


def test_first_error_recognises_each_known_failure():
    samples = {
        "cmake-policy": "CMake Error at third_party/gloo/CMakeLists.txt:1 (cmake_minimum_required):"
        "\n  Compatibility with CMake < 3.5 has been removed from CMake.",
        "tf-hash-headers": "tensorflow/core/platform/hash.h:3:10: fatal error: "
        "highwayhash/arch_specific.h: No such file or directory",
        "xla-builder-header": "xla_mpi_ops.cc:27:10: fatal error: "
        "tensorflow/compiler/xla/client/xla_builder.h: No such file",
        "gcc13-includes": "group_table.h:12:8: error: 'string' in namespace 'std' does not "
        "name a type",
        "out-of-memory": "c++: fatal error: Killed signal terminated program cc1plus",
        "build-isolation": "ModuleNotFoundError: No module named 'packaging'",
    }
    for key, text in samples.items():
        found = first_error(["noise", *text.splitlines(), "more noise"])
        assert found is not None and found.known is not None and found.known.key == key, key


def test_no_error_shows_the_tail():
    text = summarize_failure([f"line {i}" for i in range(100)], "/l.log")
    assert "line 99" in text and "line 10\n" not in text


def test_wrapper_gives_cxx20_only_to_units_that_include_torch(tmp_path):
    """torch >= 2.14: Horovod's -std=c++14 (and a C++17 flag) becomes -std=c++20 where the
    unit names torch's include dir; every other unit keeps the C++17 rewrite."""
    include = "/venv/site-packages/torch/include"
    wrapper = tmp_path / "c++"
    wrapper.write_text(wrapper_script(str(_fake_compiler(tmp_path)), "c++17", (), "c++20", include))
    wrapper.chmod(0o755)

    def run(*args: str) -> list[str]:
        return subprocess.run(
            [str(wrapper), *args], capture_output=True, text=True, check=True
        ).stdout.splitlines()

    torch_unit = ["-isystem", include, "-std=gnu++14", "-std=c++17", "-c", "torch/ops.cc"]
    assert run(*torch_unit) == ["-isystem", include, "-std=c++20", "-std=c++20", "-c",
                                "torch/ops.cc"]  # fmt: skip
    assert run(f"-I{include}/api", "-std=c++14") == [f"-I{include}/api", "-std=c++20"]
    assert run("-I/tf/include", "-std=c++14", "-std=gnu++17") == [
        "-I/tf/include", "-std=c++17", "-std=gnu++17"
    ]  # fmt: skip


def test_recipe_for_a_cuda_torch_puts_the_toolkit_first_on_path(tmp_path):
    cfg = BuildConfig(frameworks=("torch",), cache_dir=tmp_path)
    built = make_recipe(
        CUDA_TORCH, cfg, plan_remedies(CUDA_TORCH, cfg), {"PATH": "/usr/local/bin:/usr/bin"}
    ).materialize(tmp_path)
    assert built["PATH"].split(":")[:2] == [f"{tmp_path}/cuda/bin", "/usr/local/cuda/bin"]
    assert built["PATH"].endswith("/usr/local/bin:/usr/bin")
    assert built["CUDA_HOME"] == built["CUDAToolkit_ROOT"] == "/usr/local/cuda"
    script = (tmp_path / "bin/c++").read_text()
    assert "std=c++20" in script and CUDA_TORCH.torch_include_dir in script
    # CUDA 13: CMake's CUDA compiler is the nvcc wrapper, which runs the chosen toolkit's nvcc.
    assert built["HOROVOD_CUDA_HOME"] == f"{tmp_path}/cuda"
    nvcc = (tmp_path / "cuda/bin/nvcc").read_text()
    assert "exec /usr/local/cuda/bin/nvcc" in nvcc and "std=c++17" in nvcc


# The two errors a torch 2.15 CUDA build hit (issue 24), each after torch's NumPy warning,
# which the scan used to report as the first error.
CXX20_LOG = """\
-- Found Pytorch: 2.15.0+cu132
/venv/lib/python3.12/site-packages/torch/_subclasses/functional_tensor.py:283: UserWarning: \
Failed to initialize NumPy: No module named 'numpy' (Triggered internally at torch/csrc/utils/\
tensor_numpy.cpp:84.)
[ 95%] Building CXX object horovod/torch/CMakeFiles/pytorch.dir/mpi_ops_v2.cc.o
In file included from /venv/lib/python3.12/site-packages/torch/include/ATen/ATen.h:1,
/venv/lib/python3.12/site-packages/torch/include/ATen/ATen.h:9:2: error: #error C++20 or later \
compatible compiler is required to use ATen.
    9 | #error C++20 or later compatible compiler is required to use ATen.
make[2]: *** [horovod/torch/CMakeFiles/pytorch.dir/build.make:90] Error 1
"""
CUDA_LOG = """\
UserWarning: Failed to initialize NumPy: No module named 'numpy'
CMake Error at /venv/lib/python3.12/site-packages/cmake/data/share/cmake-4.4/Modules/\
FindPackageHandleStandardArgs.cmake:290 (message):
  Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART) (found version
  "13.0.88")
Call Stack (most recent call first):
  horovod/torch/CMakeLists.txt:23 (add_cuda)
"""


def test_log_scan_skips_warnings_and_knows_the_cxx20_and_cuda_errors():
    for log, key, line in ((CXX20_LOG, "cxx20", 5), (CUDA_LOG, "torch-cuda", 2)):
        found = first_error(log.splitlines())
        assert found is not None and found.line_number == line, (key, found)
        assert found.known is not None and found.known.key == key
        text = summarize_failure(log.splitlines(), "/l.log")
        assert f"(log line {line})" in text and "Fix: " in text


def test_cuda_from_the_nvidia_wheels_gets_their_lib_dir_and_a_libcudart_link(tmp_path):
    cu13 = tmp_path / "site-packages/nvidia/cu13"
    (cu13 / "lib").mkdir(parents=True)
    (cu13 / "lib/libcudart.so.13").write_text("cudart")
    env = dataclasses.replace(
        TODAY, torch_version="2.14.1", torch_cuda="13.0", cuda_home=str(cu13),
        cuda_version="13.0", cuda_source="nvidia wheels",
    )  # fmt: skip
    cfg = BuildConfig(frameworks=("torch",), cache_dir=tmp_path)
    remedies = plan_remedies(env, cfg)
    assert "cuda-wheels" in [r.key for r in remedies]
    work = tmp_path / "work"
    built = make_recipe(env, cfg, remedies, {}).materialize(work)
    assert built["LIBRARY_PATH"] == f"{cu13}/lib:{work}/cuda-lib"
    assert built["CMAKE_LIBRARY_PATH"].split(":")[0] == f"{work}/cuda-lib"
    assert (work / "cuda-lib/libcudart.so").read_text() == "cudart"
    # A system toolkit (lib64/, libcudart.so present) needs none of it.
    system = dataclasses.replace(env, cuda_home="/usr/local/cuda", cuda_source="/usr/local/cuda")
    assert "cuda-wheels" not in [r.key for r in plan_remedies(system, cfg)]
