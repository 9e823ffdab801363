"""Run under horovodrun by tests/test_keras_collectives.py: SyncBatchNormalization on 2 ranks
against keras.layers.BatchNormalization on the whole global batch in one process."""

from __future__ import annotations

import json

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


def main() -> None:
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
    print("RESULT " + json.dumps({"rank": me, "checks": {k: bool(v) for k, v in checks.items()},
                                  "weights": weights_digest}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
