"""Inside the ranks of one job (tests/in_ranks.py): Horovod is started once, for every test,
through hvdkit.torch, or hvdkit.keras where the job runs a Keras file
(``HVDKIT_IN_RANKS_API=keras``, ``KERAS_BACKEND`` set)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def horovod():
    import ranks_plugin

    if os.environ.get("HVDKIT_IN_RANKS_API") == "keras":
        import hvdkit.keras as hvd
    else:
        import hvdkit.torch as hvd
    hvd.init()
    ranks_plugin.allgather = lambda value: gathered(hvd, value)
    return hvd


def gathered(hvd, value) -> list:
    """Every rank's ``value``, in rank order, on every rank (any picklable value; Keras's API
    has no ``allgather_object``, so it goes through ``allgather`` as bytes)."""
    if hasattr(hvd, "allgather_object"):
        return hvd.allgather_object(value)
    import keras

    def gather(array: np.ndarray) -> np.ndarray:
        return np.asarray(keras.ops.convert_to_numpy(hvd.allgather(array)))

    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = gather(np.array([len(data)], np.int64))
    padded = np.zeros((1, int(sizes.max())), np.uint8)
    padded[0, : len(data)] = data
    rows = gather(padded)
    return [pickle.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


def same_on_every_rank(hvd, value) -> bool:
    """Whether every rank holds ``value`` (compared on every rank, so all of them answer)."""
    values = gathered(hvd, value)
    return all(v == values[0] for v in values)
