"""Imported by tests/ranked/test_keras_fit.py inside the ranks of one job: SyncBatchNormalization
on 2 ranks against keras.layers.BatchNormalization on the whole global batch in one process."""

from __future__ import annotations

import keras
import numpy as np

import hvdkit.keras as hvd


def grads_of(layer, x, weights):
    """Loss sum(out * weights) in training mode: output, d loss / d input, d loss / d (gamma,
    beta), on whichever backend is active."""
    if keras.config.backend() == "torch":
        import torch

        xt = torch.tensor(x, requires_grad=True)
        out = layer(xt, training=True)
        loss = (out * torch.tensor(weights)).sum()
        params = [layer.gamma.value, layer.beta.value]
        g = torch.autograd.grad(loss, [xt, *params])
        return out.detach().numpy(), g[0].numpy(), [t.numpy() for t in g[1:]]
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = layer(xt, training=True)
        loss = tf.reduce_sum(out * weights)
    g = tape.gradient(loss, [xt, layer.gamma.value, layer.beta.value])
    return out.numpy(), g[0].numpy(), [t.numpy() for t in g[1:]]


def main() -> dict:
    hvd.init()
    me, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(8, 3, 4)).astype("float32")
    weights = rng.normal(size=x.shape).astype("float32")
    gamma = rng.normal(size=(4,)).astype("float32")
    rows = slice(me * 4, (me + 1) * 4)

    ref = keras.layers.BatchNormalization(momentum=0.5)
    ref.build(x.shape)
    ref.gamma.assign(gamma)
    ref_out, ref_dx, ref_dp = grads_of(ref, x, weights)

    sync = hvd.SyncBatchNormalization(momentum=0.5)
    sync.build(x[rows].shape)
    sync.gamma.assign(gamma)
    out, dx, dp = grads_of(sync, x[rows], weights[rows])
    dp_global = [np.asarray(keras.ops.convert_to_numpy(hvd.allreduce(d, op=hvd.Sum))) for d in dp]
    moving = [keras.ops.convert_to_numpy(v) for v in (sync.moving_mean, sync.moving_variance)]
    ref_moving = [keras.ops.convert_to_numpy(v) for v in (ref.moving_mean, ref.moving_variance)]
    checks = {
        "output": np.allclose(out, ref_out[rows], atol=1e-4),
        "moving_stats": all(np.allclose(a, b, atol=1e-5) for a, b in zip(moving, ref_moving)),
        "input_grad": np.allclose(dx, ref_dx[rows], atol=1e-4),
        "gamma_beta_grad": all(np.allclose(a, b, atol=1e-3) for a, b in zip(dp_global, ref_dp)),
        "inference_uses_moving_stats": np.allclose(
            keras.ops.convert_to_numpy(sync(x[rows], training=False)),
            keras.ops.convert_to_numpy(ref(x[rows], training=False)), atol=1e-4),
    }  # fmt: skip
    weights_digest = float(sum(np.sum(keras.ops.convert_to_numpy(w)) for w in sync.weights))
    return {"checks": {k: bool(v) for k, v in checks.items()}, "weights": weights_digest}


def fit_check(mode: str) -> dict:
    """``fit`` of [SyncBatchNormalization, Dense] on 2 ranks, each its rows of the global batch,
    against [BatchNormalization, Dense] fitted in this process on the global batch: the same
    weights and moving statistics after a few steps. ``mode``: "compiled" (``compile``'s
    defaults: XLA on JAX), "no_jit" (``jit_compile=False``) or "eager" (``run_eagerly``)."""
    hvd.init()
    me, n, b = hvd.rank(), hvd.size(), 4
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 3.0, size=(3 * b * n, 4)).astype("float32")
    y = rng.normal(size=(3 * b * n, 1)).astype("float32")
    # Each global batch of b * n rows: rank r holds its b rows of each.
    starts = range(0, len(x), b * n)
    mine = np.concatenate([np.arange(s + me * b, s + (me + 1) * b) for s in starts])

    def model(norm: keras.layers.Layer) -> keras.Model:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), norm, keras.layers.Dense(1)])

    sync = model(hvd.SyncBatchNormalization(momentum=0.5))
    compiled = {"no_jit": {"jit_compile": False}, "eager": {"run_eagerly": True}}.get(mode, {})
    sync.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                 **compiled)  # fmt: skip
    sync.fit(x[mine], y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0)
    ref = model(keras.layers.BatchNormalization(momentum=0.5))
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=b * n, epochs=1, shuffle=False, verbose=0)
    ours, theirs = (
        [np.ravel(keras.ops.convert_to_numpy(v)) for v in m.weights] for m in (sync, ref)
    )
    return {"diff": float(max(np.abs(a - c).max() for a, c in zip(ours, theirs, strict=True))),
            "moved": float(np.abs(ours[2]).max())}  # the moving mean  # fmt: skip
