"""PNG plots of a bench summary: bus bandwidth against message size, total throughput
against ranks (with the ideal line), and memory per rank plain against sharded. matplotlib is
imported only here, with a file backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdkit.bench.metrics import human_bytes


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def busbw_plot(allreduce: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in allreduce["series"]:
        ax.plot(s["sizes"], s["busbw_gbps"], marker="o", label=s["name"])
    if "loopback_tcp_gbps" in allreduce:
        ax.plot(allreduce["sizes"], allreduce["loopback_tcp_gbps"], "k--",
                label="loopback TCP (2 processes)")  # fmt: skip
    ax.set_xscale("log", base=2)
    sizes = allreduce["series"][0]["sizes"]
    ax.set_xticks(sizes, [human_bytes(n) for n in sizes], rotation=30, fontsize=8)
    _label(ax, "message size", "bus bandwidth (GB/s)", "Allreduce bus bandwidth")
    return _save(plt, fig, path)


def scaling_plot(summary: dict, path: Path) -> Path:
    plt = _pyplot()
    panels = [(f"torch {name}", m["samples_per_s"], "plain")
              for name, m in summary.get("training", {}).items()]  # fmt: skip
    panels += [(f"keras fit() {name}", k["samples_per_s"], "hvdkit")
               for name, k in summary.get("keras", {}).items()]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8), squeeze=False)
    for ax, (title, by_np, baseline) in zip(axes[0], panels, strict=True):
        ranks = sorted(int(n) for n in by_np)
        for variant in by_np[str(ranks[0])]:
            ax.plot(ranks, [by_np[str(n)][variant] * n for n in ranks], marker="o", label=variant)
        base = by_np.get("1", {}).get(baseline)
        if base:
            ax.plot(ranks, [base * n for n in ranks], "k:", label="ideal")
        ax.set_xticks(ranks)
        _label(ax, "ranks", "samples/s (all ranks)", title)
    return _save(plt, fig, path)


def memory_plot(memory: dict, path: Path) -> Path:
    """Per world size and variant, the bytes per rank stacked (weights, gradients, optimizer
    state) with the peak resident memory beside; and, from the fitted link, the predicted
    communication per step at 8 to 512 ranks (ZeRO-1's equals the allreduce's: the same
    bytes; bf16 gradients halve the reduce-scatter's)."""
    plt = _pyplot()
    panels = 2 if "predicted_ms" in memory else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    bars = [(f"np={n}\n{v}", e[v]) for n, e in memory["by_np"].items()
            for v in ("plain", "sharded") if v in e]  # fmt: skip
    xs = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for key, label in (("weights_bytes", "weights"), ("grads_bytes", "gradients"),
                       ("state_bytes", "optimizer state")):  # fmt: skip
        heights = [r[key] / 1e6 for _, r in bars]
        ax.bar(xs, heights, bottom=bottom, label=label, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.plot(xs, [r["peak_growth_bytes"] / 1e6 for _, r in bars], "k_", markersize=30,
            markeredgewidth=2, label="peak resident, above the start")  # fmt: skip
    ax.set_xticks(xs, [name for name, _ in bars], fontsize=8)
    _label(ax, "", "MB per rank", f"Adam, {memory['params'] / 1e6:.1f} M params")
    if panels == 2:
        ax = axes[0][1]
        ranks = [int(n) for n in memory["predicted_ms"]]
        for kind in next(iter(memory["predicted_ms"].values())):
            ax.plot(ranks, [memory["predicted_ms"][str(n)][kind] for n in ranks], marker="o",
                    label=kind)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.set_yscale("log")
        _label(ax, "ranks", "ms per step (alpha-beta model)",
               "Predicted communication (ZeRO-1 = allreduce)")  # fmt: skip
    return _save(plt, fig, path)


def write_plots(summary: dict, directory: Path) -> list[Path]:
    """The plots this summary has data for, written into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if summary.get("allreduce", {}).get("series"):
        written.append(busbw_plot(summary["allreduce"], directory / "allreduce_busbw.png"))
    if summary.get("training") or summary.get("keras"):
        written.append(scaling_plot(summary, directory / "throughput_vs_ranks.png"))
    if summary.get("memory", {}).get("by_np"):
        written.append(memory_plot(summary["memory"], directory / "memory.png"))
    return written
