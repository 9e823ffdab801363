"""The collectives grid of the per-API workers (tests/workers/*_collectives_grid_worker.py):
every Horovod collective x dtype x op x shape, checked against numpy (issue 49).

The cases come from a seed, the same on every rank; each rank's input is drawn from (seed,
case, rank), so every rank computes all ranks' inputs and the result numpy gives for them
(:func:`oracle`). A worker runs each case through its API and compares the result with the
oracle (:func:`differs`: exact for integers and bool, within one unit in the last place for
floats), or expects a named error: Horovod 0.28.1's own where its binding does not take the
dtype (:func:`horovod_refusal`, from :data:`TAKEN`), or hvdkit's. :func:`run` drives a worker's
grid: its failures, each with a command line that reruns the case, or with ``--observe``
every case's outcome (what Horovod does, when extending the grid).

Importable without a framework or Horovod: the tests read a worker's ``cases()``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

SEED = 49  # issue 49; any seed gives a valid grid
# The collective, and the ops each is checked with (None: the collective takes none).
COLLECTIVES = {
    "allreduce": ("Sum", "Average", "Min", "Max", "Product"),
    "reducescatter": ("Sum", "Average"),
    "allgather": (None,),
    "broadcast": (None,),
    "alltoall": (None,),
}
DTYPES = (
    "bool", "uint8", "uint16", "uint32", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip
# A numpy scalar, a 0-d array, no rows, a few rows, and many. The framework APIs take their
# own tensors only, where "scalar" would be the 0-d case again: they leave it out.
SHAPES = ("scalar", "0-d", "empty", "small", "large")
TENSOR_SHAPES = SHAPES[1:]
LARGE = 1 << 16  # elements, at least: many of Horovod's chunks, still quick on 2 cores
# Smaller for reducescatter: from about 2**16 elements of 8 bytes, Horovod 0.28.1's Gloo
# reducescatter (its vendored gloo::ReduceScatterHalvingDoubling) intermittently returns
# wrong values in the last ~100-250 elements of rank 0's share, on every binding (horovod.torch
# alone too). A Horovod defect, not hvdkit's; `--large 65536 --case 'reducescatter/*'` shows
# it within a few runs.
REDUCESCATTER_LARGE = 1 << 15
SIZE = 2  # the tests' ranks
SPLITTING = ("reducescatter", "allgather", "alltoall")  # along the first axis: not 0-d

# What Horovod 0.28.1 takes (its kernels' registered types): the dtypes each binding reduces
# (allreduce; reducescatter) and moves (allgather, broadcast, alltoall). hvdkit's JAX path
# goes through the torch binding, and carries the dtypes that binding lacks as same-width ones
# for the ops that only move bytes; it reduces what the torch binding reduces.
TAKEN = {
    "tensorflow": {
        "allreduce": {"uint8", "int8", "int32", "int64", "float16", "float32", "float64"},
        "reducescatter": {"int32", "int64", "float16", "float32", "float64"},
        "moves": {"bool", "uint8", "int8", "uint16", "int16", "int32", "int64", "float16",
                  "float32", "float64"},
        # broadcast_ (in place, into variables): its kernel's own list.
        "broadcast_": {"bool", "uint8", "int8", "int32", "int64", "float16", "float32",
                       "float64"},
    },
    "torch": {
        "allreduce": {"int32", "int64", "float16", "float32", "float64"},
        "reducescatter": {"int32", "int64", "float16", "float32", "float64"},
        "moves": {"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"},
    },
    "jax": {
        "allreduce": {"int32", "int64", "float16", "float32", "float64"},
        "reducescatter": {"int32", "int64", "float16", "float32", "float64"},
        "moves": set(DTYPES),
    },
}  # fmt: skip
# torch's legacy type names, which Horovod's refusal prints (torch.<name>Tensor).
TORCH_TYPES = {"bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short",
               "uint16": "UInt16", "uint32": "UInt32", "bfloat16": "BFloat16"}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One check: ``collective`` (what the oracle computes) with ``op`` on a ``dtype`` tensor of
    ``shape``, called through ``form`` (the API function, e.g. ``allreduce_async``; None: the
    collective's own)."""

    collective: str
    dtype: str
    op: str | None
    shape: str
    form: str | None = None

    @property
    def name(self) -> str:
        return "/".join([self.form or self.collective, self.dtype, self.op or "-", self.shape])


def grid(forms: dict[str, str], shapes: tuple[str, ...]) -> list[Case]:
    """Every form (name -> the collective it is) x its collective's ops x dtype x shape, in a
    fixed order (every rank runs it in this order)."""
    return [
        Case(collective, dtype, op, shape, None if form == collective else form)
        for form, collective in forms.items()
        for op in COLLECTIVES[collective]
        for dtype in DTYPES
        for shape in shapes
    ]


def _rng(seed: int, case: Case, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(case.name.encode()), *more])


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass
class Plan:
    """One case's draw: each rank's input, and the broadcast's root / alltoall's splits."""

    inputs: list[np.ndarray]
    root: int
    splits: list[list[int]]


