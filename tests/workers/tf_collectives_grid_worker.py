"""Run under horovodrun by tests/test_direct_collectives_grid.py (KERAS_BACKEND=tensorflow):
every collective of ``hvdkit.tensorflow`` x form x dtype x op x shape, on TensorFlow tensors,
checked against numpy.

One job runs the whole grid (tests/collectives_grid.py: the cases, each rank's inputs, numpy's
result), each collective through each of its forms (:data:`FORMS`): eagerly; the grouped ones
take two tensors of the case, each with its own draw; ``broadcast_`` broadcasts two
``tf.Variable``s in place (both from one root) and must leave the result in them;
``function.*`` call the collective inside a ``tf.function``; ``alltoall`` also returns the
splits it received. A case expects numpy's value as a tensor of the input's dtype, or a named
error (:func:`expected_error`). Each rank reports its failures, each with a command line that
reruns the case; ``--observe`` reports every case's outcome instead.

Importable without TensorFlow or Horovod: the test reads :func:`cases` to know the grid's size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the shared grid
import collectives_grid as grid
from collectives_grid import SPLITTING, Case, Plan

# Each API function checked, and the collective it is. function.X: X inside a tf.function.
FORMS = {
    "allreduce": "allreduce",
    "grouped_allreduce": "allreduce",
    "function.allreduce": "allreduce",
    "reducescatter": "reducescatter",
    "grouped_reducescatter": "reducescatter",
    "allgather": "allgather",
    "grouped_allgather": "allgather",
    "function.allgather": "allgather",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "function.broadcast": "broadcast",
    "alltoall": "alltoall",
}


def cases() -> list[Case]:
    """The grid: every form x op x dtype x tensor shape (0-d, empty, small, large)."""
    return grid.grid(FORMS, grid.TENSOR_SHAPES)


def form(case: Case) -> str:
    return case.form or case.collective


def parts(case: Case) -> int:
    """How many tensors the case's function takes."""
    return 2 if form(case).startswith("grouped_") or form(case) == "broadcast_" else 1


def expected_error(case: Case) -> tuple[str, str] | None:
    """The error's type and a text its message must contain, where the case must fail (None:
    it must succeed). A 0-d tensor to an op that splits or joins the first axis: hvdkit's
    refusal (``hvdkit.tensorflow.collectives``: Horovod crashes or fails obscurely), or
    reducescatter's own. A dtype Horovod's binding does not take: Horovod's refusal."""
    if case.collective in SPLITTING and case.shape == "0-d":
        return grid.first_axis_refusal("tensorflow", case)
    if grid.taken("tensorflow", case):
        return None
    return grid.horovod_refusal("tensorflow", case.dtype, case.form)


def run_case(hvd: Any, case: Case, plans: list[Plan], xs: list[Any], rank: int) -> list[Any]:
    """The case's function on this rank's tensors ``xs``: its result for each."""
    import tensorflow as tf

    name, f = f"grid.{case.name}", form(case)
    op = {"op": getattr(hvd, case.op)} if case.op else {}
    if f == "grouped_reducescatter":  # Horovod's takes no name
        return list(hvd.grouped_reducescatter(xs, **op))
    if f.startswith("grouped_"):
        return list(getattr(hvd, f)(xs, name=name, **op))
    if f == "broadcast_":
        return list(hvd.broadcast_(xs, plans[0].root, name=name))
    x, p = xs[0], plans[0]
    if f.startswith("function."):
        collective = f.removeprefix("function.")
        args = (p.root,) if collective == "broadcast" else ()
        fn = tf.function(lambda t: getattr(hvd, collective)(t, *args, name=name, **op))
        return [fn(x)]
    if f == "alltoall":
        splits = tf.constant(p.splits[rank], dtype=tf.int32)
        received, received_splits = hvd.alltoall(x, splits=splits, name=name)
        if received_splits.numpy().tolist() != grid.received_splits(p, rank):
            raise AssertionError(f"received splits {received_splits.numpy().tolist()}, "
                                 f"expected {grid.received_splits(p, rank)}")  # fmt: skip
        return [received]
    if f == "broadcast":
        return [hvd.broadcast(x, p.root, name=name)]
    return [getattr(hvd, f)(x, name=name, **op)]


def compare(got: Any, want: np.ndarray, dtype: str) -> str | None:
    """Why ``got`` is not ``want`` as a TensorFlow tensor of ``dtype`` (None: it is)."""
    import tensorflow as tf

    if not isinstance(got, (tf.Tensor, tf.Variable)):
        return f"returned {type(got).__name__}, not a tf.Tensor"
    if got.dtype.name != dtype:
        return f"dtype {got.dtype.name}, expected {dtype}"
    return grid.differs(np.asarray(got.numpy()), want, dtype)


def attempt(hvd: Any, case: Case, plans: list[Plan], rank: int) -> str | None:
    import tensorflow as tf

    if form(case) == "broadcast_":
        for p in plans[1:]:
            p.root = plans[0].root  # one broadcast_, one root
        xs = [tf.Variable(p.inputs[rank], name=f"v{i}") for i, p in enumerate(plans)]
    else:
        xs = [tf.constant(p.inputs[rank]) for p in plans]
    got = run_case(hvd, case, plans, xs, rank)
    if len(got) != len(xs):
        return f"{len(got)} results for {len(xs)} tensors"
    for i, (p, x, result) in enumerate(zip(plans, xs, got, strict=True)):
        which = f"tensor {i}: " if len(xs) > 1 else ""
        want = grid.oracle(case, p, rank)
        if why := compare(result, want, case.dtype):
            return which + why
        if isinstance(x, tf.Variable) and (why := compare(x, want, case.dtype)):
            return f"{which}the variable after: {why}"
    return None


def check(hvd: Any, seed: int, case: Case, observe: bool) -> str | None:
    rank, size = hvd.rank(), hvd.size()
    plans = [grid.plan(seed, case, size, part) for part in range(parts(case))]
    return grid.outcome(lambda: attempt(hvd, case, plans, rank), expected_error(case), observe)


def main() -> None:
    args = grid.arguments()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

    import tensorflow as tf

    import hvdkit.tensorflow as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)  # two ranks on two shared cores
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rerun = ("KERAS_BACKEND=tensorflow .venv/bin/horovodrun -np 2 -H localhost:2 --gloo "
             ".venv/bin/python tests/workers/tf_collectives_grid_worker.py")  # fmt: skip
    out = grid.run(cases(), args, lambda c: check(hvd, args.seed, c, args.observe), rerun)
    hvd.barrier()
    print("RESULT " + json.dumps({"rank": hvd.rank(), "api": "tensorflow", **out}), flush=True)


if __name__ == "__main__":
    main()
