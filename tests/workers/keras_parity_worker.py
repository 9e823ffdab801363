"""Horovod scripts' shapes, run under horovodrun by tests/test_keras_parity.py (KERAS_BACKEND
set by the test). Each mode reports per rank; the test compares the ranks and the expected
values worked out by hand."""

from __future__ import annotations

import hashlib
import json
import sys

import keras
import numpy as np

import hvdkit.keras as hvd
from hvdkit import sync
from hvdkit.keras import backend


def emit(**values):
    print("RESULT " + json.dumps({"rank": hvd.rank(), **values}), flush=True)


def fingerprint(model: keras.Model) -> list[float]:
    return sync.fingerprint([keras.ops.convert_to_numpy(v) for v in model.weights])[:, :2].ravel().tolist()


def horovod_mnist() -> dict:
    """Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py with only the edits Keras 3
    forces: a Sequential with no Input (built at its first batch), unseeded (each rank starts
    from its own weights), compiled without jit_compile, Horovod's callbacks."""
    keras.utils.set_random_seed(1000 + hvd.rank())
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(64,))
    model = keras.Sequential([
        keras.layers.Conv2D(4, [3, 3], activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])  # fmt: skip
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * hvd.size(), warmup_epochs=1),
    ]
    model.fit(x, y, batch_size=16, steps_per_epoch=4, epochs=2, callbacks=callbacks, verbose=0)
    return {"mnist": fingerprint(model), "jit": bool(model.jit_compile)}


def mixed_sparse(sparse_as_dense: bool) -> dict:
    """A dense gradient before an Embedding's (sparse on TensorFlow) in fit()."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((3,), dtype="int32")
    dense_in = keras.Input((2,))
    emb = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(ids))
    merged = keras.layers.Concatenate()([keras.layers.Dense(4)(dense_in), emb])
    model = keras.Model([ids, dense_in], keras.layers.Dense(1)(merged))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=sparse_as_dense)
    # What Keras does by itself on a GPU (XLA); the broadcast callback must turn it off again.
    xla = sparse_as_dense and keras.config.backend() == "tensorflow"
    model.compile(optimizer=opt, loss="mse", jit_compile=True if xla else "auto")
    rng = np.random.default_rng(hvd.rank())
    x = [rng.integers(0, 20, size=(32, 3)).astype("int32"), rng.normal(size=(32, 2)).astype("float32")]
    y = rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    return {f"sparse_{sparse_as_dense}": fingerprint(model)}


class AddGradient(keras.optimizers.Optimizer):
    """variable += gradient: what is applied is visible in the variable (as in Horovod's test)."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


class AllreduceCount:
    """Counts the grouped allreduces Horovod runs for gradients. The count is a variable, so
    that compiled steps count each run, not each trace."""

    def __init__(self) -> None:
        self.runs = keras.Variable(0.0, trainable=False, name="allreduce_runs")
        module = backend.horovod()
        original = module.grouped_allreduce

        def counted(tensors, *args, **kwargs):
            self.runs.assign_add(1.0)
            return original(tensors, *args, **kwargs)

        module.grouped_allreduce = counted

    def take(self) -> int:
        n = int(keras.ops.convert_to_numpy(self.runs))
        self.runs.assign(0.0)
        return n


def accumulate(average: bool, count: AllreduceCount) -> dict:
    """Horovod's test_gradient_aggregation shape: 4 passes per update, loss = x - y[0] scaled by
    (rank + 1), so the reduced gradient per pass is the mean of 1 and 2 (1.5) for x."""
    opt = hvd.DistributedOptimizer(
        AddGradient(learning_rate=1.0), backward_passes_per_step=4,
        average_aggregated_gradients=average,
    )  # fmt: skip
    x = keras.Variable([0.0])
    y = keras.Variable([1.0, 2.0])
    count.take()
    scale = float(hvd.rank() + 1)
    xs, ys, its = [], [], []
    for _ in range(10):
        # d(loss)/dx = scale, d(loss)/dy = [-scale, 0]
        grads = [keras.ops.convert_to_tensor([scale]), keras.ops.convert_to_tensor([-scale, 0.0])]
        opt.apply(grads, [x, y])
        xs.append(float(keras.ops.convert_to_numpy(x)[0]))
        ys.append(keras.ops.convert_to_numpy(y).tolist())
        its.append(int(keras.ops.convert_to_numpy(opt.iterations)))
    # Reduced once per update, not once per pass (Horovod's message count).
    # Horovod's _agg_helper.counter (its tests read it): passes since the last update.
    pending = int(keras.ops.convert_to_numpy(opt._agg_helper.counter))
    return {f"acc_{average}": {"x": xs, "y": ys, "iterations": its, "allreduces": count.take(),
                               "pending": pending}}  # fmt: skip


def small_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(5, activation="tanh", name="a"),
        keras.layers.Dense(3, activation="tanh", name="b"), keras.layers.Dense(1, name="c"),
    ])  # fmt: skip


