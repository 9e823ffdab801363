"""hvdkit.keras on KERAS_BACKEND=jax with real processes: a Horovod Keras script whose ranks
start from their own seeds ends with identical weights, equal to one process trained from rank
0's start on the same global batches; Horovod's collectives take and give JAX arrays."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_fit_on_jax_matches_one_process_and_collectives_take_jax_arrays(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    r = results(horovodrun("keras_jax_worker.py"))
    assert r[0]["coordinator"].startswith("127.0.0.1:")  # every rank on this host
    check(r)


def check(r: dict) -> None:
    """keras_jax_worker.py's results: ranks equal, equal to one process, collectives right."""
    assert sorted(r) == [0, 1] and r[0]["backend"] == "jax"
    assert r[0]["devices"] == 2  # one DataParallel over both processes' devices
    for op in ("average", "sum"):
        assert r[0][op]["start"] != r[1][op]["start"]  # each rank its own seed...
        assert r[0][op]["end"] == r[1][op]["end"]  # ...and the broadcast made them one
        assert r[0][op]["loss"] == r[1][op]["loss"]
        oracle = r[0][f"{op}_oracle"]
        gap = max(abs(a - b) for a, b in zip(r[0][op]["end"], oracle["end"], strict=True))
        assert gap < 1e-5, f"{op}: {gap} from one process on the global batches"
        assert r[0][op]["loss"] == pytest.approx(oracle["loss"], rel=1e-5)
        assert r[0][op]["predict_gap"] < 1e-5 and r[1][op]["predict_gap"] < 1e-5
    # op=Sum is the sum of the ranks' averages: the oracle's LR times the ranks.
    assert r[0]["sum"]["end"] != r[0]["average"]["end"]
    c0, c1 = r[0]["collectives"], r[1]["collectives"]
    assert c0["is_jax"] and c1["is_jax"]
    assert c0["average"] == c1["average"] == [0.5, 1.5, 2.5]
    assert c0["sum"] == [1.0, 3.0, 5.0] and c0["max"] == [1.0, 2.0, 3.0]
    assert c0["gathered"] == c1["gathered"] == [[0, 0], [1, 1], [1, 1]]  # first dims differ
    assert c0["alltoall"] == [[0.0, 10.0], [1, 1]]
    assert c1["alltoall"] == [[1.0, 2.0, 3.0, 11.0, 12.0, 13.0], [3, 3]]
    assert c0["broadcast"] == c1["broadcast"] == [[8], "uint32"]  # a dtype Horovod lacks
    for rank in (0, 1):
        assert "op=Adasum is not available on KERAS_BACKEND=jax" in r[rank]["refused"]
        # Unequal shards would give each rank another program: refused on every rank.
        assert "rank 0: rows 5 batch size 16; rank 1: rows 4 batch size 16" in r[rank]["uneven"]