def plan(seed: int, case: Case, size: int = SIZE, part: int = 0) -> Plan:
    """Every rank's input for ``case``: the same on every rank that computes it. ``part`` > 0
    draws another tensor of the case (of its own shape, root and splits), for the grouped
    forms, which take several."""
    extra = [1 << 20, part] if part else []  # part 0: the same draw as before parts existed
    shared = _rng(seed, case, *extra)  # what the ranks must agree on: shapes, root, splits
    width = int(shared.integers(1, 4))
    rows = {"scalar": [None] * size, "0-d": [None] * size, "empty": [0] * size,
            "small": [int(shared.integers(1, 7))] * size,
            "large": [large(case) + int(shared.integers(0, 1000))] * size}[case.shape]  # fmt: skip
    if case.collective == "allgather" and case.shape in ("small", "large"):
        rows = [r + int(shared.integers(0, 5)) for r in rows]  # first dims may differ
    splits = []
    for r in rows:
        cuts = np.sort(shared.integers(0, (r or 0) + 1, size - 1))
        splits.append(np.diff([0, *cuts, r or 0]).tolist())
    inputs = []
    for rank, r in enumerate(rows):
        if r is None:
            shape: tuple[int, ...] = ()
        elif case.shape == "large":
            shape = (r,)
        else:
            shape = (r, width)
        x = draw(_rng(seed, case, rank, *([part] if part else [])), case.dtype, case.op, shape,
                 size)  # fmt: skip
        inputs.append(x[()] if case.shape == "scalar" else np.asarray(x))
    return Plan(inputs, int(shared.integers(0, size)), splits)


def large(case: Case) -> int:
    return REDUCESCATTER_LARGE if case.collective == "reducescatter" else LARGE


# Scales of float inputs: sums of `size` of them stay finite in every dtype.
FLOAT_SCALE = {"float16": 100.0, "bfloat16": 1e4, "float32": 1e6, "float64": 1e12}


def draw(rng: np.random.Generator, dtype: str, op: str | None, shape: tuple[int, ...],
         size: int) -> np.ndarray:  # fmt: skip
    """Values that use the dtype's whole width (an int64 above 2**31, a float64 with all its
    mantissa), bounded where ``op`` could overflow it: a narrowing cast shows."""
    dt = np_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if op in ("Sum", "Average"):
            lo, hi = info.min // size, info.max // size
        elif op == "Product":
            hi = int(info.max ** (1 / size))
            while hi**size > info.max:  # the float root may round up
                hi -= 1
            lo = -hi if dt.kind == "i" else 0
        else:
            lo, hi = info.min, info.max
        return rng.integers(lo, hi, shape, dtype=dt, endpoint=True)
    scale = FLOAT_SCALE[dtype] ** (1 / size if op == "Product" else 1)
    return (rng.standard_normal(shape) * scale).astype(dt)


def oracle(case: Case, p: Plan, rank: int) -> np.ndarray:
    """What rank ``rank`` must receive, by numpy from every rank's input."""
    xs = p.inputs
    if case.collective == "broadcast":
        return xs[p.root]
    if case.collective == "allgather":
        return np.concatenate(xs)
    if case.collective == "alltoall":
        parts = [np.split(x, np.cumsum(s)[:-1])[rank] for x, s in zip(xs, p.splits, strict=True)]
        return np.concatenate(parts)
    dt = np_dtype(case.dtype)
    # Floats in float64 (one rounding to the dtype at the end), integers as Python's: exact.
    wide = np.stack([x.astype(np.float64 if "float" in case.dtype else object) for x in xs])
    reduced = {"Sum": lambda a: a.sum(0), "Min": lambda a: a.min(0), "Max": lambda a: a.max(0),
               "Product": lambda a: a.prod(0),
               "Average": lambda a: average(a, dt)}[case.op](wide)  # fmt: skip
    out = np.asarray(reduced).astype(dt)
    if case.collective == "reducescatter":
        out = np.array_split(out, len(xs))[rank]
    return out


def received_splits(p: Plan, rank: int) -> list[int]:
    """The rows an alltoall brings ``rank`` from each rank, in rank order."""
    return [s[rank] for s in p.splits]


