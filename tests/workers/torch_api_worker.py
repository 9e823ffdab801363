"""Run under horovodrun (2 ranks) by tests/test_torch_api.py: horovod.torch's API through
hvdkit.torch, each result checked here against the value worked out by hand. Prints one
``RESULT {"rank", "checks": {name: true|false|"error ..."}, ...}`` line per rank.

Needs HOROVOD_DYNAMIC_PROCESS_SETS=1 (add/remove_process_set) and HOROVOD_TIMELINE=DYNAMIC
(start/stop_timeline); argv[1] is the timeline file to write."""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from collections.abc import Callable

import horovod.common.exceptions
import horovod.torch
import torch

import hvdkit.torch as hvd

CHECKS: dict[str, object] = {}


def check(name: str, fn: Callable[[], bool]) -> None:
    """Record fn()'s truth, or the text it returns to say what was wrong; an exception is
    recorded (as text), not raised, so that one broken op does not hide the others. Every
    check is collective: both ranks run it."""
    print(f"check {name}", file=sys.stderr, flush=True)  # where a hang happened
    try:
        ok = fn()
        CHECKS[name] = ok if isinstance(ok, str) else bool(ok)
    except Exception as e:  # noqa: BLE001 - reported to the test
        CHECKS[name] = f"error {type(e).__name__}: {e} | {traceback.format_exc(limit=3)[-600:]}"


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=0)


