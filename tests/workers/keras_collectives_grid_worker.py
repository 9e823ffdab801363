"""Run under horovodrun by tests/test_keras_collectives_grid.py (KERAS_BACKEND set by the test):
every Keras collective of ``hvdkit.keras`` x dtype x op x shape, checked against numpy.

One job runs the whole grid. The cases come from a seed, the same on every rank; each rank's
input is drawn from (seed, case, rank), so every rank computes all ranks' inputs and the
result numpy gives for them (:func:`oracle`). A case expects that value as the backend's
tensor in the input's dtype (exact for integers and bool, within one unit in the last place
for floats), or a named error (:func:`expected_error`): Horovod 0.28.1's own where its
binding does not take the dtype (TensorFlow, torch), hvdkit's naming the dtype on JAX, and
hvdkit's for a 0-d tensor given to an op that splits the first axis. Each rank reports its
failures, each with a command line that reruns the case; ``--observe`` reports every case's
outcome instead (what Horovod does, when extending the grid).

Importable without Keras or Horovod: the test reads :func:`cases` to know the grid's size.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
import zlib
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
# A numpy scalar, a 0-d array, no rows, a few rows, and many.
SHAPES = ("scalar", "0-d", "empty", "small", "large")
LARGE = 1 << 16  # elements, at least: many of Horovod's chunks, still quick on 2 cores
# Smaller for reducescatter: from about 2**16 elements of 8 bytes, Horovod 0.28.1's Gloo
# reducescatter (its vendored gloo::ReduceScatterHalvingDoubling) intermittently returns
# wrong values in the last ~100-250 elements of rank 0's share, on every binding (horovod.torch
# alone too). A Horovod defect, not hvdkit's; `--large 65536 --case 'reducescatter/*'` shows
# it within a few runs.
REDUCESCATTER_LARGE = 1 << 15
SIZE = 2  # the test's ranks
SPLITTING = ("reducescatter", "allgather", "alltoall")  # along the first axis: not 0-d

# What Horovod 0.28.1 takes (its kernels' registered types). hvdkit's JAX path goes through the
# torch binding, and carries the dtypes that binding lacks as same-width ones for the ops that
# only move bytes; it reduces what the torch binding reduces.
TAKEN = {
    "tensorflow": {
        "allreduce": {"uint8", "int8", "int32", "int64", "float16", "float32", "float64"},
        "reducescatter": {"int32", "int64", "float16", "float32", "float64"},
        "moves": {"bool", "uint8", "int8", "uint16", "int16", "int32", "int64", "float16",
                  "float32", "float64"},
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
TORCH_TYPES = {"bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short",
               "bfloat16": "BFloat16"}  # fmt: skip


@dataclass(frozen=True)
class Case:
    collective: str
    dtype: str
    op: str | None
    shape: str

    @property
    def name(self) -> str:
        return "/".join([self.collective, self.dtype, self.op or "-", self.shape])


def cases() -> list[Case]:
    """The grid, in a fixed order (every rank runs it in this order)."""
    return [
        Case(collective, dtype, op, shape)
        for collective, ops in COLLECTIVES.items()
        for op in ops
        for dtype in DTYPES
        for shape in SHAPES
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


def plan(seed: int, case: Case, size: int = SIZE) -> Plan:
    """Every rank's input for ``case``: the same on every rank that computes it."""
    shared = _rng(seed, case)  # what the ranks must agree on: shapes, root, splits
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
        x = draw(_rng(seed, case, rank), case.dtype, case.op, shape, size)
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