def average(stacked: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Horovod's average: the sum scaled by 1/size. Horovod scales integers in float64 and
    truncates toward zero, so an int64 average above 2**53 is rounded (on TensorFlow and torch
    alike; the JAX path goes through the torch binding)."""
    total = stacked.sum(0)
    if dt.kind in "iu":
        return np.trunc(np.asarray(total, dtype=np.float64) * (1.0 / len(stacked)))
    return total / len(stacked)


def taken(binding: str, case: Case, dtype: str | None = None) -> bool:
    """Whether Horovod's ``binding`` ("torch", "tensorflow", "jax") takes ``dtype`` (the
    case's by default) for the case's collective, through the case's form."""
    kinds = TAKEN[binding]
    kind = case.form if case.form in kinds else "moves" if case.op is None else case.collective
    return (dtype or case.dtype) in kinds[kind]


def horovod_refusal(binding: str, dtype: str, form: str | None = None) -> tuple[str, str]:
    """The error type and a text of its message with which Horovod's ``binding`` refuses a
    ``dtype`` it does not take (through ``form``: on TensorFlow, ``broadcast_`` refuses in its
    kernel, and an op traced in a ``tf.function`` refuses while tracing)."""
    if binding == "torch":
        return "ValueError", f"Tensor type torch.{TORCH_TYPES[dtype]}Tensor is not supported"
    if form == "broadcast_":
        return (
            "InvalidArgumentError",
            f"Horovod inplace broadcast does not support data type {dtype}",
        )
    if form and form.startswith("function."):
        return "TypeError", f"Value passed to parameter 'tensor' has DataType {dtype} not in list"
    return "InvalidArgumentError", f"Value for attr 'T' of {dtype} is not in the list"


def first_axis_refusal(binding: str, case: Case) -> tuple[str, str]:
    """The error for a 0-d tensor given to ``case``'s splitting collective through a framework
    API: hvdkit's refusal, before the dtype's, for the ops that would crash or fail obscurely;
    for reducescatter, Horovod's own (its dtype check comes first)."""
    form = case.form or case.collective
    if case.collective != "reducescatter":
        which = "tensors[0]" if form.startswith("grouped_") else "the tensor"
        return "ValueError", f"hvd.{form.removeprefix('function.')}: {which} is 0-d"
    if not taken(binding, case):
        return horovod_refusal(binding, case.dtype, case.form)
    return ("ValueError" if binding == "torch" else "InvalidArgumentError",
            "does not support scalar inputs")  # fmt: skip


def differs(value: np.ndarray, want: np.ndarray, dtype: str) -> str | None:
    """Why ``value`` (a result, as numpy) is not ``want`` (None: it is): of ``want``'s shape,
    equal exactly for integers and bool, within one unit in the last place for floats."""
    import ml_dtypes  # finfo of bfloat16 too

    if value.shape != want.shape:
        return f"shape {value.shape}, expected {want.shape}"
    if "float" in dtype:
        a, b = value.astype(np.float64), want.astype(np.float64)
        eps = float(ml_dtypes.finfo(np_dtype(dtype)).eps)
        bad = ~np.isclose(a, b, rtol=eps, atol=0, equal_nan=True)
    else:  # as Python integers
        a, b = value.astype(object), want.astype(object)
        bad = a != b
    if np.any(bad):
        at = tuple(int(k) for k in np.argwhere(bad)[0]) if value.ndim else ()
        return f"value at {at}: {a[at]!r}, expected {b[at]!r} ({int(np.sum(bad))} differ)"
    return None


def outcome(attempt: Callable[[], str | None], error: tuple[str, str] | None,
            observe: bool) -> str | None:  # fmt: skip
    """A case's failure (None: it passed): ``attempt`` runs it and says what is wrong with its
    result; ``error`` is the error it must raise instead (type name, a text of the message)."""
    try:
        why = attempt()
    except Exception as exc:  # noqa: BLE001 - every failure is a case's outcome
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        said = lines[0][:300] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
        raised = f"raised {type(exc).__name__}: {said}"
        if observe or error is None:
            return raised
        if type(exc).__name__ != error[0] or error[1] not in str(exc):
            return f"{raised}; expected {error[0]} containing {error[1]!r}"
        return None
    if error is not None and not observe:
        return f"succeeded; expected {error[0]} containing {error[1]!r}"
    return why


def arguments() -> argparse.Namespace:
    """A worker's command line (``--large`` sets this module's large sizes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--case", help="run the cases that match: a name, or 'alltoall/*'")
    parser.add_argument("--skip", help="leave out the cases that match")
    parser.add_argument("--large", type=int, help="elements of a large case, at least")
    parser.add_argument("--observe", action="store_true", help="report every outcome")
    args = parser.parse_args()
    if args.large:
        global LARGE, REDUCESCATTER_LARGE
        LARGE = REDUCESCATTER_LARGE = args.large
    return args


def run(cases: list[Case], args: argparse.Namespace, check: Callable[[Case], str | None],
        rerun: str) -> dict[str, Any]:  # fmt: skip
    """Run the cases ``args`` selects, in order, with ``check`` (a case's failure, or None):
    the count, the failures (each with ``rerun`` + its selection, a command line) and the
    time, or with ``--observe`` every case's outcome."""
    chosen = [c for c in cases if args.case is None or fnmatch.fnmatchcase(c.name, args.case)]
    chosen = [c for c in chosen if not (args.skip and fnmatch.fnmatchcase(c.name, args.skip))]
    again = f"{rerun} --seed {args.seed}" + (f" --large {args.large}" if args.large else "")
    start = time.perf_counter()
    failures, outcomes = [], {}
    for case in chosen:
        if args.observe:  # the case a crash ends on
            print(f"CASE {case.name}", file=sys.stderr, flush=True)
        why = check(case)
        outcomes[case.name] = why
        if why and not args.observe:
            failures.append({"case": case.name, "why": why,
                             "repro": f"{again} --case {case.name}"})  # fmt: skip
    out = {"cases": len(chosen), "failures": failures,
           "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    if args.observe:
        out["outcomes"] = outcomes
    return out
