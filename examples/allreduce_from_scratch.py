"""Allreduce by hand with mpi4py (gather+broadcast, parameter server, ring), against Horovod.

    hvdkit run --mpi -np 2 --hostfile hostfiles/localhost -- \\
        python examples/allreduce_from_scratch.py --out plots/
    hvdkit run --mpi -np 4 -H localhost:4 -- python examples/allreduce_from_scratch.py

Needs an MPI world (``hvdkit run --mpi``): the hand-written schemes use mpi4py's point-to-point
calls, which Horovod's Gloo launcher gives no world for. Three parts, printed by rank 0:

1. Three ways to allreduce a float32 array, written out: (a) the d2l way, ``Gather`` to
   rank 0, sum, ``Bcast`` back; (b) a parameter server, rank 0 ``Recv``-ing every worker's
   gradient and ``Send``-ing the average back; (c) a ring, reduce-scatter then allgather over
   neighbours with ``Sendrecv``. Each is checked against ``hvdkit.torch.allreduce`` on the same
   data, then timed beside it over message sizes (bus bandwidth as ``hvdkit bench`` defines it).
2. The alpha-beta cost model (:mod:`hvdkit.bench.costmodel`), fitted on this machine's
   measured neighbour-exchange times, next to the measurement, and extrapolated to N = 16, 512.
3. A data-parallel training loop by hand (split the global batch, gradients per replica,
   allreduce with the ring, SGD step) on the MNIST MLP, against ``hvdkit.torch.setup`` on the
   same batches from the same initial weights: the weights must agree after K steps.

Exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from hvdkit.bench import costmodel
from hvdkit.bench.metrics import KIB, MIB, algbw, busbw, gbps, human_bytes, message_sizes
from hvdkit.rank_zero import print0

MPI_WORLD_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
LABELS = {
    "exchange": "exchange",
    "gather_bcast": "gather+bcast (d2l)",
    "parameter_server": "parameter server",
    "ring": "ring (Sendrecv)",
    "horovod": "horovod",
}
CHECK_LENGTHS = (1, 3, 1001, 65537)  # odd lengths: ring chunks of unequal (even zero) size
RTOL, ATOL = 1e-5, 1e-5  # float32 sums added in another order differ in the last bits
Array = np.ndarray


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default=None,
        help="message sizes in bytes, comma-separated (default 4 KiB..16 MiB, x4)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per size (median)")
    parser.add_argument("--extrapolate", default="16,512", help="world sizes to predict for")
    parser.add_argument("--steps", type=int, default=20, help="training steps K")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split by N")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="max |w_hand - w_hvdkit| allowed after K steps",
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=None, help="directory for the PNG plot")
    args = parser.parse_args(argv)
    args.sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else message_sizes(4 * KIB, 16 * MIB, 4)
    )
    args.extrapolate = [int(n) for n in args.extrapolate.split(",") if n]
    if len(args.sizes) < 2 or any(s < 4 or s % 4 for s in args.sizes):
        parser.error("--sizes: at least two sizes (to fit alpha and beta), multiples of 4 bytes")
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    return args


def require_mpi_world() -> None:
    """Stop with the fix when no MPI launcher started this process (before mpi4py, whose
    import would otherwise quietly make a one-process world)."""
    if any(os.environ.get(v) for v in MPI_WORLD_VARIABLES):
        return
    size = os.environ.get("HOROVOD_SIZE")
    how = f"Horovod's Gloo launcher started {size} ranks but no MPI" if size else "no launcher"
    print0(
        f"allreduce_from_scratch.py needs an MPI world ({how}): the hand-written allreduces use "
        "mpi4py's Send/Recv/Sendrecv.\nFix: hvdkit run --mpi -np 2 --hostfile "
        "hostfiles/localhost -- python examples/allreduce_from_scratch.py",
        file=sys.stderr,
    )
    raise SystemExit(2)


# -- part 1: three allreduces by hand ---------------------------------------------------------


def gather_bcast(comm: Any, x: Array) -> Array:
    """(a) The d2l way: every rank's array to rank 0, summed there, broadcast back (sum)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    stacked = np.empty((n, x.size), x.dtype) if rank == 0 else None
    comm.Gather(x, stacked, root=0)
    total = stacked.sum(axis=0) if stacked is not None else np.empty_like(x)
    comm.Bcast(total, root=0)
    return total


