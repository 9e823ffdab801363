"""Functions the engine tests (tests/test_ray.py, tests/test_spark.py) run on every rank
through hvdkit.ray and hvdkit.spark. The engines pickle them by value
(``register_pickle_by_value``), so the workers need not import this file."""

from __future__ import annotations

import hashlib
import os
import time


class Counter:
    """An ``executable_cls`` for RayExecutor: state that lives in each rank's actor."""

    def __init__(self, start: int) -> None:
        self.value = start

    def bump(self) -> int:
        self.value += 1
        return self.value


def _data(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])


def torch_one_step() -> dict:
    """One step on each rank's shard with the LR scaled by size, against one process on the
    global batch: the same weights."""
    import torch
    import torch.nn.functional as F

    import hvdkit.torch as hvd

    hvd.init()
    b, lr = 4, 0.1
    x, y = _data(b * hvd.size(), seed=7)
    model = _model(0)
    session = hvd.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    mine = slice(hvd.rank() * b, (hvd.rank() + 1) * b)
    session.optimizer.zero_grad()
    session.backward_and_step(F.cross_entropy(session.model(x[mine]), y[mine]))
    ref = _model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr * hvd.size())
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "cross_size": hvd.cross_size(),
        "diff": (_flat(session.model) - _flat(ref)).abs().max().item(),
        "moved": (_flat(session.model) - _flat(_model(0))).abs().max().item(),
    }


def torch_train(epochs: int = 2, checkpoint: str | None = None) -> dict:
    """A few epochs from per-rank different weights (setup must broadcast rank 0's): the
    weights' digest."""
    import torch
    import torch.nn.functional as F

    import hvdkit.torch as hvd

    hvd.init()
    model = _model(hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session = hvd.setup(model, opt, checkpoint=checkpoint)
    x, y = _data(256, seed=123)
    loader = session.shard(torch.utils.data.TensorDataset(x, y), batch_size=8)
    for _ in session.epochs(epochs):
        for xb, yb in loader:
            session.optimizer.zero_grad(set_to_none=True)
            session.backward_and_step(F.cross_entropy(session.model(xb), yb))
        if checkpoint:
            session.save()
    digest = hashlib.sha256(_flat(session.model).numpy().tobytes()).hexdigest()
    return {"rank": hvd.rank(), "params": digest, "steps": session.step_count, "pid": os.getpid()}


def keras_fit() -> dict:
    """Keras 3 (the backend from KERAS_BACKEND) fit() on each rank's shard, from per-rank
    different weights: the weights' digest."""
    import keras
    import numpy as np

    import hvdkit.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01 * hvd.size())),
                  loss="mse", jit_compile=False)  # fmt: skip
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    model.fit(x, x[:, :1] * 2, epochs=2, batch_size=16, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    weights = np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in model.weights])
    return {"rank": hvd.rank(), "backend": keras.config.backend(),
            "weights": hashlib.sha256(weights.astype(np.float32).tobytes()).hexdigest()}  # fmt: skip


def keras_one_step() -> dict:
    """Keras 3 (the backend from KERAS_BACKEND): one fit() step on each rank's shard from
    per-rank different weights, against one process from rank 0's start on the global batch."""
    import keras
    import numpy as np

    import hvdkit.keras as hvd

    hvd.init()
    b, lr = 4, 0.1
    rng = np.random.default_rng(7)
    x = rng.normal(size=(b * hvd.size(), 4)).astype("float32")
    y = x[:, :1] * 2 - x[:, 1:2]

    def build(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )

    def flat(model: keras.Model) -> np.ndarray:
        return np.concatenate([np.ravel(w) for w in model.get_weights()])

    model = build(hvd.rank())
    start = [
        keras.ops.convert_to_numpy(hvd.broadcast(w, 0, name=f"start.{i}"))
        for i, w in enumerate(model.get_weights())
    ]  # the start the callback gives all
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    mine = slice(hvd.rank() * b, (hvd.rank() + 1) * b)
    model.fit(x[mine], y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    after = flat(model)
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)  # on JAX, the oracle is this process's alone
    ref = build(0)
    ref.set_weights(start)
    ref.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    ref.fit(x, y, batch_size=b * hvd.size(), epochs=1, shuffle=False, verbose=0)
    keras.distribution.set_distribution(distribution)  # the actor's next call runs as before
    return {"rank": hvd.rank(), "backend": keras.config.backend(),
            "diff": float(np.abs(after - flat(ref)).max()),
            "moved": float(np.abs(after - np.concatenate([np.ravel(w) for w in start])).max()),
            "weights": hashlib.sha256(after.astype(np.float32).tobytes()).hexdigest()}  # fmt: skip


def raise_on(rank: int) -> int:
    """Rank ``rank`` raises before the first collective; the others would wait in it."""
    import torch

    import hvdkit.torch as hvd

    hvd.init()
    if hvd.rank() == rank:
        raise ValueError(f"planted failure on rank {rank}")
    hvd.allreduce(torch.ones(1), name="after_failure")
    return hvd.rank()


def allreduce_forever(marker_dir: str) -> int:
    """Allreduces until stopped, after leaving a file that says this rank got going."""
    import torch

    import hvdkit.torch as hvd

    hvd.init()
    with open(os.path.join(marker_dir, f"rank{hvd.rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        hvd.allreduce(torch.ones(1), name="spin")
        time.sleep(0.01)


def one_batch_fewer(steps: int) -> int:
    """Rank 1 leaves its training loop a batch early and averages its last loss while rank 0
    waits in that step's gradients (the hang doctor's case (a), under an engine)."""
    import torch

    import hvdkit.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())  # fmt: skip
    for _ in range(steps - hvd.rank()):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    hvd.allreduce(torch.zeros(()), name="last_loss")  # the loop's end: average a loss
    return hvd.rank()
