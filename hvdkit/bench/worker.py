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
PART = "HVDKIT_BENCH_PART "  # a piece of a long result, before the MARKER line that ends it
PIECE = 2000  # characters of JSON a line: under a pipe's atomic write (4 KiB)


@rank_zero.rank_zero_only
def emit(result: dict) -> None:
    """Rank 0 prints the result for :func:`parse_results`: the JSON in pieces, each on its own
    line as a JSON string, and the last on the :data:`MARKER` line. A result line of 5.5 KB
    came back unreadable from a loaded run under mpirun: a line longer than a pipe's atomic
    write can reach the launcher in pieces with other output between them."""
    text = json.dumps(result, separators=(",", ":"))
    pieces = [text[i : i + PIECE] for i in range(0, len(text), PIECE)] or [""]
    for piece in pieces[:-1]:
        print(PART + json.dumps(piece), flush=True)
    print(MARKER + pieces[-1], flush=True)


def parse_results(text: str) -> list[dict]:
    """Every result in a job's output (horovodrun prefixes lines with the rank).

    Only the JSON right after each marker is read: the launcher may glue another rank's
    output onto the end of a line."""
    decoder = json.JSONDecoder()
    results, pieces = [], []
    for line in text.splitlines():
        try:
            if PART in line:
                pieces.append(decoder.raw_decode(line.split(PART, 1)[1])[0])
            elif MARKER in line:
                tail = line.split(MARKER, 1)[1]
                results.append(decoder.raw_decode("".join(pieces) + tail)[0])
                pieces = []
        except ValueError:
            print(f"hvdkit bench: unreadable result line: {line[:200]}", file=sys.stderr)
            pieces = []
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