def average(stacked: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Horovod's average: the sum scaled by 1/size. Horovod scales integers in float64 and
    truncates toward zero, so an int64 average above 2**53 is rounded (on TensorFlow and torch
    alike; the JAX path goes through the torch binding)."""
    total = stacked.sum(0)
    if dt.kind in "iu":
        return np.trunc(np.asarray(total, dtype=np.float64) * (1.0 / len(stacked)))
    return total / len(stacked)


def expected_dtype(backend: str, dtype: str) -> str:
    """The result's dtype: the input's, as Keras gives it to the backend (Keras on torch widens
    uint16 and uint32 to int32 and int64; JAX keeps it)."""
    if backend == "torch":
        return {"uint16": "int32", "uint32": "int64"}.get(dtype, dtype)
    return dtype


def expected_error(backend: str, case: Case) -> tuple[str, str] | None:
    """The error's type and a text its message must contain, where the case must fail (None:
    it must succeed)."""
    if case.collective in SPLITTING and case.shape in ("scalar", "0-d"):
        return "ValueError", f"hvd.{case.collective}: the tensor is 0-d"  # hvdkit's refusal
    dtype = expected_dtype(backend, case.dtype)
    kind = "moves" if case.op is None else case.collective
    if dtype in TAKEN[backend][kind]:
        return None
    if backend == "tensorflow":
        return "InvalidArgumentError", f"Value for attr 'T' of {dtype} is not in the list"
    if backend == "torch":
        return "ValueError", f"Tensor type torch.{TORCH_TYPES[dtype]}Tensor is not supported"
    what = "move" if case.op is None else "reduce"
    return "TypeError", f"does not {what} {dtype} tensors on KERAS_BACKEND=jax"


def run_case(hvd: Any, case: Case, p: Plan, rank: int) -> Any:
    x, name = p.inputs[rank], f"grid.{case.name}"
    if case.collective == "allreduce":
        return hvd.allreduce(x, name=name, op=getattr(hvd, case.op))
    if case.collective == "reducescatter":
        return hvd.reducescatter(x, name=name, op=getattr(hvd, case.op))
    if case.collective == "allgather":
        return hvd.allgather(x, name=name)
    if case.collective == "broadcast":
        return hvd.broadcast(x, p.root, name=name)
    received = hvd.alltoall(x, splits=np.array(p.splits[rank], dtype="int32"), name=name)
    return received[0] if isinstance(received, tuple) else received


def compare(got: Any, want: np.ndarray, want_dtype: str) -> str | None:
    """Why ``got`` (the backend's tensor) is not ``want`` (None: it is)."""
    import keras
    import ml_dtypes  # finfo of bfloat16 too

    if not keras.ops.is_tensor(got):
        return f"returned {type(got).__name__}, not the backend's tensor"
    got_dtype = keras.backend.standardize_dtype(got.dtype)
    if got_dtype != want_dtype:
        return f"dtype {got_dtype}, expected {want_dtype}"
    value = np.asarray(keras.ops.convert_to_numpy(got))
    if value.shape != want.shape:
        return f"shape {value.shape}, expected {want.shape}"
    if "float" in want_dtype:  # within one unit in the last place
        a, b = value.astype(np.float64), want.astype(np.float64)
        eps = float(ml_dtypes.finfo(np_dtype(want_dtype)).eps)
        bad = ~np.isclose(a, b, rtol=eps, atol=0, equal_nan=True)
    else:  # exactly, as Python integers
        a, b = value.astype(object), want.astype(object)
        bad = a != b
    if np.any(bad):
        at = tuple(int(k) for k in np.argwhere(bad)[0]) if value.ndim else ()
        return f"value at {at}: {a[at]!r}, expected {b[at]!r} ({int(np.sum(bad))} differ)"
    return None


def check(hvd: Any, backend: str, seed: int, case: Case, observe: bool) -> str | None:
    rank = hvd.rank()
    p = plan(seed, case, hvd.size())
    error = expected_error(backend, case)
    try:
        got = run_case(hvd, case, p, rank)
    except Exception as exc:  # noqa: BLE001 - every failure is a case's outcome
        first = str(exc).splitlines()[0] if str(exc) else ""
        raised = f"raised {type(exc).__name__}: {first[:300]}"
        if observe or error is None:
            return raised
        if type(exc).__name__ != error[0] or error[1] not in str(exc):
            return f"{raised}; expected {error[0]} containing {error[1]!r}"
        return None
    if error is not None and not observe:
        return f"succeeded; expected {error[0]} containing {error[1]!r}"
    return compare(got, oracle(case, p, rank), expected_dtype(backend, case.dtype))


def main() -> None:
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
    rerun = f"--seed {args.seed}" + (f" --large {args.large}" if args.large else "")

    import keras

    import hvdkit.keras as hvd

    hvd.init()
    backend = keras.config.backend()
    grid = [c for c in cases() if args.case is None or fnmatch.fnmatchcase(c.name, args.case)]
    grid = [c for c in grid if not (args.skip and fnmatch.fnmatchcase(c.name, args.skip))]
    start = time.perf_counter()
    failures, outcomes = [], {}
    for case in grid:
        if args.observe:
            print(f"CASE {case.name}", file=sys.stderr, flush=True)
        why = check(hvd, backend, args.seed, case, args.observe)
        outcomes[case.name] = why
        if why and not args.observe:
            failures.append({"case": case.name, "why": why, "repro": (
                f"KERAS_BACKEND={backend} .venv/bin/horovodrun -np 2 -H localhost:2 --gloo "
                f".venv/bin/python tests/workers/keras_collectives_grid_worker.py "
                f"{rerun} --case {case.name}")})  # fmt: skip
    hvd.allreduce(np.zeros(1, "float32"), name="grid.barrier")
    out = {"rank": hvd.rank(), "backend": backend, "cases": len(grid), "failures": failures,
           "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    if args.observe:
        out["outcomes"] = outcomes
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
