"""Data-parallel ResNet-18 on Fashion-MNIST with hvdkit.torch (3x3 stride-1 first conv, no
max-pool, as for 28x28 inputs).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_fashion_resnet.py --epochs 2

Uses a local Fashion-MNIST copy when there is one (``--data-dir`` or ``$HVDKIT_DATA_DIR``),
else scikit-learn's digits upsampled to 28x28; ``--synthetic`` for random data.
``--max-steps`` caps the steps per epoch for quick runs on a CPU.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hvdkit.torch as hvd
from hvdkit.data import load_images
from hvdkit.models import resnet18
from hvdkit.rank_zero import print0


def datasets(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset, str]:
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(1024, 1, 28, 28, generator=g), torch.randint(0, 10, (1024,), generator=g)
        return TensorDataset(x[:896], y[:896]), TensorDataset(x[896:], y[896:]), "synthetic"
    data = load_images("fashion", args.data_dir)

    def tensors(x, y):
        x = (torch.from_numpy(x).float().unsqueeze(1) / 255.0 - 0.2860) / 0.3530
        return TensorDataset(x, torch.from_numpy(y))

    return tensors(data.x_train, data.y_train), tensors(data.x_test, data.y_test), data.source


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05, help="single-process learning rate")
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=None, help="per epoch, for quick runs")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--synthetic", action="store_true")
    args = parser.parse_args(argv)

    # hvdkit step 1: initialise Horovod (the world size is needed for the warmup length).
    hvd.init()
    train_set, test_set, source = datasets(args)
    print0(f"data: {source}; {len(train_set)} train / {len(test_set)} test images")
    steps = -(-len(train_set) // (args.batch_size * hvd.size()))
    steps = min(steps, args.max_steps or steps)

    torch.manual_seed(0)
    model = resnet18(classes=10, in_channels=1, small_input=True)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    session = hvd.setup(
        model,
        optimizer,
        scheduler=scheduler,
        # hvdkit step 2: one GPU per process by local rank (CPU when none).
        # hvdkit step 3: Horovod's DistributedOptimizer wraps SGD (channels_last gradients ok).
        # hvdkit step 4: weights and optimizer state broadcast from rank 0.
        # hvdkit step 5: rank-0 checkpoints, resumed on rank 0 and broadcast.
        checkpoint=args.checkpoint,
        # hvdkit step 6: LR x world size after a linear warmup; the cosine schedule composes.
        warmup_epochs=args.warmup_epochs,
        steps_per_epoch=steps,
    )
    loader = session.shard(train_set, batch_size=args.batch_size)
    accuracy = float("nan")
    for epoch in session.epochs(args.epochs):
        total = count = 0.0
        for x, y in session.progress(
            itertools.islice(loader, steps), total=steps, desc=f"epoch {epoch}", leave=False
        ):
            x, y = x.to(session.device), y.to(session.device)
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            session.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(session.model(x), y)
            session.backward_and_step(loss)
            total, count = total + loss.item() * len(y), count + len(y)
        session.scheduler.step()
        session.model.eval()
        correct = seen = 0.0
        with torch.no_grad():
            for x, y in session.shard(test_set, batch_size=256, shuffle=False, pad=False):
                x, y = x.to(session.device), y.to(session.device)
                correct += (session.model(x).argmax(1) == y).sum().item()
                seen += len(y)
        session.model.train()
        accuracy = session.average(correct, seen, "test_acc")
        session.print(
            f"epoch {epoch}: train loss {session.average(total, count, 'loss'):.4f}, "
            f"test accuracy {accuracy:.4f}"
        )
        if args.checkpoint:
            session.save()  # hvdkit step 5
    session.print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
