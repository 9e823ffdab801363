"""The ranks' records read together: per-rank figures, the verdict, the straggler, advice.
Pure but for :func:`load` and :func:`finish` (files) and the plot (:mod:`.plot`).

``profile.json``::

    {"ranks": [{"rank", "host", "steps", "step_ms": {"median", "p90"},
                "phases_ms": {"data", "compute", "communication", "optimizer", "other",
                              "unsplit"},
                "apart_ms": {"validation", "epoch end", "checkpoint", "reset"},
                "compiled"}],
     "verdict": {"bound": "input" | "compute" | "communication" | "unknown",
                 "shares": {phase: fraction of the step},
                 "straggler": null | {"rank", "host", "slower_by", "steps_slower"},
                 "advice": [...]},
     "warmup_steps": 1}

``phases_ms`` are each phase's **trimmed mean per step** (milliseconds: the 10% shortest and
longest steps left out, so one long step moves nothing), which add up to the trimmed mean
step; ``step_ms`` are the median and 90th percentile of the step times. The first step of
each rank (set-up, graph tracing, the first allreduce's connections) is left out. Time
between training steps (validation, the epoch's end, checkpoints, elastic resets) is in
``apart_ms`` (totals over the run), never in a step. When the steps ran inside a compiled
TensorFlow graph, their time is ``unsplit`` ("not split") but for what is timed outside it:
the wait for a custom loop's ``tf.data`` batches, or the time hvdkit's input wrapper spent
loading (a Keras ``PyDataset``); ``bound`` is ``input`` if that is over half of the step (a
wait) or 80% of it (loading, which may overlap the step), else ``unknown``.

Each rank sends a summary (:func:`hvdkit.profile.stats.digest`), so that the report of a
thousand ranks reads a thousand short records.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hvdkit.profile.stats import LABELS, PHASES, WARMUP_STEPS, digest

STRAGGLER_RATIO = 1.10  # busy time above the other ranks' median by this much, in most steps
STRAGGLER_STEPS = 0.75  # the share of steps it must be slower in: "consistently"
LOADING_BOUND = 0.8  # a compiled step's share of loading (overlapping it) that is input-bound
BOUNDS = {"input": ("data",), "communication": ("communication",),
          "compute": ("compute", "optimizer", "other")}  # fmt: skip


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """One rank's line of ``profile.json``, from its summary (or its raw steps)."""
    d = record if record.get("digested") else digest(record)
    return {
        "rank": d["rank"],
        "host": d["host"],
        "steps": d["steps"],
        "step_ms": d["step_ms"],
        "phases_ms": d["phases_ms"],
        "apart_ms": d.get("apart_ms", {}),
        "compiled": d["compiled"],
        "loader_timed": bool(d.get("loader_timed")),
    }


def straggler(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank whose busy time (its step less its communication wait) is above the other
    ranks' median by :data:`STRAGGLER_RATIO` in at least :data:`STRAGGLER_STEPS` of the
    steps: the others wait for it in their allreduces. The rank under test is left out of
    the median it is compared with (with two ranks, the other one)."""
    if len(records) < 2:
        return None
    busy = [r["busy_ms"] for r in records]
    length = min(len(b) for b in busy)
    if length == 0:
        return None
    means = [statistics.fmean(b[:length]) for b in busy]
    worst = max(range(len(records)), key=lambda i: means[i])
    others = [b for i, b in enumerate(busy) if i != worst]
    typical = statistics.median(m for i, m in enumerate(means) if i != worst)
    slower = (
        sum(
            busy[worst][k] > STRAGGLER_RATIO * statistics.median(b[k] for b in others)
            for k in range(length)
        )
        / length
    )
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
        # Only the batches' wait (a custom loop's tf.data iterator) or the input wrapper's
        # loading is timed apart from a compiled step: a wait over half of the step, or
        # loading (which may overlap it) over LOADING_BOUND of it, is input-bound whatever
        # the graph holds.
        limit = LOADING_BOUND if any(r["loader_timed"] for r in ranks) else 0.5
        bound = "input" if shares["data"] > limit else "unknown"
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
            f"the steps ran inside a compiled TensorFlow graph, where compute, communication "
            f"and the update cannot be timed apart ({shares['unsplit']:.0%} of the step not "
            f"split; data {shares['data']:.0%}): profile with model.compile(..., "
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
    records = [r if r.get("digested") else digest(r) for r in records]
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
    shown = [p for p in PHASES if p != "unsplit" or any(r["phases_ms"][p] for r in
                                                        profile["ranks"])]  # fmt: skip
    head = ["rank", "host", "steps", "step med", "p90", *(LABELS[p] for p in shown)]
    rows = [
        [str(r["rank"]), r["host"], str(r["steps"]), f"{r['step_ms']['median']:.1f}",
         f"{r['step_ms']['p90']:.1f}", *(f"{r['phases_ms'][p]:.1f}" for p in shown)]
        for r in _listed(profile["ranks"])
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in [head, *rows]]  # fmt: skip
    v = profile["verdict"]
    if len(rows) < len(profile["ranks"]):
        lines.append(f"... {len(profile['ranks']) - len(rows)} more ranks in profile.json "
                     "(listed: the slowest, the median and the fastest)")  # fmt: skip
    compiled = v["bound"] == "unknown" or any(r["compiled"] for r in profile["ranks"])
    shares = ", ".join(f"{LABELS[p]} {v['shares'][p]:.0%}" for p in shown
                       if v["shares"][p] > 0 or not compiled)  # fmt: skip
    slow = v["straggler"]
    apart = profile["ranks"][0].get("apart_ms", {})
    lines += [
        f"verdict: {v['bound']}-bound ({shares})" if v["bound"] != "unknown" else
        f"verdict: unknown (compiled steps: {shares})",
        *(["between steps, rank 0, whole run: " + ", ".join(
            f"{k} {ms:.0f} ms" for k, ms in apart.items())] if apart else []),
        "straggler: " + ("none" if slow is None else
                         f"rank {slow['rank']} on {slow['host']}, {slow['slower_by']:.0%} slower"),
        "advice:",
        *(f"  - {item}" for item in v["advice"]),
    ]  # fmt: skip
    return "\n".join(lines)


LISTED = 16  # ranks in the console's table and the picture's bars


def _listed(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All the ranks, or past :data:`LISTED`: the slowest, the median one and the fastest
    (by median step), in rank order."""
    if len(ranks) <= LISTED:
        return ranks
    by_time = sorted(ranks, key=lambda r: r["step_ms"]["median"])
    keep = {id(r) for r in by_time[-(LISTED - 2) :]}
    keep |= {id(by_time[0]), id(by_time[len(by_time) // 2])}
    return [r for r in ranks if id(r) in keep]


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
    records = [r if r.get("digested") else digest(r) for r in records]
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
