"""Elastic data-parallel MLP on MNIST with Keras 3 and an elastic hvdkit.keras session: workers
may die or join while it trains, and it goes on from the last commit.

    hvdkit run --hostfile hostfiles/localhost --min-np 1 --max-np 4 -- \\
        python examples/keras_elastic.py --epochs 3 --backend torch

The six-step session made elastic with one option: ``hvdkit.keras.setup(..., elastic=True)``
and ``session.fit`` on the whole arrays (the session shards them for the world as it is). A
lost worker ends ``fit`` on every rank; the session puts back the last commit (every
``--commit-every`` batches and each epoch end), re-initialises Horovod at the new size,
rescales the LR and calls ``fit`` again on a new shard. Rank 0 prints each reset with its time
and the steps redone. Horovod's own shape (``hvd.elastic.KerasState`` and its callbacks under
``@hvd.elastic.run``) works too: see docs/guides/elastic.md. Data as in keras_mnist.py (a local MNIST
copy, else scikit-learn's digits).
"""

from __future__ import annotations

import argparse
import os


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("tensorflow", "torch"), default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="single-process learning rate")
    parser.add_argument("--commit-every", type=int, default=20, help="batches between commits")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--verbose", type=int, default=2, help="fit() verbosity (rank 0 only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend  # must be set before keras is imported
    import keras

    import hvdkit.keras as hvd
    from hvdkit.data import load_images
    from hvdkit.keras.callbacks import check_sync
    from hvdkit.rank_zero import print0

    # hvdkit steps 1 and 2: initialise Horovod and pin one GPU per process by local rank
    # (the session re-initialises Horovod after each reset).
    hvd.init()
    data = load_images("mnist", args.data_dir)
    print0(f"data: {data.source}; Keras backend {keras.config.backend()}")
    x_train = (data.x_train.astype("float32") / 255.0).reshape(len(data.x_train), -1)
    x_test = (data.x_test.astype("float32") / 255.0).reshape(len(data.x_test), -1)

    keras.utils.set_random_seed(hvd.rank())  # differs per rank: step 4 makes it equal
    model = keras.Sequential(
        [
            keras.Input((x_train.shape[1],)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    session = hvd.setup(
        model,
        keras.optimizers.Adam(args.lr),
        # hvdkit step 3: the optimizer is wrapped so gradients are averaged over all ranks.
        # hvdkit step 4: model and optimizer state are broadcast from rank 0, at the start and
        #                after every reset (a joining worker takes the survivors' state).
        # hvdkit step 5 (elastic form): the state is committed in memory on every rank, so a
        #                lost worker (rank 0's included) costs at most --commit-every batches.
        elastic=True,
        commit_every=args.commit_every,
        # hvdkit step 6: the LR is scaled by the world size, and rescaled after each reset.
        lr_scaling="size",
    )
    model.compile(
        optimizer=session.optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    session.fit(
        x_train,  # the whole arrays: the session shards them, again after each reset
        data.y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=args.verbose,
    )
    # Replicas must agree after every reset (raises on every rank, naming the variable).
    check_sync(list(model.trainable_variables), "at the end of training")
    print0(f"weights identical on all {hvd.size()} ranks")
    _, accuracy = model.evaluate(x_test, data.y_test, batch_size=512, verbose=0)
    print0(f"test accuracy: {accuracy:.4f}")
    return float(accuracy)


if __name__ == "__main__":
    main()
