"""The phases, and a rank's steps digested into the summary it sends the report: pure, so
that the recorder (which writes it) and the report (which reads a thousand of them) share it
without importing each other."""

from __future__ import annotations

import statistics
from typing import Any

PHASES = ("data", "compute", "communication", "optimizer", "other", "unsplit")
"""A step's phases. ``unsplit``: time inside a compiled graph that no clock could split
(drawn and printed as "not split", never as compute)."""
LABELS = {**{p: p for p in PHASES}, "unsplit": "not split"}
APART = ("validation", "epoch end", "checkpoint", "reset")
"""Time between training steps, kept out of the steps' phases and reported apart."""
WARMUP_STEPS = 1
TRIM = 0.1
"""The share of steps left out at each end (by step time) of the phases' means: one long
step (a validation the recorder could not tell, a first allreduce) moves nothing."""
SERIES = 512
"""Points of a rank's step series kept in its summary (evenly spaced): the picture and the
straggler rule read these, so a report of 1,000 ranks reads 1,000 short lists."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def measured(steps: list[list[float]]) -> list[list[float]]:
    """The steps less the warm-up (all of them when there are too few)."""
    return steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps


def trimmed(steps: list[list[float]]) -> list[list[float]]:
    """The steps but the :data:`TRIM` shortest and longest (one of each from 5 steps on)."""
    cut = max(int(len(steps) * TRIM), 1 if len(steps) >= 5 else 0)
    ordered = sorted(steps, key=sum)
    return ordered[cut : len(ordered) - cut] or ordered


def _sampled(values: list[Any]) -> list[Any]:
    if len(values) <= SERIES:
        return values
    every = len(values) / SERIES
    return [values[int(i * every)] for i in range(SERIES)]


def digest(raw: dict[str, Any]) -> dict[str, Any]:
    """A rank's summary from its record of every step (``steps``: seconds per phase): step
    time's median and 90th percentile, each phase's trimmed mean (they add up to the trimmed
    mean step), the time spent apart, and bounded series of step and busy time (the step
    less its communication wait)."""
    names = raw.get("phases", PHASES)
    steps = [[*s, *[0.0] * (len(PHASES) - len(s))] for s in measured(raw["steps"])]
    if list(names) != list(PHASES[: len(names)]):
        raise ValueError(f"profile record of rank {raw.get('rank')}: unknown phases {names}")
    totals = [sum(s) for s in steps]
    kept = trimmed(steps) if steps else []
    comm = PHASES.index("communication")
    return {
        **{k: v for k, v in raw.items() if k not in ("steps", "ends")},
        "phases": list(PHASES),
        "steps": len(steps),
        "step_ms": {
            "median": 1000 * statistics.median(totals) if totals else 0.0,
            "p90": 1000 * percentile(totals, 0.9) if totals else 0.0,
        },
        "phases_ms": {
            name: 1000 * statistics.fmean(s[i] for s in kept) if kept else 0.0
            for i, name in enumerate(PHASES)
        },
        "apart_ms": {k: 1000 * v for k, v in raw.get("apart", {}).items() if v > 0},
        "series_ms": [1000 * t for t in _sampled(totals)],
        "busy_ms": [1000 * (sum(s) - s[comm]) for s in _sampled(steps)],
        "compiled": bool(raw.get("compiled")),
        "digested": True,
    }
