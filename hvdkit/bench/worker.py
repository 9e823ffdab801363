"""What the benchmark workers share: threads per rank, interleaved rounds, a clock, and handing
JSON results from rank 0 back to ``hvdkit bench`` (which runs them under horovodrun)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from hvdkit import envvars, rank_zero

MARKER = "HVDKIT_BENCH_RESULT "


@rank_zero.rank_zero_only
def emit(result: dict) -> None:
    """Rank 0 prints the result on one line that :func:`parse_results` finds in the output."""
    print(MARKER + json.dumps(result, separators=(",", ":")), flush=True)


def parse_results(text: str) -> list[dict]:
    """Every result line in a job's output (horovodrun prefixes lines with the rank).

    Only the JSON object right after the marker is read: the launcher may glue another
    rank's output onto the end of a long line."""
    decoder = json.JSONDecoder()
    results = []
    for line in text.splitlines():
        if MARKER in line:
            try:
                results.append(decoder.raw_decode(line.split(MARKER, 1)[1])[0])
            except ValueError:
                print(f"hvdkit bench: unreadable result line: {line[:200]}", file=sys.stderr)
    return results


def pinned_threads(local_size: int) -> int:
    """Threads per rank for the main measurements. ``hvdkit bench`` fixes them for the whole
    run (``HVDKIT_BENCH_THREADS``): the same per-rank resources at every world size is what
    makes weak scaling meaningful on a machine with few cores. Otherwise each rank's share of
    the cores, as hvdkit's adapters pin them."""
    from hvdkit.devices import cores_per_process

    fixed = os.environ.get(envvars.BENCH_THREADS)
    return int(fixed) if fixed else cores_per_process(local_size)


def timed_rounds(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call each variant once per round in ABBA order and collect what it returns."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(variants[name]())
    return out


def clock() -> float:
    return time.perf_counter()
