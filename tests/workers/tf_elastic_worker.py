"""An elastic custom-loop job for tests/test_tensorflow.py, in the shape of Horovod's
``examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py`` with only the import switched to
``hvdkit.tensorflow`` (and Keras 3's forced edits): a ``tf.function`` step with
``DistributedGradientTape``, a first local step that builds the optimizer,
``@hvd.elastic.run``, a commit every ``--commit`` steps, the LR rescaled by a reset callback.

``--state keras`` keeps a ``TensorFlowKerasState(model, opt, batch=0)``; ``--state variables``
a ``TensorFlowState`` of the model's and the optimizer's variables. The worker on host
``--kill-host`` SIGKILLs itself before step ``--kill-at`` (once: a marker file remembers it).
Every rank that finishes prints a RESULT line as tests/workers/elastic_worker.py does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvdkit.tensorflow as hvd


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--commit", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=17)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--state", choices=["keras", "variables"], default="keras")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the first sync equalises
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    lr = 0.02
    opt = keras.optimizers.SGD(lr * hvd.size(), momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 8)).astype("float32")
    y = np.sin(x.sum(1, keepdims=True))

    @tf.function
    def training_step(xb, yb, allreduce=True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # As Horovod's example: one local step makes the optimizer's variables.
    training_step(x[:8], y[:8], allreduce=False)
    # The same start on every worker (the sync below overwrites it; it is what a worker
    # that joins later computes too): the local step is not counted.
    opt.iterations.assign(0)

    seen = {"executed": 0, "sizes": [], "recovered": [], "pending": False}
    marker = Path(args.marker)

    @hvd.elastic.run
    def train(state):
        seen["sizes"].append(hvd.size())
        while state.batch < args.steps:
            if (
                state.batch == args.kill_at
                and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host
                and not marker.exists()
            ):
                marker.write_text(json.dumps({"time": time.time(), "step": state.batch}))
                os.kill(os.getpid(), signal.SIGKILL)
            rows = slice(state.batch * 16 + hvd.rank(), (state.batch + 1) * 16, hvd.size())
            training_step(x[rows], y[rows])
            seen["executed"] += 1
            state.batch += 1
            if seen["pending"]:
                seen["recovered"].append(time.time())
                seen["pending"] = False
            time.sleep(args.sleep)
            if state.batch % args.commit == 0:
                state.commit()

    def on_state_reset():
        opt.learning_rate.assign(lr * hvd.size())  # Keras 3: was opt.lr
        seen["pending"] = True

    if args.state == "keras":
        state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    else:
        state = hvd.elastic.TensorFlowState(model.variables + opt.variables, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

    flat = np.concatenate([np.ravel(v.numpy()) for v in model.variables + opt.variables])
    emit(
        size=hvd.size(),
        steps=int(opt.iterations.numpy()),
        batch=state.batch,
        executed=seen["executed"],
        sizes=seen["sizes"],
        recovered=seen["recovered"],
        lr=float(opt.learning_rate.numpy()),
        digest=hashlib.sha256(flat.astype("float32").tobytes()).hexdigest()[:16],
    )


if __name__ == "__main__":
    main()