def main() -> None:
    timeline = sys.argv[1]
    only_rank0 = hvd.ProcessSet([0])
    hvd.init(process_sets=[only_rank0])
    me, n = hvd.rank(), hvd.size()
    assert n == 2, "this worker is written for 2 ranks"

    # -- reducescatter: rank r sends x_r; rank r gets its share of sum(x) along dim 0.
    x = torch.arange(8.0).reshape(4, 2) + 100 * me
    total = sum(torch.arange(8.0).reshape(4, 2) + 100 * r for r in range(n))
    mine = total[2 * me : 2 * me + 2]
    check("reducescatter_sum", lambda: equal(hvd.reducescatter(x, op=hvd.Sum), mine))
    check("reducescatter_average", lambda: equal(hvd.reducescatter(x), mine / n))
    check(
        "reducescatter_async",
        lambda: equal(hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)), mine),
    )
    # 5 rows over 2 ranks: rank 0 gets rows 0-2, rank 1 rows 3-4.
    odd = torch.arange(5.0) * (me + 1)
    odd_total = torch.arange(5.0) * 3
    check(
        "reducescatter_uneven",
        lambda: equal(hvd.reducescatter(odd, op=hvd.Sum), odd_total[:3] if me == 0 else odd_total[3:]),
    )
    check(
        "grouped_reducescatter",
        lambda: all(
            equal(got, want)
            for got, want in zip(
                hvd.grouped_reducescatter([x, -x], op=hvd.Sum), [mine, -mine], strict=True
            )
        ),
    )
    check(
        "grouped_reducescatter_async",
        lambda: all(
            equal(got, want)
            for got, want in zip(
                hvd.synchronize(hvd.grouped_reducescatter_async([x, 2 * x], op=hvd.Sum)),
                [mine, 2 * mine],
                strict=True,
            )
        ),
    )

    # -- grouped allgather, first dimensions uneven: rank r contributes r + 1 rows.
    rows = torch.full((me + 1, 2), float(me))
    ids = torch.tensor([10 + me])
    want_rows = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    want_ids = torch.tensor([10, 11])

    def gathered(got: list[torch.Tensor]) -> bool:
        return equal(got[0], want_rows) and equal(got[1], want_ids)

    check("grouped_allgather", lambda: gathered(hvd.grouped_allgather([rows, ids])))
    check(
        "grouped_allgather_async",
        lambda: gathered(hvd.synchronize(hvd.grouped_allgather_async([rows, ids]))),
    )

    # -- in-place grouped allreduce: the same tensor objects end up holding the sums.
    def grouped_inplace(async_: bool) -> bool:
        ts = [torch.ones(3) * (me + 1), torch.ones(2, 2) * (me + 1) * 10]
        ids_before = [id(t) for t in ts]
        if async_:
            returned = hvd.synchronize(hvd.grouped_allreduce_async_(ts, op=hvd.Sum))
        else:
            returned = hvd.grouped_allreduce_(ts, op=hvd.Sum)
        return (
            [id(t) for t in ts] == ids_before
            and all(r is t for r, t in zip(returned, ts, strict=True))
            and equal(ts[0], torch.full((3,), 3.0))
            and equal(ts[1], torch.full((2, 2), 30.0))
        )

    check("grouped_allreduce_", lambda: grouped_inplace(False))
    check("grouped_allreduce_async_", lambda: grouped_inplace(True))

    # -- sparse allreduce: rank r has value r + 1 at index r (and 5 at index 3).
    sparse = torch.sparse_coo_tensor([[me, 3]], [float(me + 1), 5.0], (4,))
    # As in Horovod, the "handle" is a function that returns the reduced sparse tensor.
    check(
        "sparse_allreduce_async_sum",
        lambda: hvd.sparse_allreduce_async(sparse, name="sp.sum", op=hvd.Sum)()
        .to_dense()
        .tolist()
        == [1.0, 2.0, 0.0, 10.0],
    )
    check(
        "sparse_allreduce_async_average",
        lambda: hvd.sparse_allreduce_async(sparse, name="sp.avg", op=hvd.Average)()
        .to_dense()
        .tolist()
        == [0.5, 1.0, 0.0, 5.0],
    )

    # -- process sets. Static: {0} given to init. A Sum inside it sees rank 0 alone.
    def static_set() -> bool:
        if not only_rank0.included():
            return me == 1 and only_rank0.size() == 1
        got = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, process_set=only_rank0)
        return me == 0 and only_rank0.rank() == 0 and got.item() == 5.0

    check("process_set_static", static_set)
    check(
        "global_process_set",
        lambda: hvd.global_process_set.size() == n
        and hvd.global_process_set.rank() == me
        and hvd.global_process_set is horovod.torch.global_process_set,
    )

    # Dynamic: {1} added at run time, used, removed; afterwards global reductions still work.
    def dynamic_set() -> bool:
        ps = hvd.add_process_set([1])
        ok = isinstance(ps, hvd.ProcessSet) and ps.size() == 1 and ps.included() == (me == 1)
        if ps.included():
            got = hvd.allreduce(torch.tensor([7.0 + me]), op=hvd.Sum, process_set=ps)
            ok = ok and got.item() == 8.0 and ps.rank() == 0
        hvd.remove_process_set(ps)
        after = hvd.allreduce(torch.tensor([float(me + 1)]), op=hvd.Sum, name="after.remove")
        return ok and ps.process_set_id is None and after.item() == 3.0

    check("process_set_dynamic", dynamic_set)

    # -- timeline: start, one named op, stop (the test reads the file).
    def timeline_run() -> bool:
        hvd.start_timeline(timeline)
        hvd.allreduce(torch.ones(8), name="timed.op")
        hvd.stop_timeline()
        return True

    check("timeline", timeline_run)

    # -- join with uneven data: rank 1 has one more batch. Summing r + 1: 3 while both take
    # part, then 2 (rank 0 has joined and contributes zeros). join returns the last rank to
    # join, 1, on both ranks.
    def uneven_join() -> bool:
        got = [
            hvd.allreduce(torch.tensor([me + 1.0]), op=hvd.Sum, name="uneven").item()
            for _ in range(2 + me)
        ]
        last = hvd.join()
        return got == ([3.0, 3.0] if me == 0 else [3.0, 3.0, 2.0]) and last == 1

    check("join_uneven", uneven_join)

    check(
        "horovod_internal_error_is_horovods",
        lambda: hvd.HorovodInternalError is horovod.common.exceptions.HorovodInternalError
        and hvd.HorovodInternalError is horovod.torch.HorovodInternalError,
    )
    check(
        "built_and_enabled",
        lambda: all(
            getattr(hvd, q)() == getattr(horovod.torch, q)()
            for q in (
                "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "nccl_built",
                "ddl_built", "ccl_built", "cuda_built", "rocm_built",
            )
        )
        and hvd.gloo_built()
        and hvd.mpi_built()
        and hvd.gloo_enabled() != hvd.mpi_enabled()
        # Horovod raises ValueError for it when MPI is not the controller
        and (not hvd.mpi_enabled() or hvd.mpi_threads_supported() == horovod.torch.mpi_threads_supported()),
    )  # fmt: skip

    sync_batch_norm(me)
    broadcasts(me)
    distributed_optimizer(me, n)

    print("RESULT " + json.dumps({"rank": me, "checks": CHECKS,
                                  "mpi": hvd.mpi_enabled()}), flush=True)  # fmt: skip