def global_batches(batch: int, steps: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Each rank's (x, y), and the global data a single process sees in the same order: its
    batch i is every rank's batch i, rank by rank."""
    per_rank = [
        (np.random.default_rng(r).normal(size=(batch * steps, 6)).astype("float32"),
         np.random.default_rng(10 + r).normal(size=(batch * steps, 1)).astype("float32"))
        for r in range(hvd.size())
    ]  # fmt: skip
    xs = [np.concatenate([x[i * batch:(i + 1) * batch] for x, _ in per_rank]) for i in range(steps)]
    ys = [np.concatenate([y[i * batch:(i + 1) * batch] for _, y in per_rank]) for i in range(steps)]
    return per_rank, np.concatenate(xs), np.concatenate(ys)


def fit_against_one_process(count: AllreduceCount, label: str, make_opt, ref_opt) -> dict:
    """fit() on 2 ranks with the distributed optimizer against fit() in one process on the
    global batches with ``ref_opt``; also counts the gradient allreduces fit() ran."""
    batch, steps = 4, 8
    per_rank, gx, gy = global_batches(batch, steps)
    model, ref = small_model(11), small_model(11)
    model.compile(optimizer=make_opt(model), loss="mse", jit_compile=False)
    ref.compile(optimizer=ref_opt, loss="mse", jit_compile=False)
    x, y = per_rank[hvd.rank()]
    count.take()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    runs = count.take()
    ref.fit(gx, gy, batch_size=batch * hvd.size(), epochs=1, shuffle=False, verbose=0)
    gap = max(
        float(np.abs(keras.ops.convert_to_numpy(a) - keras.ops.convert_to_numpy(b)).max())
        for a, b in zip(model.weights, ref.weights, strict=True)
    )
    # A digest of the exact weights: MPI splits long output lines.
    digest = hashlib.sha256(b"".join(
        np.ascontiguousarray(keras.ops.convert_to_numpy(w)).tobytes() for w in model.weights
    )).hexdigest()  # fmt: skip
    return {f"fit_{label}": {"allreduces": runs, "gap": gap, "weights": digest}}


def optimizer_options(count: AllreduceCount) -> dict:
    out: dict = {}
    # 2 passes per update, summed (Horovod): one process with Keras's own accumulation
    # (their mean) at twice the LR. 8 batches: 4 updates, so 4 allreduces.
    out |= fit_against_one_process(
        count, "accumulate",
        lambda m: hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2),
        keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
    )  # fmt: skip
    # Fused groups: 6 gradients in 4 groups per step (2+2+1+1); or a, c's kernel together and
    # the 3 others alone. Same values as one group.
    out |= fit_against_one_process(
        count, "groups4",
        lambda m: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=4),
        keras.optimizers.SGD(0.1),
    )  # fmt: skip
    out |= fit_against_one_process(
        count, "groups_vars",
        lambda m: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1),
            groups=[[*m.get_layer("a").trainable_weights, m.get_layer("c").kernel]],
            device_dense="/cpu:0",
        ),
        keras.optimizers.SGD(0.1),
    )  # fmt: skip
    out |= already_reduced() | partial()
    return out


