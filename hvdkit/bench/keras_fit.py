"""Keras 3 training throughput, one process per rank: ``python -m hvdkit.bench.keras_fit``.

Both variants train the same CNN (the MNIST example's) on the same synthetic batches with the
same optimizer, on one model. With ``--loop fit``, both are a plain ``model.fit``: "hvdkit"
with ``hvdkit.keras.DistributedOptimizer``, "by hand" with an SGD subclass whose ``apply``
calls Horovod's grouped allreduce on the gradients itself (what Horovod's Keras optimizer
does). On JAX "by hand" is the job written on ``jax.distributed``: Keras's own SGD under the
``DataParallel`` step that ``hvd.init()`` set up (XLA averages the gradients in the step);
the runtime is started once per process, outside the timed steps. With ``--loop custom``
(TensorFlow backend), both are a ``tf.function`` custom-loop step: "hvdkit" with
``hvdkit.tensorflow.DistributedGradientTape``, "by hand" with the same grouped allreduce
written out. Rounds alternate between the two so that machine noise hits both, and a round's
rate is at its median step (:func:`~hvdkit.bench.worker.round_rate`); rank 0 prints samples/s
per variant and the ratio, and the result line ``hvdkit bench`` reads.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from hvdkit import envvars
from hvdkit.bench.worker import emit, pinned_threads, round_rate, timed_rounds


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("tensorflow", "torch", "jax"), default=None)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--steps", type=int, default=40, help="steps per round (>= 2)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per variant")
    parser.add_argument(
        "--loop",
        choices=("fit", "custom"),
        default="fit",
        help="model.fit, or a tf.function custom loop (TensorFlow backend)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    if args.backend:
        os.environ[envvars.KERAS_BACKEND] = args.backend
    import keras
    import numpy as np

    import hvdkit.keras as hvd
    from hvdkit.keras import backend
    from hvdkit.rank_zero import print0

    on_jax = keras.config.backend() == "jax"
    if on_jax and os.environ.get(envvars.BENCH_THREADS):
        # XLA sizes its pool when JAX starts, inside init(): the run's fixed count goes first.
        os.environ["PJRT_NPROC"] = os.environ[envvars.BENCH_THREADS]
    hvd.init()
    threads = pinned_threads(hvd.local_size())  # the same at every world size
    if not on_jax:  # on JAX, init() has sized XLA's pool with it
        backend.set_cpu_threads(threads)
    hvdops = backend.horovod()

    class HandSGD(keras.optimizers.SGD):
        """SGD whose ``apply`` averages the gradients with Horovod's grouped allreduce first:
        what Horovod's own Keras optimizer does, written by hand. Keras's default train step
        is the same for both variants; only the optimizer differs."""

        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            if not on_jax:  # on JAX, XLA has averaged them in the step already
                grads = hvdops.grouped_allreduce(list(grads), op=hvdops.Average)
            return super().apply(grads, trainable_variables)

    def cnn() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    rng = np.random.default_rng(hvd.rank())
    n = args.batch_size * args.steps
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class StepClock(keras.callbacks.Callback):
        """Times each step after the first, end to end, so fit()'s own set-up (data adapter,
        callbacks) is not counted: what is compared is the training step."""

        seconds: list[float]
        last: float

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            now = time.perf_counter()
            if batch == 0:
                self.seconds = []
            else:
                self.seconds.append(now - self.last)
            self.last = now

    def timed_fit(model: Any) -> float:
        clock = StepClock()
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                  callbacks=[clock])  # fmt: skip
        return round_rate(args.batch_size, clock.seconds)  # per rank

    def timed_loop(step: Any) -> float:
        b = args.batch_size
        float(step(x[:b], y[:b]))
        seconds = []
        for i in range(1, args.steps):
            start = time.perf_counter()
            float(step(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]))
            seconds.append(time.perf_counter() - start)
        return round_rate(b, seconds)

    def loop_steps() -> dict[str, Any]:
        """Both custom-loop steps, on one model and optimizer."""
        import tensorflow as tf

        import hvdkit.tensorflow as hvd_tf

        model, opt = cnn(), keras.optimizers.SGD(0.01)

        def make(distributed: bool) -> Any:
            @tf.function(jit_compile=False)
            def step(xb: Any, yb: Any) -> Any:
                with tf.GradientTape() as tape:
                    value = loss(yb, model(xb, training=True))
                if distributed:
                    tape = hvd_tf.DistributedGradientTape(tape)
                    grads = tape.gradient(value, model.trainable_variables)
                else:
                    grads = tape.gradient(value, model.trainable_variables)
                    grads = hvdops.grouped_allreduce(grads, op=hvdops.Average)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return value

            return step

        return {"hvdkit": make(True), "by hand": make(False)}

    def fit_variants() -> dict[str, Any]:
        """One model compiled once per variant (hvdkit's DistributedOptimizer, or a plain
        optimizer and the allreduce by hand); each variant's optimizer and train function
        are put back on the model before its rounds."""
        # One model: two copies of the same model measured 1-7% apart by themselves on this
        # kind of machine, more than the difference looked for.
        model = cnn()
        optimizers = {
            "hvdkit": hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
            "by hand": HandSGD(0.01),
        }
        wired: dict[str, Any] = {}
        for name, optimizer in optimizers.items():
            # JAX compiles its step always; Horovod's ops have no XLA kernels elsewhere.
            model.compile(optimizer=optimizer, loss=loss, jit_compile=on_jax)
            timed_fit(model)  # traces the step, builds the optimizer
            wired[name] = (optimizer, model.train_function)

        def run(name: str) -> float:
            optimizer, function = wired[name]
            # Past Keras's attribute tracking: the optimizer is tracked already.
            object.__setattr__(model, "optimizer", optimizer)
            model.train_function = function
            return timed_fit(model)

        return {name: functools.partial(run, name) for name in wired}

    timed: dict[str, Callable[[], float]]
    if args.loop == "custom":
        steps = loop_steps()
        for step in steps.values():
            timed_loop(step)  # traces the step, builds the optimizer
        timed = {name: functools.partial(timed_loop, step) for name, step in steps.items()}
    else:
        timed = fit_variants()
    # ABBA order, so a drift in machine speed does not favour the one measured first.
    rates = timed_rounds(timed, args.rounds)
    # Rates on this kind of machine jump between levels from round to round, so the ratio is
    # taken within each round (both variants side by side) and its median reported.
    result = {name: statistics.median(values) for name, values in rates.items()}
    ratios = [a / b for a, b in zip(rates["hvdkit"], rates["by hand"], strict=True)]
    result["ratio"] = statistics.median(ratios)
    result["ratio_best"] = max(rates["hvdkit"]) / max(rates["by hand"])
    print0(
        f"Keras {keras.__version__} backend {keras.config.backend()}, "
        f"{'model.fit' if args.loop == 'fit' else 'custom loop'}, {hvd.size()} ranks, "
        f"batch {args.batch_size}/rank, {args.rounds} rounds x {args.steps} steps"
    )
    for name in timed:
        low, high = min(rates[name]), max(rates[name])
        print0(
            f"  {name:8s} median {result[name]:8.1f} samples/s per rank "
            f"(rounds {low:.1f}..{high:.1f})"
        )
    print0(
        f"  ratio hvdkit / by hand: {result['ratio']:.3f} (median of per-round ratios; "
        f"best vs best {result['ratio_best']:.3f})"
    )
    emit({"backend": keras.config.backend(), "loop": args.loop, "ranks": hvd.size(),
          "batch_size": args.batch_size, "threads": threads, "samples_per_s": rates},
    )  # fmt: skip
    return result


if __name__ == "__main__":
    main()
