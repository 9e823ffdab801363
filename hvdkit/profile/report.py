"""The ranks' records read together: per-rank figures, the verdict, the straggler, advice.
Pure but for :func:`load` and :func:`finish` (files) and the plot (:mod:`.plot`).

``profile.json``::

    {"ranks": [{"rank", "host", "steps", "step_ms": {"median", "p90"},
                "phases_ms": {"data", "compute", "communication", "optimizer", "other"},
                "compiled"}],
     "verdict": {"bound": "input" | "compute" | "communication" | "unknown",
                 "shares": {phase: fraction of the step},
                 "straggler": null | {"rank", "host", "slower_by", "steps_slower"},
                 "advice": [...]},
     "warmup_steps": 1}

``phases_ms`` are each phase's **mean per step** (milliseconds) over the measured steps, so
they add up to the mean step time; ``step_ms`` are the median and 90th percentile of the
step times. The first step of each rank (set-up, graph tracing, the first allreduce's
connections) is left out. When the steps ran inside a compiled TensorFlow graph only their
time is known, and the wait for batches where a custom loop takes them from a ``tf.data``
iterator: ``bound`` is ``input`` if that wait is over half the step, else ``unknown``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hvdkit.profile.recorder import PHASES

WARMUP_STEPS = 1
STRAGGLER_RATIO = 1.10  # busy time above the median rank's by this much, in most steps
STRAGGLER_STEPS = 0.75  # the share of steps it must be slower in: "consistently"
BOUNDS = {"input": ("data",), "communication": ("communication",),
          "compute": ("compute", "optimizer", "other")}  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def measured(record: dict[str, Any]) -> list[list[float]]:
    """A rank's steps less the warm-up (all of them when there are too few)."""
    steps = record["steps"]
    return steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """One rank's line of ``profile.json``."""
    steps = measured(record)
    totals = [sum(step) for step in steps]
    phases = {
        name: 1000 * statistics.fmean(step[i] for step in steps) for i, name in enumerate(PHASES)
    }
    return {
        "rank": record["rank"],
        "host": record["host"],
        "steps": len(steps),
        "step_ms": {
            "median": 1000 * statistics.median(totals),
            "p90": 1000 * _percentile(totals, 0.9),
        },
        "phases_ms": phases,
        "compiled": bool(record.get("compiled")),
    }