def sync_batch_norm(me: int) -> None:
    """2 ranks each with half of a global batch of 8 against BatchNorm on all 8 in one process:
    outputs, running stats, and gradients (input; weight and bias summed over ranks)."""

    def compare(
        full: torch.Tensor,
        make_ref: Callable[[], torch.nn.Module],
        channels_last: bool = False,
        steps: int = 1,
        momentum: float | None = 0.1,
        atol: float = 1e-5,
        grads: bool = True,
    ) -> bool | str:
        """True, or what differed from the reference and by how much."""
        c = full.shape[1]
        ref, sync = make_ref(), hvd.SyncBatchNorm(c, momentum=momentum)
        with torch.no_grad():  # non-trivial affine parameters, the same on both
            for m in (ref, sync):
                m.weight.copy_(torch.linspace(0.5, 2.0, c))
                m.bias.copy_(torch.linspace(-1.0, 1.0, c))
        half = full.shape[0] // 2
        rows = slice(me * half, (me + 1) * half)
        channel_weights = torch.arange(1.0, c + 1).view(1, c, *[1] * (full.dim() - 2))
        pairs: list[tuple[str, torch.Tensor, torch.Tensor, float]] = []
        for step in range(steps):
            batch = full * (step + 1)
            whole = batch.clone().requires_grad_(True)
            ref_out = ref(whole)
            (ref_out.pow(2) * channel_weights).sum().backward()
            part = batch[rows].clone()
            if channels_last:
                part = part.to(memory_format=torch.channels_last)
            part.requires_grad_(True)
            out = sync(part)
            (out.pow(2) * channel_weights).sum().backward()
            if channels_last and not out.is_contiguous(memory_format=torch.channels_last):
                return "output not channels_last"
            # Each rank's weight/bias gradient is its rows' share: the sum is the reference's.
            w_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name=f"bn.wg.{step}")
            b_grad = hvd.allreduce(sync.bias.grad, op=hvd.Sum, name=f"bn.bg.{step}")
            pairs.append((f"output.{step}", out, ref_out[rows], atol))
            if grads:
                pairs += [
                    (f"input_grad.{step}", part.grad, whole.grad[rows], atol * 10),
                    (f"weight_grad.{step}", w_grad, ref.weight.grad, atol * 100),
                    (f"bias_grad.{step}", b_grad, ref.bias.grad, atol * 100),
                ]
            for m in (ref, sync):
                m.weight.grad = m.bias.grad = None
        pairs += [
            ("running_mean", sync.running_mean, ref.running_mean, atol),
            ("running_var", sync.running_var, ref.running_var, atol * 10),
        ]
        # Eval: the running statistics, no communication, same as the reference.
        ref.eval(), sync.eval()
        with torch.no_grad():
            pairs.append(("eval_output", sync(full[rows]), ref(full)[rows], atol))
        bad = [
            f"{what} off by {(got.detach() - want.detach()).abs().max().item():.3g} (atol {tol:g})"
            for what, got, want, tol in pairs
            if not close(got.detach(), want.detach(), tol)
        ]
        if int(sync.num_batches_tracked) != int(ref.num_batches_tracked):
            bad.append(f"num_batches_tracked {int(sync.num_batches_tracked)} != {int(ref.num_batches_tracked)}")
        return "; ".join(bad) or True

    torch.manual_seed(0)
    images = torch.randn(8, 3, 4, 4) * 2 + 0.5
    check("sync_bn_contiguous", lambda: compare(images, lambda: torch.nn.BatchNorm2d(3)))
    check(
        "sync_bn_channels_last",
        lambda: compare(images, lambda: torch.nn.BatchNorm2d(3), channels_last=True),
    )
    # A mean large next to the spread (E[x^2] - mean^2 in float32 loses it: 6% of the output).
    # Forward only: at this conditioning float32 gradients are off the float64 truth by as
    # much in torch's own BatchNorm2d as here (input gradient ~36% relative, both).
    check(
        "sync_bn_large_mean",
        lambda: compare(
            images * 0.25 + 300.0, lambda: torch.nn.BatchNorm2d(3), atol=2e-4, grads=False
        ),
    )
    # 2-D input (BatchNorm1d), cumulative averaging (momentum=None), two steps.
    check(
        "sync_bn_1d_momentum_none",
        lambda: compare(
            torch.randn(8, 5), lambda: torch.nn.BatchNorm1d(5, momentum=None), steps=2,
            momentum=None,
        ),
    )  # fmt: skip


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()  # fmt: skip


