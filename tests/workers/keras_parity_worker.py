"""Horovod scripts' shapes, run under horovodrun by tests/test_keras_parity.py (KERAS_BACKEND
set by the test). Each mode reports per rank; the test compares the ranks and the expected
values worked out by hand."""

from __future__ import annotations

import json
import sys

import keras
import numpy as np

import hvdkit.keras as hvd
from hvdkit import sync


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def fingerprint(model: keras.Model) -> list[float]:
    return sync.fingerprint([keras.ops.convert_to_numpy(v) for v in model.weights])[:, :2].ravel().tolist()


def horovod_mnist() -> dict:
    """Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py with only the edits Keras 3
    forces: a Sequential with no Input (built at its first batch), unseeded (each rank starts
    from its own weights), compiled without jit_compile, Horovod's callbacks."""
    keras.utils.set_random_seed(1000 + hvd.rank())
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(64,))
    model = keras.Sequential([
        keras.layers.Conv2D(4, [3, 3], activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])  # fmt: skip
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * hvd.size(), warmup_epochs=1),
    ]
    model.fit(x, y, batch_size=16, steps_per_epoch=4, epochs=2, callbacks=callbacks, verbose=0)
    return {"mnist": fingerprint(model), "jit": bool(model.jit_compile)}


def mixed_sparse(sparse_as_dense: bool) -> dict:
    """A dense gradient before an Embedding's (sparse on TensorFlow) in fit()."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((3,), dtype="int32")
    dense_in = keras.Input((2,))
    emb = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(ids))
    merged = keras.layers.Concatenate()([keras.layers.Dense(4)(dense_in), emb])
    model = keras.Model([ids, dense_in], keras.layers.Dense(1)(merged))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=sparse_as_dense)
    # What Keras does by itself on a GPU (XLA); the broadcast callback must turn it off again.
    xla = sparse_as_dense and keras.config.backend() == "tensorflow"
    model.compile(optimizer=opt, loss="mse", jit_compile=True if xla else "auto")
    rng = np.random.default_rng(hvd.rank())
    x = [rng.integers(0, 20, size=(32, 3)).astype("int32"), rng.normal(size=(32, 2)).astype("float32")]
    y = rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    return {f"sparse_{sparse_as_dense}": fingerprint(model)}


class AddGradient(keras.optimizers.Optimizer):
    """variable += gradient: what is applied is visible in the variable (as in Horovod's test)."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


def accumulate(average: bool) -> dict:
    """Horovod's test_gradient_aggregation shape: 4 passes per update, loss = x - y[0] scaled by
    (rank + 1), so the reduced gradient per pass is the mean of 1 and 2 (1.5) for x."""
    opt = hvd.DistributedOptimizer(
        AddGradient(learning_rate=1.0), backward_passes_per_step=4,
        average_aggregated_gradients=average,
    )  # fmt: skip
    x = keras.Variable([0.0])
    y = keras.Variable([1.0, 2.0])
    scale = float(hvd.rank() + 1)
    xs, ys, its = [], [], []
    for _ in range(10):
        # d(loss)/dx = scale, d(loss)/dy = [-scale, 0]
        grads = [keras.ops.convert_to_tensor([scale]), keras.ops.convert_to_tensor([-scale, 0.0])]
        opt.apply(grads, [x, y])
        xs.append(float(keras.ops.convert_to_numpy(x)[0]))
        ys.append(keras.ops.convert_to_numpy(y).tolist())
        its.append(int(keras.ops.convert_to_numpy(opt.iterations)))
    return {f"acc_{average}": {"x": xs, "y": ys, "iterations": its}}


def diverge() -> None:
    """Ranks pushed apart after epoch 1: the sync guard must stop the job."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="probe")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")

    class Nudge(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if hvd.rank() == 1:
                kernel = model.layers[0].kernel
                kernel.assign(kernel + 0.5)

    x = np.ones((16, 4), "float32")
    model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=0,
              callbacks=[Nudge(), hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    emit(finished=True)


def main() -> None:
    hvd.init()
    if sys.argv[1] == "diverge":
        diverge()
        return
    out = horovod_mnist()
    for flag in (False, True):
        out |= mixed_sparse(flag) | accumulate(flag)
    emit(backend=keras.config.backend(), **out)


if __name__ == "__main__":
    main()