def parameter_server(comm: Any, x: Array) -> Array:
    """(b) Rank 0 is the server: it receives each worker's gradient in turn, and sends the
    average back to each worker (average)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    push, pull = 1, 2
    if rank != 0:
        comm.Send(x, dest=0, tag=push)
        average = np.empty_like(x)
        comm.Recv(average, source=0, tag=pull)
        return average
    total, incoming = x.copy(), np.empty_like(x)
    for worker in range(1, n):
        comm.Recv(incoming, source=worker, tag=push)
        total += incoming
    total /= n
    for worker in range(1, n):
        comm.Send(total, dest=worker, tag=pull)
    return total


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``parts`` near-equal chunks of ``length`` (the first are longer)."""
    q, r = divmod(length, parts)
    starts = [i * q + min(i, r) for i in range(parts + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def ring_allreduce(comm: Any, x: Array) -> Array:
    """(c) Ring allreduce (sum): the array in N chunks; N-1 reduce-scatter steps, then N-1
    allgather steps, each a ``Sendrecv`` to the right neighbour from the left one."""
    rank, n = comm.Get_rank(), comm.Get_size()
    out = x.copy()
    bounds = chunk_bounds(out.size, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = np.empty(bounds[0][1] - bounds[0][0], out.dtype)
    # Reduce-scatter: at step s rank r passes on its partial sum of chunk r-s and adds the
    # left neighbour's partial sum of chunk r-s-1; at the end it holds all of chunk r+1.
    for step in range(n - 1):
        (s0, s1), (r0, r1) = bounds[(rank - step) % n], bounds[(rank - step - 1) % n]
        incoming = scratch[: r1 - r0]
        comm.Sendrecv(out[s0:s1], dest=right, recvbuf=incoming, source=left)
        out[r0:r1] += incoming
    # Allgather: each finished chunk travels once around the ring, overwriting.
    for step in range(n - 1):
        (s0, s1), (r0, r1) = bounds[(rank + 1 - step) % n], bounds[(rank - step) % n]
        comm.Sendrecv(out[s0:s1], dest=right, recvbuf=out[r0:r1], source=left)
    return out


def exchange(comm: Any, x: Array, out: Array | None = None) -> Array:
    """One neighbour exchange (every rank ``Sendrecv``s to the right, from the left at once):
    the step the cost model is fitted on. Timed with a reused ``out``, so the fit sees the
    transfer alone, not the page faults of a fresh buffer."""
    rank, n = comm.Get_rank(), comm.Get_size()
    incoming = np.empty_like(x) if out is None else out
    comm.Sendrecv(x, dest=(rank + 1) % n, recvbuf=incoming, source=(rank - 1) % n)
    return incoming


HAND: dict[str, Callable[[Any, Array], Array]] = {
    "gather_bcast": gather_bcast,
    "parameter_server": parameter_server,
    "ring": ring_allreduce,
}


def check_schemes(comm: Any, hvd: Any, lengths: list[int]) -> bool:
    """Each hand-written scheme against ``hvdkit.torch.allreduce`` on the same random data
    (different on each rank); prints one line per scheme; True when all agree on all ranks."""
    from mpi4py import MPI

    all_ok = True
    for scheme, fn in HAND.items():
        op_name = "Average" if scheme == "parameter_server" else "Sum"
        ok, worst = True, 0.0
        for length in lengths:
            x = np.random.default_rng([comm.Get_rank(), length]).standard_normal(length, np.float32)
            ref = hvd.allreduce(
                torch.from_numpy(x), op=getattr(hvd, op_name), name=f"check.{scheme}.{length}"
            ).numpy()
            mine = fn(comm, x)
            worst = max(worst, float(np.abs(mine - ref).max()))
            ok = ok and mine.shape == ref.shape and bool(np.allclose(mine, ref, RTOL, ATOL))
        ok = bool(comm.allreduce(ok, op=MPI.LAND))
        worst = comm.allreduce(worst, op=MPI.MAX)
        all_ok = all_ok and ok
        print0(
            f"check {LABELS[scheme]:<19} vs hvdkit.torch.allreduce(op={op_name + ')':<8}: "
            f"{'OK' if ok else 'MISMATCH'}  max |diff| {worst:.1e} over {len(lengths)} lengths "
            f"({min(lengths)}..{max(lengths)} floats)"
        )
    return all_ok


def inner_iterations(nbytes: int) -> int:
    """Back-to-back calls per timed round: many for small messages, so the clock's
    resolution and one-off hiccups average out."""
    return max(1, min(50, 4 * MIB // nbytes))


def time_schemes(comm: Any, hvd: Any, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    """Median seconds per call (slowest rank) of each scheme at each size. Schemes take turns
    within every round, so a slow phase of this shared machine hits them all alike."""
    from mpi4py import MPI

    def horovod(x: Array) -> Any:
        return hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, name=f"time.{x.nbytes}")

    medians: dict[str, list[float]] = {name: [] for name in ("exchange", *HAND, "horovod")}
    for nbytes in sizes:
        x = np.random.default_rng(comm.Get_rank()).standard_normal(nbytes // 4, np.float32)
        ops: dict[str, Callable[[Array], Any]] = {
            "exchange": functools.partial(exchange, comm, out=np.empty_like(x)),
            **{name: functools.partial(fn, comm) for name, fn in HAND.items()},
            "horovod": horovod,
        }
        inner = inner_iterations(nbytes)
        rounds: dict[str, list[float]] = {name: [] for name in ops}
        # Round 0 is a warm-up, not kept: buffers, caches, Horovod's first negotiation of a name.
        for round_ in range(repeats + 1):
            for name, op in ops.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(inner):
                    op(x)
                elapsed = comm.allreduce((time.perf_counter() - start) / inner, op=MPI.MAX)
                if round_:
                    rounds[name].append(elapsed)
        for name in ops:
            medians[name].append(statistics.median(rounds[name]))
    return medians


def print_timing(
    sizes: list[int],
    measured: dict[str, list[float]],
    n: int,
    model: costmodel.AlphaBeta,
    repeats: int,
) -> None:
    """Measured ms with the model's prediction in brackets, then bus bandwidth."""
    names = list(measured)
    print0(
        f"\ntime per call, ms: measured (alpha-beta prediction); median of {repeats} rounds, "
        f"slowest rank, N={n}"
    )
    print0(f"{'size':>8}" + "".join(f"{LABELS[s]:>22}" for s in names))
    for i, nbytes in enumerate(sizes):
        cells = []
        for s in names:
            predicted = (
                model.time(costmodel.Cost(1, nbytes, nbytes)) * 1e3
                if s == "exchange"
                else predict_ms(model, s, n, nbytes)
            )
            guess = f"({predicted:.3f})" if predicted is not None else ""
            cells.append(f"{measured[s][i] * 1e3:.3f} {guess:>9}")
        print0(f"{human_bytes(nbytes):>8}" + "".join(f"{c:>22}" for c in cells))
    allreduces = [s for s in names if s != "exchange"]
    print0(f"\nbus bandwidth, GB/s (busbw = algbw * 2(n-1)/n, as hvdkit bench), N={n}")
    print0(f"{'size':>8}" + "".join(f"{LABELS[s]:>22}" for s in allreduces))
    for i, nbytes in enumerate(sizes):
        row = [gbps(busbw(algbw(nbytes, measured[s][i]), n)) for s in allreduces]
        print0(f"{human_bytes(nbytes):>8}" + "".join(f"{v:>22.3f}" for v in row))


def predict_ms(model: costmodel.AlphaBeta, scheme: str, n: int, nbytes: int) -> float | None:
    """The model's ms for a hand-written scheme; None for Horovod (whose algorithm MPI picks)."""
    if scheme not in costmodel.SCHEMES:
        return None
    return costmodel.predict(model, scheme, n, nbytes) * 1e3


# -- part 2: the cost model next to the measurement --------------------------------------------


def fit_model(sizes: list[int], measured: dict[str, list[float]]) -> costmodel.AlphaBeta:
    """alpha and beta from the neighbour-exchange times (one step of ``S`` bytes each)."""
    return costmodel.fit([1] * len(sizes), sizes, measured["exchange"])


def print_model_table(
    model: costmodel.AlphaBeta,
    n: int,
    sizes: list[int],
    measured: dict[str, list[float]],
    world_sizes: list[int],
) -> None:
    """scheme, N, bytes, predicted and (at this N) measured time, for the smallest and the
    largest message: latency-bound and bandwidth-bound."""
    print0(
        f"\nfitted on the measured exchange times (N={n}): alpha = {model.alpha * 1e6:.2f} us, "
        f"beta = {model.beta * 1e9:.4f} ns/byte (1/beta = {gbps(model.bandwidth):.2f} GB/s)"
    )
    header = (
        f"{'scheme':<20}{'N':>5}{'size':>9}{'sent/rank':>12}{'link bytes':>13}"
        f"{'predicted ms':>14}{'measured ms':>13}{'meas/pred':>11}  kind"
    )
    for i in sorted({0, len(sizes) - 1}):
        nbytes = sizes[i]
        print0(
            f"\ncost model at S = {human_bytes(nbytes)} (sent/rank: by the busiest rank; "
            "link bytes: through its link, as the model serialises them)"
        )
        print0(header)
        for scheme in (*costmodel.SCHEMES, "horovod"):
            for ranks in world_sizes if scheme != "horovod" else [n]:
                seconds = measured[scheme][i] if ranks == n else None
                print0(model_row(model, scheme, ranks, nbytes, seconds))
    print0(
        f"(measured: this run, N={n}; predicted: alpha-beta with the fit above. The model counts "
        "messages and bytes only; not in it: the copies and additions, fresh buffers' page "
        "faults, Horovod's ~1 ms negotiation cycle, and waiting for a descheduled rank.)"
    )
    big, far = sizes[-1], max(world_sizes)
    ring, ps = (costmodel.predict(model, s, far, big) for s in ("ring", "parameter_server"))
    print0(
        f"predicted at N={far}, S={human_bytes(big)}: ring {ring * 1e3:.1f} ms, parameter server "
        f"{ps * 1e3:.1f} ms ({ps / ring:.0f}x): the server's link carries 2(N-1)S, a ring link "
        "2(N-1)/N S < 2S"
    )


def model_row(
    model: costmodel.AlphaBeta, scheme: str, ranks: int, nbytes: int, seconds: float | None
) -> str:
    """One table row; ``kind`` says whether it holds a measurement or only the prediction."""
    predicted: float | None = None
    sent = link = "-"
    if scheme in costmodel.SCHEMES:
        cost = costmodel.cost(scheme, ranks, nbytes)
        sent, link = human_bytes(round(cost.sent_bytes)), human_bytes(round(cost.link_bytes))
        predicted = model.time(cost)
    ratio = f"{seconds / predicted:.2f}" if seconds is not None and predicted else "-"
    return (
        f"{LABELS[scheme]:<20}{ranks:>5}{human_bytes(nbytes):>9}{sent:>12}{link:>13}"
        f"{_ms(predicted):>14}{_ms(seconds):>13}{ratio:>11}  "
        f"{'measured' if seconds is not None else 'predicted'}"
    )


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.3f}" if seconds is not None else "-"


def plot(
    path: Path,
    model: costmodel.AlphaBeta,
    n: int,
    sizes: list[int],
    measured: dict[str, list[float]],
    world_sizes: list[int],
) -> Path:
    """Left: time against size at this N, measured (markers) and predicted (dashed). Right:
    predicted time against N at the largest size, this run's measurement marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = sorted({*range(2, 17), *(2**e for e in range(5, 20)), *world_sizes})
    ns = [r for r in ns if r <= max(world_sizes)]
    for k, scheme in enumerate((*costmodel.SCHEMES, "horovod")):
        color = f"C{k}"
        left.plot(
            sizes,
            [t * 1e3 for t in measured[scheme]],
            "o-",
            color=color,
            label=f"{LABELS[scheme]} measured",
        )
        if scheme in costmodel.SCHEMES:
            left.plot(
                sizes,
                [predict_ms(model, scheme, n, s) for s in sizes],
                "--",
                color=color,
                label=f"{LABELS[scheme]} predicted",
            )
            right.plot(
                ns,
                [predict_ms(model, scheme, r, sizes[-1]) for r in ns],
                "--",
                color=color,
                label=f"{LABELS[scheme]} predicted",
            )
        right.plot(
            [n], [measured[scheme][-1] * 1e3], "o", color=color, label=f"{LABELS[scheme]} measured"
        )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="message size (bytes)",
        ylabel="ms per allreduce",
        title=f"N = {n}: measured and alpha-beta predicted",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="ranks N",
        ylabel="ms per allreduce",
        title=f"S = {human_bytes(sizes[-1])}: predicted as N grows",
    )
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- part 3: data-parallel training by hand, against hvdkit.torch ------------------------------


def global_batches(args: argparse.Namespace, rank: int, n: int) -> tuple[list[Any], str]:
    """K steps of this rank's share of the global batch: every rank draws the same global
    batch (same seed) and takes its slice, as d2l's ``split_batch`` does."""
    from hvdkit.data import load_images

    data = load_images("mnist", args.data_dir)
    x = (torch.from_numpy(data.x_train).float().unsqueeze(1) / 255.0 - 0.1307) / 0.3081
    y = torch.from_numpy(data.y_train)
    order = np.random.default_rng(0).permutation(len(y))
    local = args.batch_size // n
    batches = []
    for step in range(args.steps):
        rows = order[np.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(y)]
        mine = torch.from_numpy(rows[rank * local : (rank + 1) * local])
        batches.append((x[mine], y[mine]))
    return batches, data.source


def train_by_hand(comm: Any, model: Any, batches: list[Any], lr: float) -> list[float]:
    """The loop d2l writes: forward and backward on this replica's slice, allreduce the
    gradients with the hand-written ring, divide by N, SGD step. Returns the global losses."""
    n = comm.Get_size()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        # One flat buffer for all gradients: one ring per step instead of one per tensor.
        flat = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
        average = torch.from_numpy(ring_allreduce(comm, flat) / np.float32(n))
        offset = 0
        for p in params:
            p.grad.copy_(average[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        losses.append(comm.allreduce(loss.item()) / n)
    return losses


def train_with_hvdkit(session: Any, batches: list[Any]) -> list[float]:
    """The same steps through ``hvdkit.torch``'s wrapped optimizer."""
    losses = []
    for x, y in batches:
        session.optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(session.model(x), y)
        session.backward_and_step(loss)
        losses.append(session.average(loss.item(), 1, "loss"))
    return losses


def digest(model: Any) -> str:
    """A short hash of every parameter's bytes: equal only for bitwise-equal weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def compare_training(comm: Any, hvd: Any, args: argparse.Namespace) -> bool:
    """Part 3: both loops from the same initial weights on the same batches; prints the max
    weight difference and whether every rank ends with the same weights."""
    from mpi4py import MPI

    from hvdkit.models import mlp

    rank, n = comm.Get_rank(), comm.Get_size()
    batches, source = global_batches(args, rank, n)
    torch.manual_seed(rank)  # each replica starts different, so the broadcast matters
    hand = mlp()
    for p in hand.parameters():
        comm.Bcast(p.data.numpy(), root=0)  # initial weights from rank 0, by hand
    twin = copy.deepcopy(hand)
    session = hvd.setup(
        twin,
        torch.optim.SGD(twin.parameters(), lr=args.lr),
        # hvdkit step 2: pin the device and the CPU threads (both loops below run under it).
        # hvdkit step 3: the optimizer is wrapped in Horovod's DistributedOptimizer (Average).
        # hvdkit step 4: model and optimizer state broadcast from rank 0.
        # hvdkit step 6: no LR scaling, so that both loops take the same SGD steps.
        # hvdkit step 5: left out (no checkpoint): 20 steps compared in memory.
        lr_scaling="none",
    )
    print0(
        f"\ntraining: MLP 784-512-10, SGD lr {args.lr}, global batch {args.batch_size} "
        f"= {n} x {args.batch_size // n}, {args.steps} steps; data: {source}"
    )
    hand_losses = train_by_hand(comm, hand, batches, args.lr)
    hvd_losses = train_with_hvdkit(session, batches)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(hand.parameters(), twin.parameters(), strict=True)
    )
    diff = comm.allreduce(diff, op=MPI.MAX)
    hand_digests = comm.allgather(digest(hand))
    hvd_digests = hvd.allgather_object(digest(twin))
    same_hand, same_hvd = len(set(hand_digests)) == 1, len(set(hvd_digests)) == 1
    ok = diff <= args.tolerance and same_hand and same_hvd
    print0(
        f"loss, step 1 -> {args.steps}: by hand {hand_losses[0]:.4f} -> {hand_losses[-1]:.4f}, "
        f"hvdkit.torch {hvd_losses[0]:.4f} -> {hvd_losses[-1]:.4f}"
    )
    print0(
        f"max |w_hand - w_hvdkit| after {args.steps} steps: {diff:.2e} "
        f"(tolerance {args.tolerance:.0e}): {'OK' if diff <= args.tolerance else 'MISMATCH'}"
    )
    print0(
        f"identical weights on all {n} ranks: by hand {'yes' if same_hand else 'NO'} "
        f"({', '.join(hand_digests)}); hvdkit.torch {'yes' if same_hvd else 'NO'} "
        f"({', '.join(hvd_digests)})"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_mpi_world()
    import hvdkit.torch as hvd
    from hvdkit.devices import cores_per_process

    # hvdkit step 1: initialise Horovod (the MPI controller, in the world mpirun made).
    hvd.init()
    from mpi4py import MPI  # Horovod initialised MPI; mpi4py joins the same world

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    if n < 2 or n != hvd.size():
        print0(f"need >= 2 ranks in one MPI world (MPI {n}, Horovod {hvd.size()})", file=sys.stderr)
        return 2
    if args.batch_size % n:
        print0(f"--batch-size {args.batch_size} must split evenly over {n} ranks", file=sys.stderr)
        return 2
    torch.set_num_threads(cores_per_process(hvd.local_size()))
    cores = len(os.sched_getaffinity(0))
    crowded = f"; {hvd.local_size()} ranks share {cores} cores" if hvd.local_size() > cores else ""
    print0(
        f"allreduce from scratch: N={n} ranks (mpi4py {MPI.Get_version()}, Horovod controller "
        f"{'MPI' if hvd.mpi_enabled() else 'Gloo'}){crowded}\n"
    )

    checks_ok = check_schemes(comm, hvd, sorted({*CHECK_LENGTHS, *(s // 4 for s in args.sizes)}))
    measured = time_schemes(comm, hvd, args.sizes, args.repeats)
    model = fit_model(args.sizes, measured)
    print_timing(args.sizes, measured, n, model, args.repeats)
    world_sizes = sorted({*range(2, n + 1), *args.extrapolate})
    print_model_table(model, n, args.sizes, measured, world_sizes)
    if args.out and comm.Get_rank() == 0:
        png = Path(args.out) / f"allreduce_from_scratch_N{n}.png"
        print0(f"plot: {plot(png, model, n, args.sizes, measured, world_sizes)}")
    elif not args.out:
        print0("(no plot: pass --out DIR for DIR/allreduce_from_scratch_N<n>.png)")
    train_ok = compare_training(comm, hvd, args)
    ok = checks_ok and train_ok
    print0(f"\nallreduce_from_scratch: {'all checks passed' if ok else 'CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
