"""The sync guard on a GPU (issue 38, item 3): run on a machine with CUDA torch, no Horovod
needed. For a 50M-parameter model and ResNet-50 on ``cuda:0``, prints the guard's time, the
growth of host peak RSS and of CUDA memory while it runs (the fingerprint is taken on the GPU,
a chunk at a time: three numbers a tensor come to the host), against the whole-model float64
host copy it replaced, and a ResNet-50 training step's time for scale.

    python tests/gpu_sync_guard.py
"""

from __future__ import annotations

import ast
import resource
import time
from pathlib import Path

import torch

from hvdkit import sync

ROOT = Path(__file__).resolve().parents[1]


def load_fingerprint():
    """hvdkit.torch.session's ``_fingerprint``, taken from its source: importing the module
    needs Horovod, which this check does not."""
    tree = ast.parse((ROOT / "hvdkit/torch/session.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_fingerprint")
    namespace = {"torch": torch, "sync": sync}
    exec(compile(ast.Module([node], []), "session.py", "exec"), namespace)
    return namespace["_fingerprint"]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, model: torch.nn.Module, fingerprint) -> None:
    params = [p.detach() for p in model.parameters()]
    weights = sum(p.numel() for p in params) * 4 / 2**20
    fingerprint(torch.ones(10, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cuda_before, host_before = torch.cuda.memory_allocated(), peak_mib()
    started = time.perf_counter()
    local = torch.stack([fingerprint(p) for p in params]).cpu().numpy()
    seconds = time.perf_counter() - started
    cuda_growth = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
    host_growth = peak_mib() - host_before
    print(f"{name}: {weights:.0f} MiB of weights; guard {seconds * 1e3:.1f} ms; host peak "
          f"+{host_growth:.1f} MiB ({host_growth / weights:.1%}); CUDA peak +{cuda_growth:.1f} "
          f"MiB ({cuda_growth / weights:.1%})", flush=True)  # fmt: skip
    started, host_before = time.perf_counter(), peak_mib()
    whole = sync.fingerprint([p.cpu().double().numpy() for p in params])
    print(f"  before (every tensor to the host in float64): {(time.perf_counter() - started) * 1e3:.1f}"
          f" ms, host peak +{peak_mib() - host_before:.1f} MiB; same fingerprint: "
          f"{bool(abs(whole - local).max() <= 1e-9 * (abs(whole).max() + 1))}", flush=True)  # fmt: skip


def main() -> None:
    fingerprint = load_fingerprint()
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    big = torch.nn.Sequential(torch.nn.Linear(5000, 5000), torch.nn.Linear(5000, 5000)).cuda()
    measure("50M-parameter MLP", big, fingerprint)
    import torchvision

    resnet = torchvision.models.resnet50().cuda()
    measure("ResNet-50", resnet, fingerprint)
    opt = torch.optim.SGD(resnet.parameters(), lr=0.01)
    x = torch.randn(256, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (256,), device="cuda")
    for i in range(8):
        if i == 3:
            torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(resnet(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    step = (time.perf_counter() - started) / 5
    print(f"ResNet-50 bf16 step, batch 256: {step * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
