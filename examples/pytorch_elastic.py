"""Elastic data-parallel MLP on MNIST with hvdkit.torch.elastic: workers may die or join while
it trains, and it goes on from the last commit.

    hvdkit run --hostfile hostfiles/localhost --min-np 1 --max-np 4 -- \\
        python examples/pytorch_elastic.py --epochs 3

Horovod's elastic pattern, with only the import changed: the training function runs under
``@elastic.run``; ``state.commit()`` every ``--commit-every`` batches bounds what a lost worker
costs; after a reset every rank restores the last commit and the LR follows the new size.
Data as in pytorch_mnist.py (a local MNIST copy, else scikit-learn's digits).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdkit.torch as hvd
from hvdkit import sync
from hvdkit.data import load_images
from hvdkit.models import mlp
from hvdkit.rank_zero import print0
from hvdkit.torch import elastic


def datasets(data_dir: str | None) -> tuple[TensorDataset, TensorDataset]:
    data = load_images("mnist", data_dir)

    def tensors(x, y):
        x = (torch.from_numpy(x).float().unsqueeze(1) / 255.0 - 0.1307) / 0.3081
        return TensorDataset(x, torch.from_numpy(y))

    return tensors(data.x_train, data.y_train), tensors(data.x_test, data.y_test)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="single-process learning rate")
    parser.add_argument("--commit-every", type=int, default=20, help="batches between commits")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    # hvdkit step 1: initialise Horovod (elastic.run re-initialises it after each reset).
    hvd.init()
    # hvdkit step 2: one GPU per process by local rank (CPU here).
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_set, test_set = datasets(args.data_dir)
    torch.manual_seed(0)
    model = mlp().to(device)
    # hvdkit step 6: the LR is the single-process one times the world size; the reset
    # callback below keeps it so when the size changes (no new warmup: the ramp is for the
    # first steps of training, and the model is past them).
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    # hvdkit step 3: Horovod's DistributedOptimizer averages gradients across ranks.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # hvdkit step 5 (elastic form): the state is committed in memory on every rank, so a
    # lost worker (rank 0's included) costs at most --commit-every batches.
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        print0(f"reset: {hvd.size()} process(es), lr {args.lr * hvd.size():.4g}")

    state.register_reset_callbacks([on_reset])

    # hvdkit step 4: elastic.run broadcasts the state from rank 0 (state.sync()) on entry
    # and after every reset, so new workers start from the survivors' weights.
    @elastic.run
    def train(state: elastic.TorchState) -> None:
        for epoch in range(state.epoch, args.epochs):
            # The sampler skips what was committed as done: after a reset this epoch goes on
            # where the last commit left it, with the batches re-split over the new size.
            for batch, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()
                sampler.record_batch(batch, args.batch_size)
                if (batch + 1) % args.commit_every == 0:
                    state.commit()
            print0(f"epoch {epoch}: last batch loss {loss.item():.4f} ({hvd.size()} ranks)")
            state.epoch = epoch + 1
            sampler.set_epoch(epoch + 1)
            state.commit()

    train(state)
    # Replicas must agree after every reset: compare the weights' fingerprints (raises
    # hvdkit.sync.DivergenceError on every rank, naming the first tensor that differs).
    named = list(model.named_parameters())
    local = sync.fingerprint([p.detach().cpu().double().numpy() for _, p in named])
    gathered = hvd.allgather(torch.from_numpy(local)[None], name="pytorch_elastic.sync")
    sync.check([name for name, _ in named], gathered.numpy(), "at the end of training")
    print0(f"weights identical on all {hvd.size()} ranks")
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=512):
            correct += (model(x).argmax(1) == y).sum().item()
            count += len(y)
    accuracy = correct / count
    print0(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