def straggler(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank whose busy time (its step less its communication wait) is above the median
    rank's by :data:`STRAGGLER_RATIO` in at least :data:`STRAGGLER_STEPS` of the steps: the
    others wait for it in their allreduces."""
    if len(records) < 2:
        return None
    comm = PHASES.index("communication")
    busy = [[sum(s) - s[comm] for s in measured(r)] for r in records]
    length = min(len(b) for b in busy)
    if length == 0:
        return None
    medians = [statistics.median(b[k] for b in busy) for k in range(length)]
    means = [statistics.fmean(b[:length]) for b in busy]
    typical = statistics.median(means)
    worst = max(range(len(records)), key=lambda i: means[i])
    slower = sum(busy[worst][k] > STRAGGLER_RATIO * medians[k] for k in range(length)) / length
    if typical <= 0 or means[worst] < STRAGGLER_RATIO * typical or slower < STRAGGLER_STEPS:
        return None
    return {
        "rank": records[worst]["rank"],
        "host": records[worst]["host"],
        "slower_by": round(means[worst] / typical - 1, 3),
        "steps_slower": round(slower, 3),
    }


def verdict(ranks: list[dict[str, Any]], slow: dict[str, Any] | None) -> dict[str, Any]:
    """What bounds the step (the phases' shares, averaged over ranks) and what to do."""
    shares = {
        name: statistics.fmean(
            r["phases_ms"][name] / max(sum(r["phases_ms"].values()), 1e-12) for r in ranks
        )
        for name in PHASES
    }
    if any(r["compiled"] for r in ranks):
        # Only the batches' wait is timed apart from a compiled step (a custom loop's tf.data
        # iterator): more than half of the step is input-bound whatever the graph holds.
        bound = "input" if shares["data"] > 0.5 else "unknown"
    else:
        bound = max(BOUNDS, key=lambda b: sum(shares[p] for p in BOUNDS[b]))
    return {
        "bound": bound,
        "shares": {k: round(v, 4) for k, v in shares.items()},
        "straggler": slow,
        "advice": advice(bound, shares, slow),
    }


def advice(bound: str, shares: dict[str, float], slow: dict[str, Any] | None) -> list[str]:
    """Concrete steps for what bounds the job."""
    out = []
    if bound == "unknown":
        out.append(
            "the steps ran inside a compiled TensorFlow graph, where data, communication and "
            "the update cannot be timed apart: profile with model.compile(..., "
            "run_eagerly=True) or KERAS_BACKEND=torch, or a custom loop with "
            "tf.config.run_functions_eagerly(True), to see them (slower, but the shares tell)"
        )
    elif bound == "input":
        out.append(
            f"input-bound: {shares['data']:.0%} of each step waits for the next batch. Load in "
            "parallel: a torch DataLoader(num_workers=N, persistent_workers=True, "
            "prefetch_factor=4, pin_memory=True on GPUs); Keras: a keras.utils.PyDataset given "
            "to session.fit with workers=N (use_multiprocessing=True for Python-heavy "
            "preprocessing); tf.data: .map(..., num_parallel_calls=tf.data.AUTOTUNE)"
            ".prefetch(tf.data.AUTOTUNE). Then profile again"
        )
    elif bound == "communication":
        out.append(
            f"communication-bound: {shares['communication']:.0%} of each step waits on "
            "allreduce results the backward pass did not hide. Try a larger batch per rank; "
            "Horovod's fusion and cycle: hvdkit run --env HOROVOD_FUSION_THRESHOLD=134217728 "
            "(bytes; default 64 MiB) --env HOROVOD_CYCLE_TIME=5 (ms; default 1); "
            "setup(compression='fp16'); backward_passes_per_step=N (one allreduce per N "
            "batches); across hosts, the fastest interface (--network-interface)"
        )
    else:
        out.append(
            f"compute-bound: the ranks compute {shares['compute'] + shares['optimizer']:.0%} "
            "of each step, which is where data-parallel training should be: more ranks scale "
            "it; mixed precision (torch.autocast, keras.mixed_precision) and channels_last make "
            "each step cheaper"
        )
    if shares["other"] > 0.05:
        out.append(
            f"hvdkit's own per-step work (sync guard, preemption agreement, metric averaging) "
            f"is {shares['other']:.0%} of the step: average metrics every N steps rather than "
            "each one"
        )
    if slow is not None:
        out.append(
            f"rank {slow['rank']} on {slow['host']} computes {slow['slower_by']:.0%} longer "
            f"than the median rank in {slow['steps_slower']:.0%} of the steps, and the others "
            "wait for it in every allreduce: look at that host (other jobs on it, its data "
            "path, its clock speed; hvdkit doctor), or give it fewer ranks"
        )
    return out


def build(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``profile.json``'s content from the ranks' records (rank order)."""
    records = sorted((r for r in records if r["steps"]), key=lambda r: r["rank"])
    if not records:
        raise ValueError("no rank recorded a step")
    ranks = [summarize(r) for r in records]
    return {
        "ranks": ranks,
        "verdict": verdict(ranks, straggler(records)),
        "warmup_steps": WARMUP_STEPS,
    }


def table(profile: dict[str, Any]) -> str:
    """The launcher's closing text: a line per rank, the verdict, the straggler, advice."""
    head = ["rank", "host", "steps", "step med", "p90", *PHASES]
    rows = [
        [str(r["rank"]), r["host"], str(r["steps"]), f"{r['step_ms']['median']:.1f}",
         f"{r['step_ms']['p90']:.1f}", *(f"{r['phases_ms'][p]:.1f}" for p in PHASES)]
        for r in profile["ranks"]
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in [head, *rows]]  # fmt: skip
    v = profile["verdict"]
    shares = ", ".join(f"{p} {v['shares'][p]:.0%}" for p in PHASES)
    slow = v["straggler"]
    lines += [
        f"verdict: {v['bound']}-bound ({shares})" if v["bound"] != "unknown" else
        "verdict: unknown (compiled steps)",
        "straggler: " + ("none" if slow is None else
                         f"rank {slow['rank']} on {slow['host']}, {slow['slower_by']:.0%} slower"),
        "advice:",
        *(f"  - {item}" for item in v["advice"]),
    ]  # fmt: skip
    return "\n".join(lines)


def load(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank-*.json"))]


def finish(directory: Path, ranks_expected: int) -> str:
    """Read the ranks' records in ``directory``, write ``profile.json`` and ``profile.png``,
    and return the text to print (or why there is no profile)."""
    records = load(directory)
    if not records:
        return (
            f"hvdkit profile: no rank wrote a record in {directory} (did the job take an "
            "optimizer step through hvdkit or a Horovod DistributedOptimizer? On several "
            "hosts, DIR must be on a file system they share)"
        )
    profile = build(records)
    (directory / "profile.json").write_text(json.dumps(profile, indent=2) + "\n")
    from hvdkit.profile import plot

    pictured = plot.draw(records, profile, directory / "profile.png")
    missing = ranks_expected - len(records)
    note = (
        f" ({missing} rank(s) wrote no record here: on several hosts, DIR must be shared)"
        if missing > 0
        else ""
    )
    written = f"{directory / 'profile.json'}" + (f", {pictured}" if pictured else "")
    return f"hvdkit profile ({written}){note}; per step, ms:\n{table(profile)}"
