"""Data-parallel MNIST MLP with TensorFlow 2, Keras 3 and ``hvdkit.tensorflow``: Horovod's
TensorFlow seed script (``import horovod.tensorflow as hvd``, ``hvd.DistributedOptimizer``
around the optimizer), with ``model.fit`` in place of the ``tf.estimator`` that TensorFlow
2.16 removed.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_mnist.py

Its custom-loop twin, with ``DistributedGradientTape``, is ``tensorflow_mnist_custom_loop.py``.
Uses a local MNIST copy when there is one (``--data-dir`` or ``$HVDKIT_DATA_DIR``), else
scikit-learn's digits upsampled to 28x28. Ends by checking that every rank holds the same
weights.
"""

from __future__ import annotations

import argparse
import hashlib


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.001, help="single-process learning rate")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--save-model", default=None, help="e.g. tensorflow_mnist.keras")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse(argv)
    import keras

    import hvdkit.tensorflow as hvd  # was: import horovod.tensorflow as hvd
    from hvdkit.data import load_images
    from hvdkit.rank_zero import print0

    # Initialise Horovod and pin one GPU per process, before TensorFlow's first op.
    hvd.init()
    data = load_images("mnist", args.data_dir)
    print0(f"data: {data.source}; {hvd.size()} ranks")

    # Each rank trains on its own equal share of the images (every rank the same number of
    # steps: each step is an allreduce all ranks join).
    n = len(data.x_train) // hvd.size() * hvd.size()
    x_train = data.x_train[hvd.rank() : n : hvd.size()].reshape(-1, 784).astype("float32") / 255
    y_train = data.y_train[hvd.rank() : n : hvd.size()]
    x_test = data.x_test.reshape(-1, 784).astype("float32") / 255

    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    # The learning rate scaled by the number of ranks; gradients averaged over them.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    # jit_compile=False: Horovod's ops have no XLA kernels (Keras turns XLA on for GPUs).
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )
    # Every rank starts from rank 0's weights (the estimator's BroadcastGlobalVariablesHook).
    hvd.broadcast_variables(model.variables, root_rank=0)
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, accuracy = model.evaluate(x_test, data.y_test, verbose=0)
    print0(f"test accuracy: {accuracy:.4f}")
    weights = b"".join(v.numpy().tobytes() for v in model.variables)
    digests = hvd.allgather_object(hashlib.sha256(weights).hexdigest())
    print0(f"weights identical on {hvd.size()} ranks: {len(set(digests)) == 1}")
    if args.save_model and hvd.rank() == 0:
        model.save(args.save_model)  # names the plain Adam: loads without hvdkit
    return float(accuracy)


if __name__ == "__main__":
    main()
