"""Session.fit on every input model.fit takes, with real processes on both Keras backends:
every rank takes the same steps, ends with the same weights, and those are the weights of one
plain Keras process trained on the global batches (tests/workers/keras_inputs_worker.py)."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
KINDS = ["arrays", "tf.data", "pydataset", "pydataset-processes", "torch-loader",
         "torch-dataset", "generator"]  # fmt: skip
STEPS, EPOCHS = 3, 2  # as in the worker


UNEVEN = ["tf.data", "pydataset", "torch-loader", "arrays"]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_fit_shards_every_input_kind_like_one_process_on_the_global_batch(backend, monkeypatch):
    """Each kind in one job (one start-up per backend). An input of one batch more than the
    ranks share (``:uneven``) gives each rank ceil(n / size) batches, the short shard wrapping
    around, so no rank waits in an allreduce the others never join."""
    monkeypatch.setenv("KERAS_BACKEND", backend)
    specs = KINDS + [f"{kind}:uneven" for kind in UNEVEN]
    r = results(horovodrun("keras_inputs_worker.py", *specs, timeout=400))
    for spec in specs:
        ranks = [r[rank]["runs"][spec] for rank in (0, 1)]
        assert ranks[0]["digest"] == ranks[1]["digest"], (spec, ranks)
        if spec.endswith(":uneven"):
            assert [x["batches"] for x in ranks] == [(STEPS + 1) * EPOCHS] * 2, (spec, ranks)
            continue
        for one in ranks:
            assert one["batches"] == STEPS * EPOCHS, (spec, one)
            assert one["moved"] > 1e-3, (spec, one)  # the oracle trained
            assert one["oracle_close"], (spec, one)
