"""Run under horovodrun by tests/test_direct_collectives_grid.py: every collective of
``hvdkit.torch`` x form x dtype x op x shape, on torch tensors, checked against numpy.

One job runs the whole grid (tests/collectives_grid.py: the cases, each rank's inputs, numpy's
result), each collective through each of its forms (:data:`FORMS`): the in-place ones
(``allreduce_``, ``broadcast_``) must leave the result in the input tensor, the others leave
the input as it was; ``allreduce_async`` goes through ``synchronize``; the grouped ones take
two tensors of the case, each with its own draw; ``alltoall`` also returns the splits it
received. A case expects numpy's value as a tensor of the input's dtype, or a named error
(:func:`expected_error`). Each rank reports its failures, each with a command line that reruns
the case; ``--observe`` reports every case's outcome instead.

Importable without torch or Horovod: the test reads :func:`cases` to know the grid's size.
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

# Each API function checked, and the collective it is.
FORMS = {
    "allreduce": "allreduce",
    "allreduce_": "allreduce",
    "allreduce_async": "allreduce",
    "grouped_allreduce": "allreduce",
    "reducescatter": "reducescatter",
    "grouped_reducescatter": "reducescatter",
    "allgather": "allgather",
    "grouped_allgather": "allgather",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "alltoall": "alltoall",
}
IN_PLACE = ("allreduce_", "broadcast_")


def cases() -> list[Case]:
    """The grid: every form x op x dtype x tensor shape (0-d, empty, small, large)."""
    return grid.grid(FORMS, grid.TENSOR_SHAPES)


def form(case: Case) -> str:
    return case.form or case.collective


def parts(case: Case) -> int:
    """How many tensors the case's function takes."""
    return 2 if form(case).startswith("grouped_") else 1


def expected_error(case: Case) -> tuple[str, str] | None:
    """The error's type and a text its message must contain, where the case must fail (None:
    it must succeed). A 0-d tensor to an op that splits or joins the first axis: hvdkit's
    refusal (``hvdkit.torch.collectives``: Horovod crashes or fails obscurely), or
    reducescatter's own. A dtype Horovod's binding does not take: Horovod's refusal."""
    if case.collective in SPLITTING and case.shape == "0-d":
        return grid.first_axis_refusal("torch", case)
    if grid.taken("torch", case):
        return None
    return grid.horovod_refusal("torch", case.dtype, case.form)


def to_torch(x: np.ndarray) -> Any:
    import torch

    if x.dtype == grid.np_dtype("bfloat16"):  # numpy has no bfloat16 of its own: by its bits
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(grid.np_dtype("bfloat16"))
    return t.numpy()


def run_case(hvd: Any, case: Case, plans: list[Plan], xs: list[Any], rank: int) -> list[Any]:
    """The case's function on this rank's tensors ``xs``: its result for each."""
    import torch

    name, f = f"grid.{case.name}", form(case)
    op = {"op": getattr(hvd, case.op)} if case.op else {}
    if f.startswith("grouped_"):
        return list(getattr(hvd, f)(xs, name=name, **op))
    x, p = xs[0], plans[0]
    if f == "allreduce_async":
        return [hvd.synchronize(hvd.allreduce_async(x, name=name, **op))]
    if f in ("allreduce", "allreduce_", "reducescatter"):
        return [getattr(hvd, f)(x, name=name, **op)]
    if f == "allgather":
        return [hvd.allgather(x, name=name)]
    if f in ("broadcast", "broadcast_"):
        return [getattr(hvd, f)(x, p.root, name=name)]
    splits = torch.tensor(p.splits[rank], dtype=torch.int32)
    received, received_splits = hvd.alltoall(x, splits=splits, name=name)
    if received_splits.tolist() != grid.received_splits(p, rank):
        raise AssertionError(f"received splits {received_splits.tolist()}, expected "
                             f"{grid.received_splits(p, rank)}")  # fmt: skip
    return [received]


def compare(got: Any, want: np.ndarray, dtype: str) -> str | None:
    """Why ``got`` is not ``want`` as a torch tensor of ``dtype`` (None: it is)."""
    import torch

    if not torch.is_tensor(got):
        return f"returned {type(got).__name__}, not a torch tensor"
    got_dtype = str(got.dtype).removeprefix("torch.")
    if got_dtype != dtype:
        return f"dtype {got_dtype}, expected {dtype}"
    return grid.differs(to_numpy(got), want, dtype)


def attempt(hvd: Any, case: Case, plans: list[Plan], rank: int) -> str | None:
    xs = [to_torch(p.inputs[rank]) for p in plans]
    kept = [x.clone() for x in xs]
    got = run_case(hvd, case, plans, xs, rank)
    if len(got) != len(xs):
        return f"{len(got)} results for {len(xs)} tensors"
    for i, (p, x, before, result) in enumerate(zip(plans, xs, kept, got, strict=True)):
        which = f"tensor {i}: " if len(xs) > 1 else ""
        want = grid.oracle(case, p, rank)
        if why := compare(result, want, case.dtype):
            return which + why
        if form(case) in IN_PLACE:
            if why := compare(x, want, case.dtype):
                return f"{which}the input tensor after: {why}"
        elif why := grid.differs(to_numpy(x), to_numpy(before), case.dtype):
            return f"{which}the input changed: {why}"
    return None


def check(hvd: Any, seed: int, case: Case, observe: bool) -> str | None:
    rank, size = hvd.rank(), hvd.size()
    plans = [grid.plan(seed, case, size, part) for part in range(parts(case))]
    return grid.outcome(lambda: attempt(hvd, case, plans, rank), expected_error(case), observe)


def main() -> None:
    args = grid.arguments()

    import torch

    import hvdkit.torch as hvd

    hvd.init()
    torch.set_num_threads(1)  # two ranks on two shared cores
    rerun = (".venv/bin/horovodrun -np 2 -H localhost:2 --gloo "
             ".venv/bin/python tests/workers/torch_collectives_grid_worker.py")  # fmt: skip
    out = grid.run(cases(), args, lambda c: check(hvd, args.seed, c, args.observe), rerun)
    hvd.barrier()
    print("RESULT " + json.dumps({"rank": hvd.rank(), "api": "torch", **out}), flush=True)


if __name__ == "__main__":
    main()
