"""This host's NVIDIA GPUs as ``nvidia-smi`` reports them (no framework imported), and the
rules hvdkit checks against them before a launch (``hvdkit run``) and in ``hvdkit doctor``:

- with a NCCL build, one rank per GPU: NCCL refuses two ranks on one GPU (``Duplicate GPU
  detected``) only once the job is running; without NCCL, ranks may share a GPU (Gloo and MPI
  stage GPU tensors through host memory);
- each GPU's compute capability in the arch list Horovod was compiled for (Horovod compiles
  its kernels for those architectures only, with no PTX to fall back on);
- a driver that runs the CUDA version Horovod and torch were built with;
- the NCCL loaded at run time no older than the one Horovod was compiled against.

The parsers and rules are pure; :func:`probe` runs nvidia-smi."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from hvdkit import envvars
from hvdkit.horovod_build.versions import version_tuple

QUERY = ("--query-gpu=index,name,compute_cap,driver_version", "--format=csv,noheader")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: str  # "90" for compute capability 9.0, as --cuda-arch takes it


@dataclass(frozen=True)
class GpuProbe:
    """What nvidia-smi said. ``smi`` is None when it is not installed (no NVIDIA driver)."""

    smi: str | None
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None  # e.g. "580.65.06"
    driver_cuda: str | None = None  # the newest CUDA this driver runs, e.g. "13.0"
    error: str | None = None  # nvidia-smi is there but failed (a broken driver)


def parse_query(text: str) -> tuple[tuple[Gpu, ...], str | None]:
    """``nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv,noheader``:
    the GPUs and the driver version."""
    gpus, driver = [], None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            continue
        index, name, cap, driver = fields
        gpus.append(Gpu(int(index), name, cap.replace(".", "")))
    return tuple(gpus), driver


def parse_driver_cuda(text: str) -> str | None:
    """The ``CUDA Version: 13.0`` of nvidia-smi's header: the newest CUDA the driver runs."""
    match = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return match.group(1) if match else None


def visible(gpus: tuple[Gpu, ...], cuda_visible_devices: str | None) -> tuple[Gpu, ...]:
    """The GPUs a process sees under ``CUDA_VISIBLE_DEVICES`` (unset: all; empty: none).
    Indices select by index; other forms (UUIDs, MIG names) keep as many GPUs as listed."""
    if cuda_visible_devices is None:
        return gpus
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if all(e.isdigit() for e in entries):
        by_index = {g.index: g for g in gpus}
        # CUDA stops at the first index that does not exist.
        chosen = []
        for entry in entries:
            if int(entry) not in by_index:
                break
            chosen.append(by_index[int(entry)])
        return tuple(chosen)
    return gpus[: len(entries)]


def probe(env: Mapping[str, str] = os.environ) -> GpuProbe:
    """Run nvidia-smi; the GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return GpuProbe(None)
    try:
        query = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=60)
        header = subprocess.run([smi], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return GpuProbe(smi, error=str(exc))
    if query.returncode != 0:
        return GpuProbe(smi, error=(query.stderr or query.stdout).strip()[:300])
    gpus, driver = parse_query(query.stdout)
    return GpuProbe(
        smi,
        visible(gpus, env.get(envvars.CUDA_VISIBLE_DEVICES)),
        driver,
        parse_driver_cuda(header.stdout),
    )


def shared_gpu_problem(local_ranks: int, gpus: int, nccl: bool) -> str | None:
    """Why ``local_ranks`` processes on a host with ``gpus`` GPUs cannot run; None when they
    can. No GPU is a CPU run; more ranks than GPUs share them, except under NCCL."""
    if not nccl or gpus == 0 or local_ranks <= gpus:
        return None
    return (
        f"{local_ranks} processes on this host but {gpus} GPU(s) visible, and this Horovod "
        "reduces GPU tensors with NCCL, which refuses two ranks on one GPU (it fails only "
        f"once the job runs). Fix: at most {gpus} process(es) per host (-np, or slots= in the "
        "hostfile), or check CUDA_VISIBLE_DEVICES; to share GPUs, use a Horovod built without "
        "NCCL (hvdkit build-horovod without --gpu-operations), whose Gloo/MPI stage GPU "
        "tensors through host memory"
    )


def arch_problem(gpus: tuple[Gpu, ...], archs: list[str]) -> str | None:
    """Which visible GPUs Horovod's kernels were not compiled for; None when all were (or the
    build recorded no arch list)."""
    if not archs:
        return None
    missing = [g for g in gpus if g.capability not in archs]
    if not missing:
        return None
    names = "; ".join(
        f"GPU {g.index} {g.name} (compute capability {g.capability})" for g in missing
    )
    return f"{names}: not in the arch list this Horovod was built for ({','.join(archs)})"


def arch_fix(gpus: tuple[Gpu, ...], archs: list[str]) -> str:
    wanted = sorted({*archs, *(g.capability for g in gpus)}, key=int)
    return f"hvdkit build-horovod --gpu-operations NCCL --cuda-arch {','.join(wanted)} --force"


def driver_problem(driver_cuda: str | None, runtime_cuda: str | None) -> str | None:
    """Why this driver cannot run CUDA ``runtime_cuda``; None when it can (a newer driver
    runs older CUDA; within a major version, CUDA's minor version compatibility)."""
    have, need = version_tuple(driver_cuda or ""), version_tuple(runtime_cuda or "")
    if not have or not need or have[:1] >= need[:1]:
        return None
    return (
        f"the NVIDIA driver runs CUDA up to {driver_cuda}, but this Horovod and PyTorch use "
        f"CUDA {runtime_cuda}"
    )


def nccl_problem(built: str | None, loaded: str | None) -> str | None:
    """Why the NCCL loaded at run time does not serve a Horovod compiled against ``built``."""
    if built is None:
        return None
    if loaded is None:
        return f"Horovod was compiled against NCCL {built}, but no libnccl.so.2 can be loaded"
    if version_tuple(loaded) < version_tuple(built):
        return f"NCCL {loaded} is loaded, older than the {built} Horovod was compiled against"
    return None


def nccl_version_code(code: int) -> str:
    """``ncclGetVersion``'s integer as a version: 23007 is 2.30.7 (and 2708 is 2.7.8, the
    encoding before NCCL 2.9)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
