"""Run by tests/test_zero.py: one SGD step with LR 1 from zero weights, the gradients reduced
with ``Compression.bf16``, so that each weight ends at minus the reduced gradient, which the
test computes itself from :func:`targets`. Each rank's gradient is chosen so that rounding to
bf16 matters. Modes: ``torch`` (Horovod's torch loop, through the drop-in module), ``keras``
(``hvdkit.keras.DistributedOptimizer``'s ``apply_gradients``, on ``KERAS_BACKEND``) and
``tape`` (a ``tf.function`` step over ``hvdkit.tensorflow.DistributedGradientTape``)."""

from __future__ import annotations

import json
import sys

import numpy as np

N = 1001  # odd: padded to the world size


def targets(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s gradients: a float32 vector over 9 decades, and 3 float64 values."""
    g = np.random.default_rng(rank)
    w = (g.standard_normal(N) * 10.0 ** g.integers(-6, 3, N)).astype(np.float32)
    return w, g.standard_normal(3)


def report(rank: int, **values) -> None:
    print("RESULT " + json.dumps({"rank": rank, **values}), flush=True)


def torch_loop() -> None:
    import torch

    import hvdkit.torch as hvd

    hvd.init()
    weight = torch.nn.Parameter(torch.zeros(N))
    bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # restored to float64
    unused = torch.nn.Parameter(torch.zeros(2))  # no gradient on any rank: zeros, as Horovod
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([weight, bias, unused], lr=1.0),
        named_parameters=[("weight", weight), ("bias", bias), ("unused", unused)],
        compression=hvd.Compression.bf16,
    )
    w, b = targets(hvd.rank())
    optimizer.zero_grad()
    ((weight * torch.from_numpy(w)).sum() + (bias * torch.from_numpy(b)).sum()).backward()
    optimizer.step()
    report(hvd.rank(), weight=weight.detach().tolist(), bias=bias.detach().tolist(),
           unused=unused.detach().tolist(), dtypes=[str(weight.dtype), str(bias.dtype)])  # fmt: skip


def keras_apply() -> None:
    import keras

    import hvdkit.keras as hvd

    hvd.init()
    weight = keras.Variable(np.zeros(N, np.float32))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hvd.Compression.bf16)
    w, _ = targets(hvd.rank())
    opt.apply_gradients([(keras.ops.convert_to_tensor(w), weight)])
    report(hvd.rank(), weight=keras.ops.convert_to_numpy(weight).tolist())


def tf_tape() -> None:
    import tensorflow as tf

    import hvdkit.tensorflow as hvd

    hvd.init()
    weight = tf.Variable(tf.zeros(N))
    opt = tf.keras.optimizers.SGD(1.0)
    w, _ = targets(hvd.rank())

    @tf.function
    def step(target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weight * target)
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.bf16)
        opt.apply_gradients(zip(tape.gradient(loss, [weight]), [weight]))

    step(tf.constant(w))
    report(hvd.rank(), weight=weight.numpy().tolist())


if __name__ == "__main__":
    {"torch": torch_loop, "keras": keras_apply, "tape": tf_tape}[sys.argv[1]]()
