"""Inside the ranks of one job (tests/in_ranks.py): Horovod is started once, for every test,
through hvdkit.torch, or hvdkit.keras where the job runs a Keras file
(``HVDKIT_IN_RANKS_API=keras``, ``KERAS_BACKEND`` set)."""

from __future__ import annotations

import os

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
    has no ``allgather_object``, so it goes through the Horovod module under it)."""
    if hasattr(hvd, "allgather_object"):
        return hvd.allgather_object(value)
    from hvdkit.keras import backend

    return backend.horovod().allgather_object(value)


def same_on_every_rank(hvd, value) -> bool:
    """Whether every rank holds ``value`` (compared on every rank, so all of them answer)."""
    values = gathered(hvd, value)
    return all(v == values[0] for v in values)