def broadcasts(me: int) -> None:
    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def from_rank0(params_of: Callable[[torch.nn.Module], object]) -> bool:
        mine, rank0 = model(me), model(0)
        hvd.broadcast_parameters(params_of(mine), 0)
        return _digest(list(mine.state_dict().values())) == _digest(
            list(rank0.state_dict().values())
        )

    # Horovod takes a state_dict, or a list of parameters or of (name, parameter) pairs.
    check("broadcast_parameters_state_dict", lambda: from_rank0(lambda m: m.state_dict()))
    check("broadcast_parameters_list", lambda: from_rank0(lambda m: list(m.parameters())))
    check(
        "broadcast_parameters_named_list",
        lambda: from_rank0(lambda m: list(m.named_parameters())),
    )

    def invalid_type_is_value_error() -> bool:
        try:
            hvd.broadcast_parameters(3, 0)
        except ValueError:  # Horovod's error type (hvdkit's is also a TypeError)
            return True
        return False

    check("broadcast_parameters_invalid", invalid_type_is_value_error)

    # broadcast_optimizer_state(model=...): a fresh optimizer's parameters get zero gradients,
    # sparse where Horovod makes them sparse (SGD + model's sparse Embedding; SparseAdam).
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 3, sparse=True)
            self.lin = torch.nn.Linear(3, 1)

    def layouts(opt_cls: type, with_model: bool, only_emb: bool = False) -> tuple:
        """The gradients the broadcast leaves on (emb.weight, lin.weight): "sparse" or
        "dense" zeros, or None."""
        torch.manual_seed(0)
        net = Net()
        opt = opt_cls(net.emb.parameters() if only_emb else net.parameters(), lr=0.1)
        before = _digest(list(net.state_dict().values()))
        hvd.broadcast_optimizer_state(opt, 0, model=net if with_model else None)
        assert _digest(list(net.state_dict().values())) == before, "the weights moved"
        grads = (net.emb.weight.grad, net.lin.weight.grad)
        assert all(g is None or not g.to_dense().any() for g in grads), "non-zero gradient"
        return tuple(None if g is None else "sparse" if g.is_sparse else "dense" for g in grads)

    check(
        "bos_sgd_model_sparse_embedding",
        lambda: layouts(torch.optim.SGD, True) == ("sparse", "dense"),
    )
    check("bos_sgd_no_model_dense", lambda: layouts(torch.optim.SGD, False) == ("dense", "dense"))
    check(
        "bos_adam_model_dense",  # Horovod makes them sparse only under SGD (and SparseAdam)
        lambda: layouts(torch.optim.Adam, True) == ("dense", "dense"),
    )
    check(
        "bos_sparse_adam_sparse",
        lambda: layouts(torch.optim.SparseAdam, False, only_emb=True) == ("sparse", None),
    )

    def sparse_training_goes_on() -> bool:
        # With the sparse zero gradient left by the broadcast, a sparse backward accumulates
        # onto it and SparseAdam steps (a dense zero gradient would make it refuse).
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SparseAdam(net.emb.parameters(), lr=0.1)
        hvd.broadcast_optimizer_state(opt, 0, model=net)
        net.emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
        return net.emb.weight.grad.is_sparse

    check("bos_sparse_adam_then_step", sparse_training_goes_on)

    def lbfgs_state() -> bool:
        # Beyond Horovod (which refuses LBFGS): rank 1's state becomes rank 0's.
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 1)
        opt = torch.optim.LBFGS(lin.parameters(), lr=0.5, history_size=3, max_iter=4)
        data = torch.randn(16, 3) * (me + 1)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = lin(data).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
        hvd.broadcast_optimizer_state(opt, 0)
        state = opt.state[lin.weight]
        flat = [state["d"], state["prev_flat_grad"], *state["old_dirs"], *state["old_stps"]]
        digests = hvd.allgather_object(
            (_digest(flat), state["n_iter"], state["func_evals"], opt.param_groups[0]["lr"])
        )
        return digests[0] == digests[1] and state["n_iter"] > 0

    check("bos_lbfgs", lbfgs_state)


def distributed_optimizer(me: int, n: int) -> None:
    def averaged_step() -> bool:
        # Horovod's whole positional signature: (optimizer, named_parameters, compression,
        # backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
        # sparse_as_dense, process_set).
        torch.manual_seed(0)
        lin = torch.nn.Linear(2, 1, bias=False)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(lin.parameters(), lr=1.0),
            lin.named_parameters(),
            hvd.Compression.none,
            1,
            hvd.Average,
            1.0,
            0,
            None,
            False,
            hvd.global_process_set,
        )
        before = lin.weight.detach().clone()
        # d/dw sum(w . x) = x; rank r uses x = (r + 1) * [1, 2]: the average is 1.5 * [1, 2].
        lin(torch.tensor([[1.0, 2.0]]) * (me + 1)).sum().backward()
        opt.step()
        return close(before - lin.weight.detach(), torch.tensor([[1.5, 3.0]]), 1e-6)

    check("distributed_optimizer_positional", averaged_step)


if __name__ == "__main__":
    main()
