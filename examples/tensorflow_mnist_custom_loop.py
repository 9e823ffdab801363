"""Data-parallel MNIST MLP in a TensorFlow 2 custom training loop with ``hvdkit.tensorflow``:
Horovod's ``examples/tensorflow2/tensorflow2_mnist.py`` pattern (``DistributedGradientTape``
in a ``tf.function`` step, the broadcast after the first step) on Keras 3.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_mnist_custom_loop.py

The same model and data as ``tensorflow_mnist.py`` (its ``model.fit`` twin). Keras 3 edits
against Horovod's example: ``opt.variables`` is a list (was ``opt.variables()``), and the
model, optimizer and loss come from ``keras``. Ends by checking that every rank holds the
same weights.
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse(argv)
    import keras
    import tensorflow as tf

    import hvdkit.tensorflow as hvd  # was: import horovod.tensorflow as hvd
    from hvdkit.data import load_images
    from hvdkit.rank_zero import print0

    hvd.init()
    data = load_images("mnist", args.data_dir)
    print0(f"data: {data.source}; {hvd.size()} ranks")
    n = len(data.x_train) // hvd.size() * hvd.size()
    x_train = data.x_train[hvd.rank() : n : hvd.size()].reshape(-1, 784).astype("float32") / 255
    y_train = data.y_train[hvd.rank() : n : hvd.size()]
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
        len(x_train), seed=hvd.rank()
    )

    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(args.lr * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # Gradients averaged over the ranks.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # After the first step, once Keras has made the optimizer's variables: every rank
        # goes on from rank 0's model and optimizer state.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    first = True
    for epoch in range(args.epochs):
        for images, labels in dataset.batch(args.batch_size, drop_remainder=True):
            loss = training_step(images, labels, first)
            first = False
        print0(f"epoch {epoch + 1}/{args.epochs}: loss {float(loss):.4f}")

    logits = model(data.x_test.reshape(-1, 784).astype("float32") / 255)
    accuracy = float((tf.argmax(logits, 1).numpy() == data.y_test).mean())
    print0(f"test accuracy: {accuracy:.4f}")
    weights = b"".join(v.numpy().tobytes() for v in model.variables)
    digests = hvd.allgather_object(hashlib.sha256(weights).hexdigest())
    print0(f"weights identical on {hvd.size()} ranks: {len(set(digests)) == 1}")
    return accuracy


if __name__ == "__main__":
    main()
