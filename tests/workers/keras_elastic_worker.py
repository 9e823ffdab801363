"""A Keras elastic training job for tests/test_elastic.py, in Horovod's shape (``fit`` inside
``@hvd.elastic.run``, the state callbacks, the LR rescaled by a reset callback), on the backend
``KERAS_BACKEND`` names.

The worker on host ``--kill-host`` SIGKILLs itself before optimizer step ``--kill-at`` (once: a
marker file remembers it). Every rank that finishes prints a RESULT line: the optimizer's
step count, how many steps this process executed, the world sizes it saw, the epoch and LR it
ended with, a digest of its weights, and when its first step after each reset ended.
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

import hvdkit.keras as hvd


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


class Probe(keras.callbacks.Callback):
    """Counts executed steps, notes the first step after a reset, and kills this worker."""

    def __init__(self, args, seen):
        super().__init__()
        self.args, self.seen = args, seen

    def on_train_batch_begin(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        marker = Path(self.args.marker)
        if (
            step == self.args.kill_at
            and os.environ.get("HOROVOD_HOSTNAME") == self.args.kill_host
            and not marker.exists()
        ):
            marker.write_text(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getpid(), getattr(signal, self.args.signal))

    def on_train_batch_end(self, batch, logs=None):
        self.seen["executed"] += 1
        if self.seen["pending"]:
            self.seen["recovered"].append(time.time())
            self.seen["pending"] = False
        keep(self.args, self.seen)
        time.sleep(self.args.sleep)


def carried(args) -> Path:
    # On Keras on JAX a reset restarts the process in place (same pid): the counters the
    # RESULT reports live in a file per pid, so they span the restarts.
    return Path(args.marker).with_name(f"seen-{os.getpid()}.json")


def keep(args, seen) -> None:
    carried(args).write_text(json.dumps(seen))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--commit", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=17)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--signal", default="SIGKILL")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--session", action="store_true", help="setup(..., elastic=True)")
    args = parser.parse_args()
    if args.session:
        return session_main(args)

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the first sync equalises
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    base_lr = 0.02
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(base_lr * hvd.size(), momentum=0.9)
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype("float32")
    y = np.sin(x.sum(1, keepdims=True))

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    seen = {"executed": 0, "sizes": [], "recovered": [], "pending": False}
    if carried(args).exists():
        seen = json.loads(carried(args).read_text())

    def on_reset():
        optimizer.learning_rate = base_lr * hvd.size()
        seen["pending"] = True

    state.register_reset_callbacks([on_reset])
    callbacks = [
        Probe(args, seen),  # first: a commit that raises skips the callbacks after it
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit),
    ]

    @hvd.elastic.run
    def train(state):
        seen["sizes"].append(hvd.size())
        keep(args, seen)
        xs, ys = hvd.shard(x, y)  # re-split for the world as it is now
        state.model.fit(
            xs, ys, batch_size=8, epochs=args.epochs - state.epoch, shuffle=False,
            callbacks=callbacks, verbose=0,
        )  # fmt: skip

    train(state)
    flat = np.concatenate([np.ravel(keras.ops.convert_to_numpy(w)) for w in model.weights])
    emit(
        size=hvd.size(),
        steps=int(keras.ops.convert_to_numpy(optimizer.iterations)),
        executed=seen["executed"],
        sizes=seen["sizes"],
        recovered=seen["recovered"],
        epoch=state.epoch,
        lr=float(keras.ops.convert_to_numpy(optimizer.learning_rate)),
        digest=hashlib.sha256(flat.astype("float32").tobytes()).hexdigest()[:16],
    )


def session_main(args) -> None:
    """The same job as a six-step session: setup(..., elastic=True) and session.fit."""
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    session = hvd.setup(
        model, keras.optimizers.SGD(0.02, momentum=0.9), elastic=True, commit_every=args.commit
    )
    model.compile(optimizer=session.optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype("float32")
    y = np.sin(x.sum(1, keepdims=True))
    seen = {"executed": 0, "recovered": [], "pending": False}
    sizes = [session.size]

    class Sizes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if hvd.size() != sizes[-1] or seen["executed"]:
                sizes.append(hvd.size())
                seen["pending"] = True

    session.fit(x, y, batch_size=8, epochs=args.epochs, shuffle=False, verbose=0,
                callbacks=[Probe(args, seen), Sizes()])  # fmt: skip
    flat = np.concatenate([np.ravel(keras.ops.convert_to_numpy(w)) for w in model.weights])
    emit(
        size=hvd.size(),
        steps=int(keras.ops.convert_to_numpy(session.optimizer.iterations)),
        executed=seen["executed"],
        sizes=sizes,
        recovered=seen["recovered"],
        epoch=session.epoch,
        lr=float(keras.ops.convert_to_numpy(session.optimizer.learning_rate)),
        digest=hashlib.sha256(flat.astype("float32").tobytes()).hexdigest()[:16],
    )


if __name__ == "__main__":
    main()
