"""Run under horovodrun by tests/test_keras_collectives_grid.py (KERAS_BACKEND set by the test):
every Keras collective of ``hvdkit.keras`` x dtype x op x shape, checked against numpy.

One job runs the whole grid (tests/collectives_grid.py: the cases, each rank's inputs, numpy's
result). A case expects that value as the backend's tensor in the input's dtype, or a named
error (:func:`expected_error`): Horovod 0.28.1's own where its binding does not take the dtype
(TensorFlow, torch), hvdkit's naming the dtype on JAX, and hvdkit's for a 0-d tensor given to
an op that splits the first axis. Each rank reports its failures, each with a command line that
reruns the case; ``--observe`` reports every case's outcome instead (what Horovod does, when
extending the grid).

Importable without Keras or Horovod: the test reads :func:`cases` to know the grid's size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the shared grid
import collectives_grid as grid
from collectives_grid import SPLITTING, Case, Plan


def cases() -> list[Case]:
    """The grid: every collective x op x dtype x shape, numpy scalars included."""
    return grid.grid({c: c for c in grid.COLLECTIVES}, grid.SHAPES)


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
    if grid.taken(backend, case, dtype):
        return None
    if backend == "jax":
        what = "move" if case.op is None else "reduce"
        return "TypeError", f"does not {what} {dtype} tensors on KERAS_BACKEND=jax"
    return grid.horovod_refusal(backend, dtype)


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

    if not keras.ops.is_tensor(got):
        return f"returned {type(got).__name__}, not the backend's tensor"
    got_dtype = keras.backend.standardize_dtype(got.dtype)
    if got_dtype != want_dtype:
        return f"dtype {got_dtype}, expected {want_dtype}"
    return grid.differs(np.asarray(keras.ops.convert_to_numpy(got)), want, want_dtype)


def check(hvd: Any, backend: str, seed: int, case: Case, observe: bool) -> str | None:
    rank = hvd.rank()
    p = grid.plan(seed, case, hvd.size())
    want_dtype = expected_dtype(backend, case.dtype)
    return grid.outcome(
        lambda: compare(run_case(hvd, case, p, rank), grid.oracle(case, p, rank), want_dtype),
        expected_error(backend, case), observe,
    )  # fmt: skip


def main() -> None:
    args = grid.arguments()

    import keras

    import hvdkit.keras as hvd

    hvd.init()
    backend = keras.config.backend()
    rerun = (f"KERAS_BACKEND={backend} .venv/bin/horovodrun -np 2 -H localhost:2 --gloo "
             ".venv/bin/python tests/workers/keras_collectives_grid_worker.py")  # fmt: skip
    out = grid.run(cases(), args, lambda c: check(hvd, backend, args.seed, c, args.observe), rerun)
    hvd.allreduce(np.zeros(1, "float32"), name="grid.barrier")
    print("RESULT " + json.dumps({"rank": hvd.rank(), "backend": backend, **out}), flush=True)


if __name__ == "__main__":
    main()
