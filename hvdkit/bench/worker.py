"""What the benchmark workers share: threads per rank, interleaved rounds, a clock, a round's
rate from its steps, and handing JSON results from rank 0 back to ``hvdkit bench`` (which runs
them under horovodrun)."""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from hvdkit import envvars, rank_zero
from hvdkit.bench.metrics import MIB

MARKER = "HVDKIT_BENCH_RESULT "
PART = "HVDKIT_BENCH_PART "  # a piece of a long result, before the MARKER line that ends it
PIECE = 2000  # characters of JSON a line: under a pipe's atomic write (4 KiB)

# glibc's malloc for every job (hvdkit bench puts it in their environment; glibc reads it at
# start): blocks up to 32 MiB come from the heap (not fresh mmap()s, whose pages fault in again
# each step) and freed memory stays there. On this 2-core VM, torch's CNN step at one rank then
# took 34.8 ms instead of 41.5 ms (page faults 3.4 M -> 73 K over 1,000 steps, system time
# 6.6 s -> 0.3 s), and its step-to-step spread (p10-p90) went from +-8% to +-2% (2026-11-27):
# the variants are compared at the same heap settings either way. ``emit`` reports it.
STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 * MIB), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
# The memory section's plain and sharded jobs instead: every block over 1 MiB a mapping of its
# own, returned when freed, so that the peak is the bytes live at once (the steady heap keeps
# freed blocks, and how they fragment moved the same job's peak by 50 MB from run to run).
EXACT_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


@rank_zero.rank_zero_only
def emit(result: dict) -> None:
    """Rank 0 prints the result for :func:`parse_results`: the JSON in pieces, each on its own
    line as a JSON string, and the last on the :data:`MARKER` line. A result line of 5.5 KB
    came back unreadable from a loaded run under mpirun: a line longer than a pipe's atomic
    write can reach the launcher in pieces with other output between them."""
    # What the job ran with (hvdkit bench's steady heap, or not), filed with its numbers.
    malloc = {name: os.environ.get(name) for name in STEADY_HEAP}  # the same names in both
    text = json.dumps({**result, "malloc": malloc}, separators=(",", ":"))
    pieces = [text[i : i + PIECE] for i in range(0, len(text), PIECE)] or [""]
    for piece in pieces[:-1]:
        print(PART + json.dumps(piece), flush=True)
    print(MARKER + pieces[-1], flush=True)


# A launcher's tag before what a rank wrote: mpirun's ``[1,0]<stdout>:``, horovodrun's
# ``[0]<stdout>:``.
_TAG = re.compile(r"(\[\d+(?:,\d+)*\]<std(?:out|err)>:)")
_MARKS = re.compile(f"({re.escape(PART)}|{re.escape(MARKER)})")


def _streams(text: str) -> list[str]:
    """What each rank wrote to each stream, put back together from a launcher's tagged
    output. mpirun tags every chunk it reads, and a chunk can end in the middle of a line:
    ``[1,0]<stdout>:HVDKIT_BENCH_RESU[1,0]<stdout>:LT {...`` came back from a full run, and
    another rank's output may come between the two halves."""
    first, *tagged = _TAG.split(text)  # the text before any tag, then tag, part, tag, part...
    streams: dict[str, list[str]] = {"": [first]}
    for tag, part in zip(tagged[::2], tagged[1::2], strict=True):
        streams.setdefault(tag, []).append(part)
    return ["".join(chunks) for chunks in streams.values()]


def parse_results(text: str) -> list[dict]:
    """Every result in a job's output, in the order each rank printed them.

    Only the JSON right after each marker is read: the launcher may glue more output onto
    the end of a line."""
    decoder = json.JSONDecoder()
    results = []
    for stream in _streams(text):
        pieces: list[str] = []
        for found in _MARKS.finditer(stream):
            try:
                if found.group(1) == PART:
                    pieces.append(decoder.raw_decode(stream, found.end())[0])
                    continue
                results.append(decoder.raw_decode("".join(pieces) + stream[found.end() :])[0])
            except ValueError:
                line = stream[found.start() :].split("\n", 1)[0]
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


def round_rate(samples_per_step: int, step_seconds: Sequence[float]) -> float:
    """A round's samples per second at its median step time. This VM stalls single steps
    (Keras fit on TensorFlow at 2 ranks: the per-round ratio of two variants spread 0.90-1.12
    from round totals, 0.97-1.07 from median steps, 2026-11-27); a cost paid on every step
    is in the median in full. The bench's hvdkit variants do no work every few steps only
    (no checkpoint, preemption or elastic commits), which a median would hide."""
    if not step_seconds:
        raise ValueError("a round needs at least one timed step")
    return samples_per_step / statistics.median(step_seconds)
