"""``profile.png``: each rank's step split into phases, and step time over the run. Past
:data:`~hvdkit.profile.report.LISTED` ranks, the bars show the slowest, the median and the
fastest, and a third panel the distribution of every rank's median step: the picture keeps
its size at any number of ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdkit.profile.stats import LABELS, PHASES

COLOURS = {"data": "#d62728", "compute": "#2ca02c", "communication": "#1f77b4",
           "optimizer": "#ff7f0e", "other": "#7f7f7f", "unsplit": "#c7c7c7"}  # fmt: skip


def draw(records: list[dict[str, Any]], profile: dict[str, Any], path: Path) -> Path | None:
    """Write the picture from the ranks' summaries; None when matplotlib is not installed
    (``pip install 'hvdkit[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from hvdkit.profile.report import _listed

    everyone = profile["ranks"]
    ranks = _listed(everyone)
    many = len(ranks) < len(everyone)
    ratios = [1, 1.4, 1] if many else [1, 1.4]
    fig, axes = plt.subplots(1, len(ratios), figsize=(4 + 4 * len(ratios), 0.5 * len(ranks) + 3.5),
                             gridspec_kw={"width_ratios": ratios})  # fmt: skip
    bars, lines = axes[0], axes[1]
    labels = [f"rank {r['rank']} ({r['host']})" for r in ranks]
    left = [0.0] * len(ranks)
    drawn = [p for p in PHASES if p != "unsplit" or any(r["phases_ms"][p] for r in ranks)]
    for phase in drawn:
        widths = [r["phases_ms"][phase] for r in ranks]
        bars.barh(labels, widths, left=left, color=COLOURS[phase], label=LABELS[phase])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    bars.invert_yaxis()
    bars.set_xlabel("mean ms per step (10% trimmed)")
    verdict = profile["verdict"]
    bars.set_title(f"where a step goes: {verdict['bound']}-bound"
                   + (f" ({len(ranks)} of {len(everyone)} ranks)" if many else ""))  # fmt: skip
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small")
    shown = {(r["rank"], r["host"]) for r in ranks}
    series = [r for r in records if (r["rank"], r["host"]) in shown]
    for record in sorted(series, key=lambda r: r["rank"]):
        totals = record["series_ms"]
        every = record["steps"] * record.get("stride", 1) / max(len(totals), 1)  # sampled
        steps = [1 + round(i * every) for i in range(len(totals))]
        lines.plot(steps, totals, label=f"rank {record['rank']}", lw=1)
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms)")
    times = [t for r in series for t in r["series_ms"]]
    if times and min(times) > 0 and max(times) / min(times) > 20:
        lines.set_yscale("log")  # a first step of seconds beside steps of milliseconds
    slow = verdict["straggler"]
    lines.set_title("step time" + (f" (straggler: rank {slow['rank']})" if slow else ""))
    if len(series) <= 16:
        lines.legend(fontsize="small")
    if many:
        spread = axes[2]
        spread.hist([r["step_ms"]["median"] for r in everyone], bins=40, color="#1f77b4",
                    log=True)  # fmt: skip
        spread.set_xlabel("median step (ms)")
        spread.set_ylabel("ranks (log scale: one slow rank shows)")
        spread.set_title(f"all {len(everyone)} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
