"""Imported by tests/ranked/test_keras_inputs.py in the ranks of a Keras job: Session.fit on the
inputs of issue 49's items 8-11, keeping a ledger of the samples each rank trained.

Column 0 of every row is its id; the model's first layer (:class:`Ledger`) drops it and keeps
the ids of the batch it was called on, which a callback reads after each step. The ranks'
ledgers are gathered, and an oracle (one plain Keras process, no Horovod) is trained on the
same global batches: the ranks' k-th batches together."""

from __future__ import annotations

import hashlib
import math

import keras
import numpy as np
from tolerance import max_difference, paths_close

import hvdkit.keras as hvd
from hvdkit.keras import backend

LR = 0.05
ROWS, BATCH = 110, 10  # item 10's numbers: 11 batches over 2 ranks
# validation_split: 111 rows, the last 12 held out (floor(111 * 0.9) = 99 train); split per
# rank (56 rows, 50 train each), rows 0-99 trained: row 99, held out by one process, too.
SPLIT_ROWS, SPLIT = 111, 0.1


class Ledger(keras.layers.Layer):
    """Drops the id column, keeping how often each id was in the batch it was called on."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def build(self, shape):
        self.seen = self.add_weight(
            shape=(self.n,), initializer="zeros", trainable=False, name="seen"
        )

    def call(self, x):
        ids = keras.ops.cast(x[:, 0], "int32")
        self.seen.assign(keras.ops.sum(keras.ops.one_hot(ids, self.n), axis=0))
        return x[:, 1:]


class Book(keras.callbacks.Callback):
    """The ids of each step, read off the ledger."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger, self.steps, self.epochs = ledger, [], []
        self.val_loss = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(len(self.steps))  # the step each epoch starts at

    def on_train_batch_end(self, batch, logs=None):
        counts = np.rint(keras.ops.convert_to_numpy(self.ledger.seen)).astype(int)
        self.steps.append(np.repeat(np.arange(len(counts)), counts).tolist())


def data(n):
    rng = np.random.default_rng(7)
    ids = np.arange(n, dtype="float32")[:, None]
    x = np.concatenate([ids, rng.normal(size=(n, 4))], axis=1).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32"), rng.uniform(0.5, 2, n).astype("float32")


def model_for(n, inputs):
    """Seeded weights; one input ``(5,)`` or (``inputs="dict"``/``"list"``) two."""
    keras.utils.set_random_seed(0)
    ledger = Ledger(n)
    main = keras.Input((5,), name="main")
    hidden = ledger(main)
    if inputs == "one":
        sources = main
    else:
        extra = keras.Input((4,), name="extra")
        hidden = keras.layers.Concatenate()([hidden, extra])
        sources = {"main": main, "extra": extra} if inputs == "dict" else [main, extra]
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    model = keras.Model(sources, keras.layers.Dense(1)(hidden))
    return model, ledger


def trainable(model):
    return np.concatenate(
        [np.ravel(keras.ops.convert_to_numpy(v)) for v in model.trainable_weights]
    )