def partial() -> dict:
    """PartialDistributedOptimizer (horovod.keras): layer c's gradients stay each rank's own,
    so c ends different on the two ranks (different data), a and b identical."""
    per_rank, _, _ = global_batches(4, 4)
    model = small_model(11)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=model.get_layer("c"))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(*per_rank[hvd.rank()], batch_size=4, epochs=1, shuffle=False, verbose=0)

    def digest(name: str) -> str:
        return hashlib.sha256(b"".join(
            np.ascontiguousarray(keras.ops.convert_to_numpy(w)).tobytes()
            for w in model.get_layer(name).weights
        )).hexdigest()  # fmt: skip

    return {"partial": {name: digest(name) for name in "abc"}}


class RankGradient(keras.optimizers.Optimizer):
    """Horovod's process-set test optimizer, in Keras 3's spelling: get_gradients gives the
    rank, and the update adds the gradient to the variable."""

    def get_gradients(self, loss, params):
        return [keras.ops.convert_to_tensor([float(hvd.rank())]) for _ in params]

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


def already_reduced() -> dict:
    """get_gradients/compute_gradients reduce (with Sum here, so a second reduction would
    show) and the apply_gradients after them applies what they returned."""
    out = {}
    opt = hvd.DistributedOptimizer(RankGradient(learning_rate=1.0), op=hvd.Sum)
    v = keras.Variable([0.0])
    (grad,) = opt.get_gradients(None, [v])
    opt.apply_gradients([(grad, v)])
    out["get_gradients"] = float(keras.ops.convert_to_numpy(v)[0])  # 0 + 1
    # Horovod's test_process_set_optimizer: {0} and {1} are static sets; a rank reduces
    # within its set, which holds only itself, so it keeps its own gradient.
    for label, ranks in (("set0", [0]), ("set1", [1])):
        ps = next(s for s in PROCESS_SETS if s.ranks == ranks)
        opt = hvd.DistributedOptimizer(RankGradient(learning_rate=1.0), process_set=ps)
        v = keras.Variable([0.0])
        (grad,) = opt.get_gradients(None, [v])
        opt.apply_gradients([(grad, v)])
        out[f"process_set_{label}"] = float(keras.ops.convert_to_numpy(v)[0])
    if keras.config.backend() == "tensorflow":
        import tensorflow as tf

        opt = hvd.DistributedOptimizer(AddGradient(learning_rate=1.0), op=hvd.Sum)
        w = keras.Variable([0.0])
        with tf.GradientTape() as tape:
            loss = w.value * float(hvd.rank() + 1)
        pairs = opt.compute_gradients(loss, [w], tape=tape)
        opt.apply_gradients(pairs)
        out["compute_gradients"] = float(keras.ops.convert_to_numpy(w)[0])  # 1 + 2
    return out


def diverge() -> None:
    """Ranks pushed apart after epoch 1: the sync guard must stop the job."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="probe")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")

    class Nudge(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if hvd.rank() == 1:
                kernel = model.layers[0].kernel
                kernel.assign(kernel + 0.5)

    x = np.ones((16, 4), "float32")
    model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=0,
              callbacks=[Nudge(), hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    emit(finished=True)


PROCESS_SETS: list = []


def main() -> None:
    PROCESS_SETS.extend([hvd.ProcessSet([0]), hvd.ProcessSet([1])])
    hvd.init(process_sets=PROCESS_SETS)
    if sys.argv[1] == "diverge":
        diverge()
        return
    count = AllreduceCount()
    out = horovod_mnist()
    for flag in (False, True):
        out |= mixed_sparse(flag) | accumulate(flag, count)
    out |= optimizer_options(count)
    emit(backend=keras.config.backend(), **out)


if __name__ == "__main__":
    main()
