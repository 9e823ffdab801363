"""``hvdkit doctor``'s GPU section: the visible GPUs against what the installed Horovod was
built for (:mod:`hvdkit.gpus` holds the rules). :func:`gpu_checks` is pure; the NCCL version
loaded at run time comes from :func:`loaded_nccl`, which asks a subprocess."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from hvdkit import gpus as rules
from hvdkit.doctor.checks import FAIL, PASS, SKIP, Check
from hvdkit.gpus import GpuProbe
from hvdkit.horovod_build import record

# Import Horovod's extension the way a training script does (the framework first, which loads
# its own NCCL), then ask the libnccl in this process for its version. No GPU is needed.
NCCL_PROBE = """
import ctypes, importlib, sys
importlib.import_module(sys.argv[1])
path = next((l.split()[-1] for l in open("/proc/self/maps") if "libnccl.so" in l), "")
code = ctypes.c_int(0)
if path:
    ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
print(code.value, path)
"""


def loaded_nccl(inputs: dict[str, Any]) -> tuple[str | None, str]:
    """The NCCL version a rank of this Horovod loads, and from where (or why unknown)."""
    module = "horovod.torch" if "torch" in inputs.get("frameworks", []) else "horovod.tensorflow"
    try:
        out = subprocess.run(
            [sys.executable, "-c", NCCL_PROBE, module], capture_output=True, text=True,
            timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"import {module} did not finish in 300 s"
    fields = out.stdout.split()
    if out.returncode != 0 or not fields or fields[0] == "0":
        tail = out.stderr.strip().splitlines()[-1:] or ["no libnccl.so in the process"]
        return None, f"import {module}: {tail[0][:200]}"
    return rules.nccl_version_code(int(fields[0])), fields[1] if len(fields) > 1 else ""


def _built(inputs: dict[str, Any]) -> str:
    parts = [
        f"CUDA {inputs['cuda']}" if inputs.get("cuda") else "",
        f"arch {','.join(inputs['cuda_arch'])}" if inputs.get("cuda_arch") else "",
        f"NCCL {inputs['nccl']}" if inputs.get("nccl") else "",
    ]
    return ", ".join(p for p in parts if p)


def gpu_checks(
    probe: GpuProbe, inputs: dict[str, Any], nccl: tuple[str | None, str] | None = None
) -> list[Check]:
    """The GPU lines: the GPUs, then (for a CUDA build, with a GPU) the arch list and the
    driver, then (for a NCCL build) the NCCL loaded. ``inputs`` are the build record's;
    ``nccl`` is :func:`loaded_nccl`'s answer, given for a NCCL build only."""
    cuda_build = bool(inputs.get("cuda") or inputs.get("torch_cuda"))
    if probe.error:
        return [Check(FAIL, "GPUs", f"nvidia-smi failed: {probe.error}",
                      "check the NVIDIA driver (nvidia-smi must work)")]  # fmt: skip
    checks = []
    if not probe.gpus:
        why = "nvidia-smi not found" if probe.smi is None else "nvidia-smi lists none"
        if cuda_build:
            checks.append(Check(
                SKIP, "GPUs",
                f"none visible ({why}): the GPU checks (architecture, driver) were skipped; "
                f"this Horovod is built for GPUs ({_built(inputs)}) and runs CPU tensors "
                "through Gloo/MPI here",
            ))  # fmt: skip
        else:
            checks.append(Check(PASS, "GPUs", f"none visible ({why}): CPU-only runs"))
    else:
        listed = "; ".join(
            f"GPU {g.index} {g.name} (compute capability {g.capability[:-1]}.{g.capability[-1]})"
            for g in probe.gpus
        )
        checks.append(Check(PASS, "GPUs", f"{len(probe.gpus)} visible: {listed}"))
        archs = list(inputs.get("cuda_arch") or [])
        if archs:
            problem = rules.arch_problem(probe.gpus, archs)
            checks.append(
                Check(FAIL, "GPU architecture", problem, rules.arch_fix(probe.gpus, archs))
                if problem
                else Check(PASS, "GPU architecture",
                           f"every GPU is in the arch list built for ({','.join(archs)})")
            )  # fmt: skip
        runtime = inputs.get("cuda") or inputs.get("torch_cuda")
        if runtime:
            problem = rules.driver_problem(probe.driver_cuda, runtime)
            detail = (
                f"driver {probe.driver} runs CUDA up to {probe.driver_cuda}; this Horovod and "
                f"PyTorch use CUDA {runtime}"
            )
            major = (probe.driver_cuda or "?").split(".")[0]
            checks.append(
                Check(FAIL, "CUDA driver", problem,
                      f"install an NVIDIA driver for CUDA {runtime} or newer, or a PyTorch built "
                      f"for CUDA {major} and then hvdkit build-horovod --force")
                if problem
                else Check(PASS, "CUDA driver", detail)
            )  # fmt: skip
    built_nccl = inputs.get("nccl")
    if nccl is not None and built_nccl:
        loaded, where = nccl
        problem = rules.nccl_problem(built_nccl, loaded)
        checks.append(
            Check(FAIL, "NCCL", f"{problem} ({where})",
                  f"pip install 'nvidia-nccl-cu{runtime_major(inputs)}>={built_nccl}' in "
                  "this environment (or put that NCCL first on LD_LIBRARY_PATH)")
            if problem
            else Check(PASS, "NCCL", f"{loaded} loaded from {where} (built against {built_nccl})")
        )  # fmt: skip
    return checks


def runtime_major(inputs: dict[str, Any]) -> str:
    return str(inputs.get("cuda") or inputs.get("torch_cuda") or "13").split(".")[0]


def gpu_section() -> list[Check]:
    """The GPU lines for this machine and the installed Horovod's build record."""
    built = record.read()
    inputs = built.inputs if built is not None else {}
    nccl = loaded_nccl(inputs) if built is not None and built.nccl else None
    return gpu_checks(rules.probe(), inputs, nccl)