def fit(spec, session, x, y, weight, book, mapped):
    """``session.fit`` on the input ``spec`` names; returns the epochs asked for."""
    size, common = hvd.size(), {"verbose": 0, "callbacks": [book]}
    if spec in ("subset-sampler", "weighted-sampler"):
        import torch
        from torch.utils.data import DataLoader, SubsetRandomSampler, WeightedRandomSampler

        rows = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        if spec == "subset-sampler":
            sampler = SubsetRandomSampler(held_in(len(x)))
        else:  # the second half never drawn; 50 draws a rank
            sampler = WeightedRandomSampler(torch.tensor(weight * (np.arange(len(x)) < 55)), 100)
        session.fit(DataLoader(rows, batch_size=BATCH // size, sampler=sampler), epochs=2, **common)
        return 2
    if spec in ("shuffled-tf.data", "unknown-tf.data"):
        import tensorflow as tf

        def expensive(row):
            mapped.append(int(row[0]))
            return row

        tf.random.set_seed(None)  # model_for's seed cleared: each process shuffles its own way
        rows = tf.data.Dataset.from_tensor_slices((x, y))
        if spec == "shuffled-tf.data":  # as the tf.data guide writes it: no seed
            rows = rows.map(lambda a, b: (tf.py_function(expensive, [a], tf.float32), b))
            rows = rows.map(lambda a, b: (tf.ensure_shape(a, (5,)), b)).shuffle(len(x))
            session.fit(rows.batch(BATCH // size), epochs=2, **common)
            return 2
        rows = rows.filter(lambda a, b: a[0] >= 0).batch(BATCH)  # a length TF cannot know
        session.fit(rows, steps_per_epoch=4, epochs=3, **common)
        return 3
    if spec == "finite-generator":

        def batches():  # 11, one more than the ranks share
            for i in range(0, len(x), BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

        session.fit(batches(), steps_per_epoch=4, epochs=3, **common)
        return 3
    if spec == "validation-split":
        history = session.fit(x, y, validation_split=SPLIT, batch_size=BATCH // size, epochs=2,
                              **common)  # fmt: skip
        book.val_loss = history.history["val_loss"][-1]
        return 2
    extra = x[:, 1:] * 2
    labels = [float(v) for v in y[:, 0]]  # a Python list, as Keras 2 took
    if spec == "dict-sample-weight":
        inputs = {"main": x, "extra": extra}
        session.fit(inputs, labels, sample_weight=weight, batch_size=BATCH // size, epochs=2,
                    shuffle=False, **common)  # fmt: skip
        return 2
    assert spec == "list-inputs", spec
    session.fit([x, extra], y, batch_size=BATCH // size, epochs=2, shuffle=False, **common)
    return 2


def held_in(n):
    """The training rows of a held-out split: every row but each third, and an odd count."""
    return [i for i in range(n) if i % 3 != 2][:-1]


def oracle(spec, n, x, y, weight, global_steps):
    """One plain Keras process trained on the gathered global batches."""
    kind = {"dict-sample-weight": "dict", "list-inputs": "list"}.get(spec, "one")
    model, _ = model_for(n, kind)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
    for ids in global_steps:
        main, extra = x[ids], x[ids, 1:] * 2
        inputs = {"one": main, "dict": {"main": main, "extra": extra}, "list": [main, extra]}
        sw = weight[ids] if spec == "dict-sample-weight" else None
        model.train_on_batch(inputs[kind], y[ids], sample_weight=sw)
    if spec != "validation-split":
        return trainable(model), None
    at = math.floor(n * (1 - SPLIT))
    return trainable(model), model.evaluate(x[at:], y[at:], verbose=0)


def run(spec):
    n = SPLIT_ROWS if spec == "validation-split" else ROWS
    x, y, weight = data(n)
    kind = {"dict-sample-weight": "dict", "list-inputs": "list"}.get(spec, "one")
    model, ledger = model_for(n, kind)
    start = trainable(model)
    session = hvd.setup(model, keras.optimizers.SGD(LR), lr_scaling="none")
    model.compile(optimizer=session.optimizer, loss="mse", jit_compile=False)
    book, mapped = Book(ledger), []
    try:
        epochs = fit(spec, session, x, y, weight, book, mapped)
    except (TypeError, ValueError) as error:  # alike on every rank, before the first step
        return {"error": f"{type(error).__name__}: {error}"}
    mine = trainable(model)
    ledgers = backend.horovod().allgather_object(book.steps, name=f"ledger.{spec}")
    result = {
        "steps": book.steps,
        "epoch_starts": book.epochs,
        "epochs": epochs,
        "mapped": len(mapped),
        "digest": hashlib.sha256(mine.tobytes()).hexdigest(),
        "moved": float(np.abs(mine - start).max()),
    }
    if len({len(steps) for steps in ledgers}) == 1:
        global_steps = [sum(batches, []) for batches in zip(*ledgers, strict=True)]
        expected, val_loss = oracle(spec, n, x, y, weight, global_steps)
        result |= {
            "oracle_close": paths_close(mine, expected, "float32", len(global_steps)),
            "difference": max_difference(mine, expected),
        }
        if book.val_loss is not None:  # on the held-out rows, with the last weights
            result["val_close"] = paths_close(book.val_loss, val_loss, "float32", len(global_steps))
    return result


def main(specs: list[str]) -> dict:
    hvd.init()
    return {"rank": hvd.rank(), "runs": {spec: run(spec) for spec in specs}}
