"""Run under horovodrun by tests/test_torch_adapter.py; prints one RESULT json line per rank."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import hvdkit.torch as hvd
from hvdkit import rank_zero


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def make_model(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])


def digest(model: torch.nn.Module) -> str:
    """Bit-exact fingerprint of the weights (short enough for tagged MPI output)."""
    return hashlib.sha256(flat(model).numpy().tobytes()).hexdigest()


def data(n: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def train(args):
    # Every rank starts from different weights: setup must broadcast rank 0's.
    model = make_model(rank_zero.rank() if args.ranks_differ else 0, args.hidden)  # before init
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    torch.manual_seed(1000 + rank_zero.rank())  # per-rank randomness; resume restores it
    session = hvd.setup(
        model, opt, scheduler=sched, checkpoint=args.checkpoint, warmup_steps=args.warmup_steps
    )
    x, y = data(args.samples)
    loader = session.shard(torch.utils.data.TensorDataset(x, y), batch_size=8)
    for epoch in session.epochs(args.epochs):
        total = count = 0.0
        for xb, yb in loader:
            session.optimizer.zero_grad(set_to_none=True)
            noise = 1e-3 * torch.randn_like(xb)  # consumes RNG: resume must restore it
            loss = F.cross_entropy(session.model(xb + noise), yb)
            session.backward_and_step(loss)
            if session.step_count == args.signal_at and hvd.rank() == args.signal_rank:
                os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler's warning to one rank
            time.sleep(args.step_delay)
            total += loss.item() * len(xb)
            count += len(xb)
        session.scheduler.step()
        session.average(total, count)
        if args.checkpoint:
            session.save(batches=len(loader))
        if args.stop_after is not None and epoch + 1 == args.stop_after:
            break
    ckpts = sorted(os.listdir(os.path.dirname(args.checkpoint))) if args.checkpoint else []
    emit(
        params=digest(session.model),
        # The values too (9 digits hold a float32 exactly), for a run that took another path
        # (tests/test_slurm.py: a rank per node with all its cores, MPI): to a tolerance.
        weights=[float(f"{w:.9g}") for w in flat(session.model).tolist()],
        steps=session.step_count,
        files=ckpts,
        resumed=session.resumed,
    )


def one_step_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """One step of the session at per-rank batch B, and one process's step at batch B x size
    and the LR x size (the oracle): the two models after it."""
    b, lr = 4, 0.1
    hvd.init()
    x, y = data(b * hvd.size(), seed=7)
    model = make_model(0)
    session = hvd.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    mine = slice(hvd.rank() * b, (hvd.rank() + 1) * b)
    session.optimizer.zero_grad()
    session.backward_and_step(F.cross_entropy(session.model(x[mine]), y[mine]))
    ref = make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr * hvd.size())
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    return session.model, ref


def one_step(args):
    """np=2 with per-rank batch B and LR scaled by size == np=1 with batch 2B and LR x 2."""
    model, ref = one_step_models()
    diff = (flat(model) - flat(ref)).abs().max().item()
    moved = (flat(model) - flat(make_model(0))).abs().max().item()
    emit(diff=diff, moved=moved)


def horovod_script(args):
    """A horovod.torch-style script with only the import changed (Horovod's MNIST shape)."""
    hvd.init()
    torch.manual_seed(42 + hvd.rank())
    model = make_model(0 + hvd.rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
        op=hvd.Average,
    )
    x, y = data(64)
    for i in range(4):
        xb, yb = x[i * 16 + hvd.rank() * 8 :][:8], y[i * 16 + hvd.rank() * 8 :][:8]
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    loss = hvd.allreduce(torch.tensor(1.0 + hvd.rank()), name="avg_loss").item()
    gathered = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
    obj = hvd.broadcast_object({"from": hvd.rank()}, root_rank=0)
    hvd.join()
    hvd.barrier()
    emit(params=digest(model), loss=loss, gathered=gathered, obj=obj)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--checkpoint")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--ranks-differ", action="store_true")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--signal-at", type=int, help="train: SIGUSR1 to itself after step N")
    parser.add_argument("--signal-rank", type=int, default=1)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    modes = {
        "train": train,
        "one_step": one_step,
        "horovod_script": horovod_script,
    }
    modes[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
