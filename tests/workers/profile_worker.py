"""Run by tests/test_profile.py under `hvdkit run --profile`: a script written for Horovod (the
drop-in module, its own DataLoader and DistributedSampler, no session), or Keras's fit through
the session, each with a data set that reads slowly."""

from __future__ import annotations

import sys
import time

KIND = sys.argv[1]


def report(rank: int, weights) -> None:
    """Each rank's weights, as a digest: the ranks must end identical, profiled or not."""
    import hashlib
    import json

    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
    print("RESULT " + json.dumps({"rank": rank, "digest": digest}), flush=True)


LATENCY = 0.012  # per sample: 192 ms per batch of 16, so the data phase leads the others by 5x
# or more with both cores busy (make profile-under-load: at 6 ms the Horovod script's lead was
# 2.6-5.5x); a sleep, so a loaded CPU does not stretch it
SCRIPT_LATENCY, SCRIPT_SAMPLES = 0.024, 256  # the Horovod script's: its lead was 4.7x at 12 ms
# under load (the other rank's jitter lands in communication), so half the batches, each twice
# as slow, for the same time


def horovod_script() -> None:
    import torch
    import torch.nn.functional as F  # noqa: N812 - torch's own name
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    import hvdkit.torch as hvd

    class Slow(Dataset):
        def __len__(self):
            return SCRIPT_SAMPLES

        def __getitem__(self, i):
            time.sleep(SCRIPT_LATENCY)
            return torch.full((8,), float(i % 7)), torch.tensor(i % 3)

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = DistributedSampler(Slow(), num_replicas=hvd.size(), rank=hvd.rank())
    held_out = torch.utils.data.Subset(Slow(), range(64))
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(Slow(), batch_size=16, sampler=sampler):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if epoch == 0:  # a validation loop between the epochs: apart from the steps
            with torch.no_grad():
                for x, y in DataLoader(held_out, batch_size=16):
                    F.cross_entropy(model(x), y)
    report(hvd.rank(), [p.detach().numpy() for p in model.parameters()])


def keras_fit() -> None:
    import keras
    import numpy as np

    import hvdkit.keras as hvd

    class Slow(keras.utils.PyDataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            time.sleep(16 * LATENCY)
            rng = np.random.default_rng(i)
            return rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 1))

    hvd.init()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    session = hvd.setup(model, keras.optimizers.SGD(0.01))
    model.compile(optimizer=session.optimizer, loss="mse", jit_compile=False)
    class Held(Slow):
        def __len__(self):
            return 4

    if "generator" in sys.argv[2:]:  # a Python generator: each rank takes its share

        def batches():
            data = Slow()
            for i in range(len(data)):
                yield data[i]

        session.fit(batches(), epochs=1, steps_per_epoch=24 // hvd.size(), verbose=0)
    else:  # validation and the epoch's end between the two epochs: apart from the steps
        session.fit(Slow(), epochs=2, verbose=0, validation_data=Held())
    report(hvd.rank(), [keras.ops.convert_to_numpy(v) for v in model.weights])


def tf_tape() -> None:
    """Horovod's TensorFlow 2 example's shape: a tf.function step over a DistributedGradientTape
    and a plain Keras optimizer, a tf.data input; eager when ``eager`` is given."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hvdkit.tensorflow as hvd

    hvd.init()
    tf.config.run_functions_eagerly("eager" in sys.argv[2:])

    def slow():
        for i in range(24):
            time.sleep(16 * LATENCY)
            rng = np.random.default_rng(100 * hvd.rank() + i)
            yield rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 1))

    spec = (tf.TensorSpec((16, 8), tf.float32), tf.TensorSpec((16, 1), tf.float64))
    data = tf.data.Dataset.from_generator(slow, output_signature=spec)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01 * hvd.size())

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - tf.cast(y, tf.float32)))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    for batch, (x, y) in enumerate(data):
        training_step(x, y, batch == 0)
    report(hvd.rank(), [keras.ops.convert_to_numpy(v) for v in model.weights])


{"horovod-script": horovod_script, "keras-fit": keras_fit, "tf-tape": tf_tape}[KIND]()
