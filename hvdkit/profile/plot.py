"""``profile.png``: each rank's step split into phases, and step time over the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdkit.profile.recorder import PHASES

COLOURS = {"data": "#d62728", "compute": "#2ca02c", "communication": "#1f77b4",
           "optimizer": "#ff7f0e", "other": "#7f7f7f"}  # fmt: skip


def draw(records: list[dict[str, Any]], profile: dict[str, Any], path: Path) -> Path | None:
    """Write the picture; None when matplotlib is not installed (``pip install
    'hvdkit[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ranks = profile["ranks"]
    fig, (bars, lines) = plt.subplots(
        1, 2, figsize=(12, 0.5 * len(ranks) + 3.5), gridspec_kw={"width_ratios": [1, 1.4]}
    )
    labels = [f"rank {r['rank']} ({r['host']})" for r in ranks]
    left = [0.0] * len(ranks)
    for phase in PHASES:
        widths = [r["phases_ms"][phase] for r in ranks]
        bars.barh(labels, widths, left=left, color=COLOURS[phase], label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    bars.invert_yaxis()
    bars.set_xlabel("mean ms per step")
    verdict = profile["verdict"]
    bars.set_title(f"where a step goes: {verdict['bound']}-bound")
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small")
    for record in sorted(records, key=lambda r: r["rank"]):
        totals = [1000 * sum(step) for step in record["steps"]]
        lines.plot(range(1, len(totals) + 1), totals, label=f"rank {record['rank']}", lw=1)
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms)")
    every = [1000 * sum(step) for record in records for step in record["steps"]]
    if every and min(every) > 0 and max(every) / min(every) > 20:
        lines.set_yscale("log")  # a first step of seconds beside steps of milliseconds
    slow = verdict["straggler"]
    lines.set_title("step time" + (f" (straggler: rank {slow['rank']})" if slow else ""))
    lines.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
