"""Data-parallel MLP (784-512-10) on MNIST with hvdkit.torch.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_mnist.py --epochs 5

Uses a local MNIST copy when there is one (``--data-dir`` or ``$HVDKIT_DATA_DIR``), else
scikit-learn's digits upsampled to 28x28; ``--synthetic`` for random data (speed runs).
Run it again with the same ``--checkpoint`` and it resumes after the last finished epoch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hvdkit.torch as hvd
from hvdkit.data import ImageData, load_images
from hvdkit.models import mlp
from hvdkit.rank_zero import print0


def datasets(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset, str]:
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4096, 1, 28, 28, generator=g), torch.randint(0, 10, (4096,), generator=g)
        return TensorDataset(x[:3584], y[:3584]), TensorDataset(x[3584:], y[3584:]), "synthetic"
    data: ImageData = load_images("mnist", args.data_dir)

    def tensors(x, y):
        x = (torch.from_numpy(x).float().unsqueeze(1) / 255.0 - 0.1307) / 0.3081
        return TensorDataset(x, torch.from_numpy(y))

    return tensors(data.x_train, data.y_train), tensors(data.x_test, data.y_test), data.source


def evaluate(session: hvd.Session, test_set: TensorDataset) -> tuple[float, float]:
    session.model.eval()
    loss = correct = count = 0.0
    with torch.no_grad():
        for x, y in session.shard(test_set, batch_size=512, shuffle=False, pad=False):
            x, y = x.to(session.device), y.to(session.device)
            out = session.model(x)
            loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            count += len(y)
    session.model.train()
    return session.average(loss, count, "test_loss"), session.average(correct, count, "test_acc")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="single-process learning rate")
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--checkpoint", default=None, help="e.g. checkpoints/pytorch_mnist.pt")
    parser.add_argument("--synthetic", action="store_true")
    args = parser.parse_args(argv)

    # hvdkit step 1: initialise Horovod (setup() below would too; the size is needed first).
    hvd.init()
    train_set, test_set, source = datasets(args)
    print0(f"data: {source}; {len(train_set)} train / {len(test_set)} test images")
    steps_per_epoch = -(-len(train_set) // (args.batch_size * hvd.size()))

    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    session = hvd.setup(
        model,
        optimizer,
        # hvdkit step 2: pin one GPU per process by local rank (CPU here when none).
        # hvdkit step 3: the optimizer is wrapped in Horovod's DistributedOptimizer.
        # hvdkit step 4: model and optimizer state are broadcast from rank 0.
        # hvdkit step 5: checkpoints are written on rank 0 only; resume loads on rank 0 and
        #                broadcasts to all ranks.
        checkpoint=args.checkpoint,
        # hvdkit step 6: the LR is scaled by world size, warmed up over --warmup-epochs.
        lr_scaling="size",
        warmup_epochs=args.warmup_epochs,
        steps_per_epoch=steps_per_epoch,
    )
    if session.resumed is not None:
        session.print(f"resumed from {args.checkpoint} at epoch {session.epoch}")
    loader = session.shard(train_set, batch_size=args.batch_size)
    accuracy = float("nan")
    for epoch in session.epochs(args.epochs):
        total = count = 0.0
        for x, y in session.progress(loader, desc=f"epoch {epoch}", leave=False):
            x, y = x.to(session.device), y.to(session.device)
            session.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(session.model(x), y)
            session.backward_and_step(loss)
            total, count = total + loss.item() * len(y), count + len(y)
        train_loss = session.average(total, count, "train_loss")
        test_loss, accuracy = evaluate(session, test_set)
        session.print(
            f"epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
            f"test accuracy {accuracy:.4f} (lr x{session.lr_multiplier():.2f}, {hvd.size()} ranks)"
        )
        if args.checkpoint:
            session.save()  # hvdkit step 5: rank 0 writes, atomically
    session.print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
