"""Every Keras collective of hvdkit.keras x dtype x op x shape on each Keras backend, against
numpy (issue 49): one 2-rank job per backend runs the whole seeded grid
(tests/workers/keras_collectives_grid_worker.py, which says what each case expects; the grid
itself is tests/collectives_grid.py)."""

from __future__ import annotations

import collectives_grid as grid
import pytest
from conftest import horovodrun, results
from workers import keras_collectives_grid_worker as worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_the_grid_has_every_collective_dtype_op_and_shape():
    ops = sum(len(ops) for ops in grid.COLLECTIVES.values())
    assert ops == 5 + 2 + 3  # allreduce's five ops, reducescatter's two, three moves
    assert len(worker.cases()) == ops * len(grid.DTYPES) * len(grid.SHAPES) == 600
    assert len({case.name for case in worker.cases()}) == 600


def test_a_case_draws_the_same_inputs_on_every_rank_and_64_bit_values():
    case = grid.Case("allreduce", "int64", "Sum", "small")
    one, again = grid.plan(grid.SEED, case), grid.plan(grid.SEED, case)
    assert all((a == b).all() for a, b in zip(one.inputs, again.inputs, strict=True))
    assert not (one.inputs[0] == one.inputs[1]).all()  # each rank its own values...
    assert abs(one.inputs[0]).max() > 2**31  # ...that an int32 cannot hold


@pytest.mark.parametrize("keras_backend", ["tensorflow", "torch", "jax"])
def test_every_collective_dtype_op_and_shape_matches_numpy(keras_backend, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", keras_backend)
    r = results(horovodrun("keras_collectives_grid_worker.py", "--seed", str(grid.SEED),
                           timeout=180))  # fmt: skip
    assert sorted(r) == [0, 1] and r[0]["backend"] == keras_backend
    for rank in (0, 1):
        assert r[rank]["cases"] == len(worker.cases())
        failures = r[rank]["failures"]
        shown = "\n".join(f"{f['case']}: {f['why']}\n  rerun: {f['repro']}" for f in failures)
        assert not failures, f"rank {rank}: {len(failures)} of {r[rank]['cases']} failed:\n{shown}"
