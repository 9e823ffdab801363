"""Imported by tests/ranked/test_keras_inputs.py in the ranks of a Keras job: Session.fit on one
kind of input, against an oracle in the same process: one plain Keras model (no Horovod) trained
on the global batches, the ranks' k-th batches together."""

from __future__ import annotations

import hashlib

import keras
import numpy as np
from keras_worker import model_for, weights
from tolerance import max_difference, paths_close

import hvdkit.keras as hvd

B, STEPS, EPOCHS, LR = 4, 3, 2, 0.05
LOADING = {  # Keras 2's fit(workers=...) arguments, given to Session.fit
    "pydataset": {"workers": 2, "max_queue_size": 4},
    "pydataset-processes": {"workers": 2, "use_multiprocessing": True},
}


class Batches(keras.utils.PyDataset):
    """Batch i: rows i*B .. i*B + B - 1, as a data set that loads slowly would serve them."""

    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def run(spec: str) -> dict:
    """One ``fit`` on the input kind ``spec`` (``KIND`` or ``KIND:uneven``)."""
    kind, _, variant = spec.partition(":")
    uneven = variant == "uneven"
    size = hvd.size()
    n = B * size * STEPS + (B if uneven else 0)  # uneven: one batch more than the ranks share
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    model = model_for(0)
    session = hvd.setup(model, keras.optimizers.SGD(LR), lr_scaling="none")
    model.compile(optimizer=session.optimizer, loss="mse", jit_compile=False)
    count = Count()
    common = {"epochs": EPOCHS, "verbose": 0, "callbacks": [count]}
    if kind == "arrays":
        session.fit(x, y, batch_size=B, shuffle=False, **common)
    elif kind == "tf.data":
        import tensorflow as tf

        session.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), **common)
    elif kind.startswith("pydataset"):
        session.fit(Batches(x, y, B), shuffle=False, **LOADING[kind], **common)
    elif kind in ("torch-loader", "torch-dataset"):
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        if kind == "torch-loader":
            session.fit(DataLoader(data, batch_size=B, shuffle=False), **common)
        else:
            session.fit(data, batch_size=B, shuffle=False, **common)
    elif kind == "generator":

        def batches():
            while True:
                for i in range(n // B):
                    yield x[i * B : (i + 1) * B], y[i * B : (i + 1) * B]

        session.fit(batches(), steps_per_epoch=STEPS, **common)
    else:
        raise SystemExit(f"unknown kind {kind}")
    mine = weights(model)
    result = {"batches": count.batches,
              "digest": hashlib.sha256(mine.tobytes()).hexdigest()}  # fmt: skip
    if not uneven:
        oracle = model_for(0)
        oracle.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
        if kind.startswith("pydataset"):
            # The same loading: Keras's torch backend with workers > 1 starts each run one
            # batch later (its first batch is taken to read the shapes), with or without hvdkit.
            global_batches = Batches(x, y, B * size, **LOADING[kind])
            oracle.fit(global_batches, shuffle=False, epochs=EPOCHS, verbose=0)
        else:
            oracle.fit(x, y, batch_size=B * size, shuffle=False, epochs=EPOCHS, verbose=0)
        expected = weights(oracle)
        result |= {"oracle_close": paths_close(mine, expected, "float32", EPOCHS * STEPS),
                   "difference": max_difference(mine, expected),
                   "moved": float(np.abs(expected - weights(model_for(0))).max())}  # fmt: skip
    return result


def main(specs: list[str]) -> dict:
    hvd.init()
    return {"rank": hvd.rank(), "runs": {spec: run(spec) for spec in specs}}
