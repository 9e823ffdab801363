"""Run under horovodrun by tests/test_torch_collectives.py: the horovod.torch API beyond the
basics, each result checked here against the value worked out by hand (2 ranks)."""

from __future__ import annotations

import json
import os
import sys

import torch

import hvdkit.torch as hvd


def main() -> None:
    timeline = sys.argv[1]
    even = hvd.ProcessSet([0])
    hvd.init(process_sets=[even])
    me, n = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}
    x = torch.arange(4.0) + 10 * me  # rank 0: 0..3, rank 1: 10..13
    total = sum(torch.arange(4.0) + 10 * r for r in range(n))
    checks["reducescatter"] = torch.equal(
        hvd.reducescatter(x, op=hvd.Sum), total.chunk(n)[me]
    )
    a, b = hvd.grouped_reducescatter([x, 2 * x], op=hvd.Sum)
    checks["grouped_reducescatter"] = torch.equal(a, total.chunk(n)[me]) and torch.equal(
        b, 2 * total.chunk(n)[me]
    )
    checks["reducescatter_async"] = torch.equal(
        hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)), total.chunk(n)[me]
    )
    # Uneven first dimensions: rank r contributes r + 1 rows.
    g1, g2 = hvd.grouped_allgather([torch.full((me + 1, 2), float(me)), torch.tensor([me])])
    checks["grouped_allgather"] = g1.shape == (3, 2) and g1[:1].eq(0).all() and g1[1:].eq(1).all() and g2.tolist() == [0, 1]
    ts = [torch.ones(3) * (me + 1), torch.ones(2) * (me + 1)]
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    checks["grouped_allreduce_"] = all(t.eq(3).all() for t in ts)
    sparse = torch.sparse_coo_tensor([[me]], [float(me + 1)], (4,))
    # As in Horovod, the "handle" is a function returning the reduced sparse tensor.
    dense = hvd.sparse_allreduce_async(sparse, name="sp", op=hvd.Sum)().to_dense()
    checks["sparse_allreduce_async"] = dense.tolist() == [1.0, 2.0, 0.0, 0.0]
    # A static process set holding rank 0 only: a reduction inside it sees rank 0 alone.
    if me == 0:
        checks["process_set"] = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, process_set=even).item() == 5.0
    else:
        checks["process_set"] = not even.included()
    checks["global_process_set"] = hvd.global_process_set.size() == n
    hvd.start_timeline(timeline)
    hvd.allreduce(torch.ones(8), name="timed")
    hvd.stop_timeline()
    # join: rank 1 has one more batch; rank 0 joins and still takes part in its allreduce.
    steps = 2 + me
    for _ in range(steps):
        hvd.allreduce(torch.ones(1), name="uneven")
    last = hvd.join()
    checks["join"] = last in range(n)
    checks["internal_error_class"] = issubclass(hvd.HorovodInternalError, RuntimeError)
    checks["built_queries"] = hvd.gloo_built() and isinstance(hvd.mpi_enabled(), bool)
    # SyncBatchNorm over the global batch equals BatchNorm2d on the whole batch in one process.
    torch.manual_seed(0)
    full = torch.randn(8, 3, 4, 4)
    for layout in ("contiguous", "channels_last"):
        ref_bn, sync_bn = torch.nn.BatchNorm2d(3), hvd.SyncBatchNorm(3)
        inp_full = full.clone().requires_grad_(True)
        ref_out = ref_bn(inp_full)
        ref_out.pow(2).sum().backward()
        mine = full[me * 4 : (me + 1) * 4].clone()
        if layout == "channels_last":
            mine = mine.to(memory_format=torch.channels_last)
        mine.requires_grad_(True)
        out = sync_bn(mine)
        out.pow(2).sum().backward()
        rows = slice(me * 4, (me + 1) * 4)
        checks[f"sync_bn_{layout}"] = (
            torch.allclose(out, ref_out[rows], atol=1e-5)
            and torch.allclose(sync_bn.running_mean, ref_bn.running_mean, atol=1e-6)
            and torch.allclose(sync_bn.running_var, ref_bn.running_var, atol=1e-5)
            and torch.allclose(mine.grad, inp_full.grad[rows], atol=1e-4)
        )
    print("RESULT " + json.dumps({"rank": me, "checks": checks,
                                  "timeline": os.path.getsize(timeline) if me == 0 and os.path.exists(timeline) else None}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
