"""A Horovod Keras script on KERAS_BACKEND=jax under horovodrun, for tests/test_keras_jax.py:
ranks start from their own seeds, fit() with Horovod's callbacks, then rank 0 trains the same
start on the global batches in one process (the oracle); and Horovod's collectives on JAX
arrays."""

from __future__ import annotations

import json
import os

import jax
import keras
import numpy as np

import hvdkit.keras as hvd

STEPS, BATCH, EPOCHS = 4, 8, 2


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def data(size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH * size, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
    return x, y


def build() -> keras.Model:
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def weights(model: keras.Model) -> list[float]:
    return np.concatenate([np.ravel(w) for w in model.get_weights()]).tolist()


def distributed(op_name: str, lr: float) -> dict:
    keras.utils.set_random_seed(1000 + hvd.rank())  # each rank its own start, as in Horovod
    model = build()
    start = weights(model)
    op = {"average": hvd.Average, "sum": hvd.Sum}[op_name]
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.5), op=op)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = hvd.shard(*data(hvd.size()))
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                   hvd.callbacks.MetricAverageCallback()],
    )  # fmt: skip
    # predict: each rank its own rows' predictions, as in Horovod.
    w1, b1, w2, b2 = model.get_weights()
    predicted = model.predict(x[:8], batch_size=4, verbose=0)
    by_hand = np.tanh(x[:8] @ w1 + b1) @ w2 + b2
    return {"start": start, "end": weights(model), "loss": history.history["loss"],
            "predict_gap": float(np.abs(predicted - by_hand).max())}  # fmt: skip


def oracle(start: list[float], lr: float, size: int) -> dict:
    """One process, no distribution: rank 0's start, each step on the ranks' batches side by
    side (what the step of ``size`` ranks sees)."""
    keras.distribution.set_distribution(None)
    x, y = data(size)
    def side_by_side(a: np.ndarray) -> np.ndarray:
        shards = [a[r::size] for r in range(size)]  # hvd.shard's rows
        return np.concatenate(
            [s[k * BATCH : (k + 1) * BATCH] for k in range(STEPS) for s in shards]
        )

    gx, gy = side_by_side(x), side_by_side(y)
    model = build()
    flat, values = np.asarray(start, dtype="float32"), []
    for w in model.get_weights():
        values.append(flat[: w.size].reshape(w.shape))
        flat = flat[w.size :]
    model.set_weights(values)
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.5), loss="mse")
    history = model.fit(gx, gy, batch_size=BATCH * size, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"end": weights(model), "loss": history.history["loss"]}


def collectives() -> dict:
    r = hvd.rank()
    mine = jax.numpy.arange(3, dtype="float32") + r
    gathered = hvd.allgather(jax.numpy.full((r + 1, 2), r, dtype="int32"))
    received, splits = hvd.alltoall(jax.numpy.arange(4, dtype="float32") + 10 * r, splits=[1, 3])
    seeds = hvd.broadcast(jax.numpy.array([r + 7], dtype="uint32"), 1)
    return {
        "average": np.asarray(hvd.allreduce(mine)).tolist(),
        "sum": np.asarray(hvd.allreduce(mine, op=hvd.Sum)).tolist(),
        "max": np.asarray(hvd.allreduce(mine, op=hvd.Max)).tolist(),
        "is_jax": all(isinstance(v, jax.Array) for v in (mine, gathered, received, seeds)),
        "gathered": np.asarray(gathered).tolist(),
        "alltoall": [np.asarray(received).tolist(), np.asarray(splits).tolist()],
        "broadcast": [np.asarray(seeds).tolist(), str(seeds.dtype)],
    }


def refused() -> str:
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum),
                  loss="mse")  # fmt: skip
    x, y = hvd.shard(*data(hvd.size()))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def uneven() -> str:
    """Evaluation shards that differ by a row (hvd.shard(pad=False) of 9 rows)."""
    model = build()
    model.compile(loss="mse")
    x, y = hvd.shard(*[a[:9] for a in data(hvd.size())], pad=False)
    try:
        model.evaluate(x, y, batch_size=16, verbose=0)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def main() -> None:
    hvd.init()
    from jax._src.distributed import global_state

    out = {"backend": keras.config.backend(), "devices": len(jax.devices()),
           "coordinator": global_state.coordinator_address,
           "netns": os.readlink("/proc/self/ns/net")}  # fmt: skip
    out["collectives"] = collectives()
    out["refused"] = refused()
    out["uneven"] = uneven()
    for op_name, lr, oracle_lr in (("average", 0.05, 0.05), ("sum", 0.05, 0.05 * hvd.size())):
        out[op_name] = distributed(op_name, lr)
        out[op_name]["oracle_lr"] = oracle_lr
    if hvd.rank() == 0:
        for op_name in ("average", "sum"):
            run = out[op_name]
            out[f"{op_name}_oracle"] = oracle(run["start"], run["oracle_lr"], hvd.size())
    emit(**out)


if __name__ == "__main__":
    main()
