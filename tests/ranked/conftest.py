"""Inside the ranks of one job (tests/in_ranks.py): Horovod is started once, for every test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def horovod():
    import ranks_plugin

    import hvdkit.torch as hvd

    hvd.init()
    ranks_plugin.allgather = hvd.allgather_object
    return hvd


def same_on_every_rank(hvd, value) -> bool:
    """Whether every rank holds ``value`` (compared on every rank, so all of them answer)."""
    values = hvd.allgather_object(value)
    return all(v == values[0] for v in values)
