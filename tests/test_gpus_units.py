"""The GPU rules (hvdkit.gpus) and doctor's GPU section (hvdkit.doctor.gpu), pure, on the
formats nvidia-smi prints. What needs a GPU runs on a lent GPU machine (docs/guides/gpus.md)."""

from __future__ import annotations

from hvdkit import gpus
from hvdkit.doctor.gpu import gpu_checks
from hvdkit.gpus import Gpu, GpuProbe

# nvidia-smi 570 on an H100 machine: the query, and the header line with the driver's CUDA.
QUERY = "0, NVIDIA H100 80GB HBM3, 9.0, 570.124.06\n1, NVIDIA H100 80GB HBM3, 9.0, 570.124.06\n"
HEADER = (
    "| NVIDIA-SMI 570.124.06             Driver Version: 570.124.06     CUDA Version: 12.8     |"
)
H100S = (Gpu(0, "NVIDIA H100 80GB HBM3", "90"), Gpu(1, "NVIDIA H100 80GB HBM3", "90"))
NCCL_BUILD = {"frameworks": ["torch"], "gpu_operations": "NCCL", "cuda": "13.0",
              "cuda_arch": ["90"], "nccl": "2.30.7", "torch_cuda": "13.0"}  # fmt: skip


def test_parsers_read_what_nvidia_smi_prints():
    assert gpus.parse_query(QUERY) == (H100S, "570.124.06")
    assert gpus.parse_query("") == ((), None)
    assert gpus.parse_driver_cuda(HEADER) == "12.8"
    assert gpus.nccl_version_code(23007) == "2.30.7"
    assert gpus.nccl_version_code(2708) == "2.7.8"


def test_cuda_visible_devices_as_cuda_reads_it():
    assert gpus.visible(H100S, None) == H100S
    assert gpus.visible(H100S, "") == ()
    assert gpus.visible(H100S, "1") == (H100S[1],)
    assert gpus.visible(H100S, "1,7,0") == (H100S[1],)  # CUDA stops at an index it lacks
    assert gpus.visible(H100S, "GPU-8f3c1e2a-0000") == (H100S[0],)


def test_ranks_share_gpus_except_under_nccl():
    assert gpus.shared_gpu_problem(2, 1, nccl=False) is None
    assert gpus.shared_gpu_problem(2, 0, nccl=True) is None  # a CPU run
    assert gpus.shared_gpu_problem(2, 2, nccl=True) is None
    problem = gpus.shared_gpu_problem(2, 1, nccl=True)
    assert "2 processes on this host but 1 GPU(s)" in problem and "at most 1" in problem


def test_arch_driver_and_nccl_rules():
    assert gpus.arch_problem(H100S, ["90"]) is None
    assert "GPU 0 NVIDIA H100 80GB HBM3 (compute capability 90)" in gpus.arch_problem(
        H100S, ["80"]
    )
    assert gpus.arch_fix(H100S, ["80"]).endswith("--cuda-arch 80,90 --force")
    assert gpus.driver_problem("12.8", "13.0") is not None
    assert gpus.driver_problem("13.0", "13.0") is None and gpus.driver_problem("13.2", "13.0") is None
    assert gpus.driver_problem("13.0", "13.1") is None  # CUDA's minor version compatibility
    assert gpus.nccl_problem("2.30.7", "2.28.3") is not None
    assert gpus.nccl_problem("2.30.7", None) is not None
    assert gpus.nccl_problem("2.30.7", "2.30.7") is None and gpus.nccl_problem(None, None) is None


def test_doctor_without_a_gpu():
    cpu = gpu_checks(GpuProbe(None), {"frameworks": ["torch"]})
    assert [c.render() for c in cpu] == ["PASS  GPUs: none visible (nvidia-smi not found): CPU-only runs"]
    nccl = gpu_checks(GpuProbe(None), NCCL_BUILD, ("2.30.7", "/venv/nvidia/nccl/lib/libnccl.so.2"))
    assert nccl[0].status == "SKIP" and "GPU checks (architecture, driver) were skipped" in nccl[0].detail
    assert "CUDA 13.0, arch 90, NCCL 2.30.7" in nccl[0].detail
    assert nccl[1].render().startswith("PASS  NCCL: 2.30.7 loaded from /venv/nvidia/nccl/lib")


def test_doctor_on_gpus_fails_with_the_fix():
    probe = GpuProbe("/usr/bin/nvidia-smi", H100S, "570.124.06", "12.8")
    checks = {c.name: c for c in gpu_checks(probe, {**NCCL_BUILD, "cuda_arch": ["80"]},
                                            ("2.28.3", "/usr/lib/libnccl.so.2"))}  # fmt: skip
    assert checks["GPUs"].status == "PASS" and "compute capability 9.0" in checks["GPUs"].detail
    assert checks["GPU architecture"].status == "FAIL"
    assert "--cuda-arch 80,90" in checks["GPU architecture"].fix
    assert checks["CUDA driver"].status == "FAIL" and "CUDA 13.0 or newer" in checks["CUDA driver"].fix
    assert checks["NCCL"].status == "FAIL" and "nvidia-nccl-cu13>=2.30.7" in checks["NCCL"].fix
    good = gpu_checks(GpuProbe("/usr/bin/nvidia-smi", H100S, "580.65.06", "13.0"), NCCL_BUILD,
                      ("2.30.7", "libnccl.so.2"))  # fmt: skip
    assert [c.status for c in good] == ["PASS"] * 4
    broken = gpu_checks(GpuProbe("/usr/bin/nvidia-smi", error="Failed to initialize NVML"), {})
    assert broken[0].status == "FAIL" and "driver" in broken[0].fix
