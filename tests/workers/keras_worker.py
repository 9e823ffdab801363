"""Imported by tests/ranked/test_keras_fit.py inside the ranks of one job per Keras backend, or
run under horovodrun (set KERAS_BACKEND first) where the launch is under test (preemption,
the matrix cells, direct starts): each mode returns its results."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

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


def fit(run_eagerly: bool) -> dict:
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
    return dict(weights=digest(model), backend=keras.config.backend(), threads=cpu_threads())


def cpu_threads() -> list[int]:
    """The thread pools this process computes with on CPU."""
    if keras.config.backend() == "torch":
        import torch

        return [torch.get_num_threads()]
    if keras.config.backend() == "jax":
        return [int(os.environ["PJRT_NPROC"])]  # what XLA's CPU client sized its pool from
    import tensorflow as tf

    return [tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads()]  # fmt: skip


def one_step() -> dict:
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
    return dict(
        diff=float(np.abs(weights(model) - weights(ref)).max()),
        moved=float(np.abs(weights(model) - start).max()),
    )


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def metrics() -> dict:
    """Unequal shards (16 vs 48 samples, 20 vs 6 validation), LR 0 so the model is fixed: the
    logs every callback sees must be the global per-sample means."""
    hvd.init()
    model = model_for(0)
    # Plain SGD: shards of unequal length take unequal numbers of steps, and a per-step
    # gradient allreduce would then wait forever (that is what join() is for).
    model.compile(
        optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"], jit_compile=False
    )
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    vx, vy = x[:26] * 2, y[:26] - 1
    mine = slice(0, 16) if hvd.rank() == 0 else slice(16, 64)
    vmine = slice(0, 20) if hvd.rank() == 0 else slice(20, 26)
    recorder = Recorder()  # listed before the averaging callback on purpose
    model.fit(
        x[mine],
        y[mine],
        validation_data=(vx[vmine], vy[vmine]),
        batch_size=16,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[recorder, hvd.callbacks.MetricAverageCallback()],
    )
    pred, vpred = keras.ops.convert_to_numpy(model(x)), keras.ops.convert_to_numpy(model(vx))
    return dict(
        seen=recorder.logs[-1],
        loss=float(np.mean((pred - y) ** 2)),
        mae=float(np.mean(np.abs(pred - y))),
        val_loss=float(np.mean((vpred - vy) ** 2)),
    )


def fit_lr_probe(schedule: bool, samples: int, epochs: int, callback) -> tuple[list, dict]:
    """Fit a 1x1 kernel whose gradient is 1 with SGD (LR 0.2, or 0.2 x 0.9^step as a
    schedule), batch 2: each step's update is the effective LR. Returns those and the
    history."""
    hvd.init()
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    lr = (
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.9)
        if schedule
        else 0.2
    )
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)),
        loss=lambda y_true, y_pred: keras.ops.mean(y_pred),
        jit_compile=False,
    )
    kernels = [0.0]

    class Track(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # self.model: on JAX it writes the trainer's live values back first.
            kernels.append(float(keras.ops.convert_to_numpy(self.model.weights[0])[0, 0]))

    x = np.ones((samples, 1), "float32")
    history = model.fit(
        x, x, batch_size=2, epochs=epochs, verbose=0, shuffle=False, callbacks=[callback, Track()]
    )
    return [kernels[i] - kernels[i + 1] for i in range(len(kernels) - 1)], history.history


def warmup(schedule: bool) -> dict:
    """LearningRateWarmupCallback over the first epoch (4 steps)."""
    callback = hvd.callbacks.LearningRateWarmupCallback(None if schedule else 0.2, warmup_epochs=1)
    lrs, _ = fit_lr_probe(schedule, samples=8, epochs=2, callback=callback)
    return dict(lrs=lrs)


def lr_schedule(schedule: bool) -> dict:
    """LearningRateScheduleCallback: x0.5 per epoch from epoch 1."""
    callback = hvd.callbacks.LearningRateScheduleCallback(
        None if schedule else 0.2, multiplier=lambda epoch: 0.5**epoch, start_epoch=1
    )
    lrs, history = fit_lr_probe(schedule, samples=4, epochs=3, callback=callback)
    return dict(lrs=lrs, logged=history["lr"])


def resume(base: str, epochs: int) -> dict:
    """hvdkit.keras.setup with a checkpoint. Each rank works in its own directory, as on hosts
    without a shared filesystem: only rank 0's may hold files, and the others must get the
    resumed state by broadcast."""
    hvd.init()
    workdir = Path(base) / f"rank{hvd.rank()}"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    model = model_for(seed=hvd.rank())
    session = hvd.setup(model, keras.optimizers.Adam(0.01), checkpoint="ckpt.npz", warmup_steps=3)
    optimizer, callbacks = session
    start = {"epoch": session.epoch, "size": session.size, "rank": session.rank}
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    ran, steps_at = [], []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            ran.append(epoch)
            steps_at.append(int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)))

    class SignalAt(keras.callbacks.Callback):
        """HVDKIT_TEST_SIGNAL_AT=N: SIGUSR1 to rank 1 alone after optimizer step N
        (HVDKIT_TEST_STEP_DELAY: seconds each step takes longer)."""

        def on_train_batch_end(self, batch, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if hvd.rank() == 1 and str(step) == os.environ.get("HVDKIT_TEST_SIGNAL_AT"):
                os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(float(os.environ.get("HVDKIT_TEST_STEP_DELAY", "0")))

    best = hvd.callbacks.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True)
    model.fit(
        x,
        y,
        epochs=epochs,
        batch_size=16,
        shuffle=False,
        verbose=1,
        callbacks=[*callbacks, best, Epochs(), SignalAt()],
    )
    loaded_ok = None
    if hvd.rank() == 0:
        loaded = hvd.load_model("best.keras")
        loaded_ok = bool(getattr(loaded.optimizer, "_hvdkit_distributed", False))
    return dict(
        ran=ran,
        steps_at=steps_at,
        weights=[round(float(w), 6) for w in weights(model)],
        digest=digest(model),
        files=sorted(p.name for p in Path(".").iterdir()),
        loaded_ok=loaded_ok,
        lr=float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
        start=start,
        multiplier=session.lr_multiplier(),
        same=session.optimizer is optimizer and session.model is model,
    )


if __name__ == "__main__":
    mode = sys.argv[1]
    modes = {
        "fit": lambda: fit(False),
        "fit_eager": lambda: fit(True),
        "one_step": one_step,
        "metrics": metrics,
        "warmup_float": lambda: warmup(False),
        "warmup_schedule": lambda: warmup(True),
        "lr_schedule_float": lambda: lr_schedule(False),
        "lr_schedule_schedule": lambda: lr_schedule(True),
        "resume": lambda: resume(sys.argv[2], int(sys.argv[3])),
    }
    emit(**modes[mode]())
