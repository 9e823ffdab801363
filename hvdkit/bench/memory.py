"""``hvdkit bench``'s memory section: ``python -m hvdkit.bench.memory`` under a launcher.

A multi-layer perceptron with Adam, its optimizer plain (Horovod's ``DistributedOptimizer``
through hvdkit.torch) or sharded (ZeRO stage 1, :mod:`hvdkit.torch.zero`):

- ``--variant plain|sharded|gradients``: one variant per process (``gradients``: ZeRO
  stage 2, ``shard_optimizer="gradients"``), so that its peak resident memory is
  its own. Reports rank 0's bytes of weights, gradients and optimizer state (counted from
  the tensors), the resident memory's growth over the first three steps, its peak, the peak
  above what the process held before the model (each rank's, and the highest of them), the
  CUDA peak on a GPU, and the median step time.
- ``--variant speed``: both variants in one process on the same initial weights, in
  alternating rounds; the median of the per-round ratios (plain time / sharded time, so 1.0
  is as fast). With more than one rank it also times allreduces of a few sizes to fit the
  link's latency and bandwidth (:mod:`hvdkit.bench.costmodel`).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _state_bytes(optimizer: Any) -> int:
    inner = getattr(optimizer, "_hvdkit_inner", None) or optimizer
    return sum(
        v.numel() * v.element_size()
        for entry in inner.state.values()
        for v in entry.values()
        if hasattr(v, "numel") and v.dim() > 0
    )


def _grads_bytes(model: Any, optimizer: Any) -> int:
    """The gradients a rank holds between steps: every parameter's, or under ZeRO stage 2
    the reduced gradient of its slice only."""
    groups = getattr(optimizer, "_hvdkit_groups", [])
    if groups and all(g.stage2 for g in groups):
        return sum(g.slice_grad.numel() * g.slice_grad.element_size() for g in groups)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("plain", "sharded", "gradients", "speed"),
                        required=True)  # fmt: skip
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)

    import torch

    import hvdkit.torch as hvd
    from hvdkit.bench import costmodel
    from hvdkit.bench.worker import emit
    from hvdkit.devices import cores_per_process
    from hvdkit.torch import zero
    from hvdkit.torch.zero import ShardedOptimizer

    hvd.init()
    torch.set_num_threads(cores_per_process(hvd.local_size()))
    # An optimizer's first step imports torch's compiler modules (about 75 MB), which every
    # variant pays alike and which is not the model's memory: paid before the start.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)]).step()
    start_rss = _rss()  # before any model: what the variant adds is measured from here
    # Ranks beyond the GPUs share them (two ranks on one GPU measure memory as well as two).
    device = (
        torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        if torch.cuda.is_available()
        else None
    )

    def build(sharded: bool, gradients: bool = False) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model = torch.nn.Sequential(*layers).to(device or "cpu")
        adam = torch.optim.Adam(model.parameters(), lr=1e-4)
        optimizer = (
            ShardedOptimizer(adam, gradients=gradients)
            if sharded
            else hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, optimizer

    x = torch.randn(args.batch_size, args.width, generator=torch.Generator().manual_seed(1))
    x = x.to(device or "cpu")

    def step(model: torch.nn.Module, optimizer: Any) -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    def timed(model: torch.nn.Module, optimizer: Any, steps: int) -> float:
        hvd.allreduce(torch.zeros(1), name="bench.barrier")
        start = time.perf_counter()
        for _ in range(steps):
            step(model, optimizer)
        if device is not None:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / steps

    params = args.layers * (args.width * args.width + args.width)
    result: dict[str, Any] = {"ranks": hvd.size(), "variant": args.variant, "params": params,
                              "layers": args.layers, "width": args.width}  # fmt: skip
    if args.variant == "speed":
        plain, sharded = build(False), build(True)
        timed(*plain, 1), timed(*sharded, 1)  # warm-up: state, connections
        ratios: list[float] = []
        times: dict[str, list[float]] = {"plain": [], "sharded": []}
        for r in range(args.rounds):
            order = ("plain", "sharded") if r % 2 == 0 else ("sharded", "plain")
            got = {v: timed(*(plain if v == "plain" else sharded), args.steps) for v in order}
            for v in order:
                times[v].append(got[v])
            ratios.append(got["plain"] / got["sharded"])
        result.update(step_s={v: statistics.median(t) for v, t in times.items()},
                      ratio=statistics.median(ratios), rounds=args.rounds)  # fmt: skip
        if hvd.size() > 1:
            result["link"] = _fit_link(hvd, torch, costmodel)
    else:
        model, optimizer = build(args.variant != "plain", args.variant == "gradients")
        before = _rss()
        if device is not None:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3):
            step(model, optimizer)
        grown = _rss() - before
        step_s = statistics.median(timed(model, optimizer, args.steps) for _ in range(args.rounds))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # The rank that peaked highest runs out first: ranks own different slices, so each
        # receives its reduce-scatters at a different point of the backward pass.
        peaks = hvd.allgather(torch.tensor([peak - start_rss], dtype=torch.float64)).tolist()
        result.update(
            weights_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            grads_bytes=_grads_bytes(model, optimizer),
            state_bytes=_state_bytes(optimizer),
            largest_param_bytes=max(p.numel() * p.element_size() for p in model.parameters()),
            rss_growth_bytes=grown,
            peak_rss_bytes=peak,
            peak_growth_bytes=max(peaks),  # the highest rank's
            peak_growth_by_rank=peaks,
            steady_growth_bytes=_rss() - start_rss,  # held between steps
            cuda_peak_bytes=torch.cuda.max_memory_allocated(device) if device else None,
            step_s=step_s,
            element_bytes=4,
            zero_buffers_bytes=zero.in_flight_bytes(4),
            fusion_threshold_bytes=int(
                os.environ.get("HOROVOD_FUSION_THRESHOLD", costmodel.FUSION_THRESHOLD)
            ),
        )
    if hvd.rank() == 0:
        emit(result)


def _fit_link(hvd: Any, torch: Any, costmodel: Any) -> dict[str, float]:
    """The link's alpha and beta from ring allreduces of 64 KiB to 16 MiB (median of 5)."""
    steps, nbytes, seconds = [], [], []
    for size in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24):
        tensor = torch.zeros(size // 4)
        hvd.allreduce(tensor, name=f"bench.link.{size}")
        times = []
        for _ in range(5):
            start = time.perf_counter()
            hvd.allreduce(tensor, name=f"bench.link.{size}")
            times.append(time.perf_counter() - start)
        cost = costmodel.cost("ring", hvd.size(), size)
        steps.append(cost.steps)
        nbytes.append(cost.link_bytes)
        seconds.append(statistics.median(times))
    fitted = costmodel.fit(steps, nbytes, seconds)
    return {"alpha": fitted.alpha, "beta": fitted.beta}


if __name__ == "__main__":
    main()
