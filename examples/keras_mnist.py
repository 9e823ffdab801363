"""Data-parallel CNN on MNIST with Keras 3 and hvdkit.keras, on the TensorFlow, torch or JAX backend.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_mnist.py --backend torch

Horovod's Keras MNIST example (the same CNN, Adadelta at LR 1.0 x size, 12 epochs shared out
across the ranks) on Keras 3. Uses a local MNIST copy when there is one (``--data-dir`` or
``$HVDKIT_DATA_DIR``), else scikit-learn's digits upsampled to 28x28. Run it again with the
same ``--checkpoint`` and it resumes after the last finished epoch.
"""

from __future__ import annotations

import argparse
import math
import os


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("tensorflow", "torch", "jax"),
        default=None,
        help="Keras backend (default: $KERAS_BACKEND, else tensorflow)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: ceil(12 / ranks)")
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=1.0, help="single-process learning rate")
    parser.add_argument("--warmup-epochs", type=float, default=0.0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--checkpoint", default=None, help="e.g. checkpoints/keras_mnist.npz")
    parser.add_argument("--save-model", default=None, help="best model, e.g. keras_mnist.keras")
    parser.add_argument("--verbose", type=int, default=2, help="fit() verbosity (rank 0 only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend  # must be set before keras is imported
    import keras

    import hvdkit.keras as hvd
    from hvdkit.data import load_images
    from hvdkit.rank_zero import print0

    # hvdkit steps 1 and 2: initialise Horovod and pin one GPU per process by local rank
    # (before the model is built: TensorFlow fixes its devices at its first op).
    hvd.init()
    data = load_images("mnist", args.data_dir)
    print0(f"data: {data.source}; {len(data.x_train)} train / {len(data.x_test)} test images")
    print0(f"Keras {keras.__version__}, backend {keras.config.backend()}, {hvd.size()} ranks")

    def prepare(x):
        return (x.astype("float32") / 255.0)[..., None]

    # Each rank trains on its own equal share; evaluation sees every test image once.
    x_train, y_train = hvd.shard(prepare(data.x_train), data.y_train)
    x_test, y_test = prepare(data.x_test), data.y_test
    if keras.config.backend() == "jax":
        # On JAX one compiled step spans the ranks: their shards must be as long, so the
        # remainder (fewer images than ranks) is left out of the evaluation.
        keep = len(x_test) - len(x_test) % hvd.size()
        x_test, y_test = x_test[:keep], y_test[:keep]
    x_test, y_test = hvd.shard(x_test, y_test, pad=False)
    epochs = args.epochs or math.ceil(12 / hvd.size())

    keras.utils.set_random_seed(hvd.rank())  # differs per rank: step 4 makes it equal
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    optimizer, callbacks = hvd.setup(
        model,
        keras.optimizers.Adadelta(args.lr),
        # hvdkit step 3: the optimizer is wrapped so gradients are averaged over all ranks.
        # hvdkit step 4: model and optimizer state are broadcast from rank 0.
        # hvdkit step 5: with --checkpoint, rank 0 saves after every epoch (atomically), and a
        #                rerun resumes: rank 0 reads the file and broadcasts it.
        checkpoint=args.checkpoint,
        # hvdkit step 6: the LR is scaled by world size (1.0 x size), with optional warmup.
        lr_scaling="size",
        warmup_epochs=args.warmup_epochs,
        steps_per_epoch=math.ceil(len(x_train) / args.batch_size),
    )
    if args.save_model:
        # hvdkit step 5: the best model by (global) validation loss, written by rank 0 only.
        callbacks.append(
            hvd.callbacks.ModelCheckpoint(args.save_model, monitor="val_loss", save_best_only=True)
        )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=epochs,
        validation_data=(x_test, y_test),
        callbacks=callbacks,  # includes the rank-0 progress bar and metric averaging
        verbose=args.verbose,
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)  # global means
    print0(f"test loss: {loss:.4f}")
    print0(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
