"""Run under horovodrun by tests/test_keras_adapter.py (set KERAS_BACKEND first)."""

from __future__ import annotations

import hashlib
import json
import sys

import keras
import numpy as np

import hvdkit.keras as hvd


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def model_for(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def weights(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in model.weights])


def digest(model: keras.Model) -> str:
    return hashlib.sha256(weights(model).astype(np.float32).tobytes()).hexdigest()


def fit(run_eagerly: bool) -> None:
    hvd.init()
    model = model_for(seed=hvd.rank())  # different on purpose: the callback must fix it
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="mse", jit_compile=False, run_eagerly=run_eagerly)
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    model.fit(
        x,
        y,
        epochs=2,
        batch_size=16,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    emit(weights=digest(model), backend=keras.config.backend())


def one_step() -> None:
    """np=2 x batch B with LR x size == np=1 x batch 2B."""
    hvd.init()
    b, lr = 8, 0.05
    rng = np.random.default_rng(5)
    x = rng.normal(size=(b * hvd.size(), 4)).astype("float32")
    y = rng.normal(size=(b * hvd.size(), 1)).astype("float32")
    model = model_for(0)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr * hvd.size())),
        loss="mse",
        jit_compile=False,
    )
    mine = slice(hvd.rank() * b, (hvd.rank() + 1) * b)
    model.fit(x[mine], y[mine], batch_size=b, epochs=1, verbose=0, shuffle=False)
    ref = model_for(0)
    ref.compile(optimizer=keras.optimizers.SGD(lr * hvd.size()), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    start = weights(model_for(0))
    emit(
        diff=float(np.abs(weights(model) - weights(ref)).max()),
        moved=float(np.abs(weights(model) - start).max()),
    )


if __name__ == "__main__":
    mode = sys.argv[1]
    {"fit": lambda: fit(False), "fit_eager": lambda: fit(True), "one_step": one_step}[mode]()
