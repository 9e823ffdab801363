"""Horovod's Keras collectives, process sets, queries and timeline through hvdkit.keras on
both Keras backends, with real processes."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "keras_backend, controller", [("tensorflow", "gloo"), ("torch", "gloo"), ("tensorflow", "mpi")]
)
def test_collectives_on_every_backend(keras_backend, controller, tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", keras_backend)
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's switch for start_timeline
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # add/remove_process_set
    timeline = tmp_path / "timeline.json"
    r = results(horovodrun("keras_collectives_worker.py", str(timeline), controller=controller))
    assert sorted(r) == [0, 1] and r[0]["backend"] == keras_backend
    for rank in (0, 1):
        failed = [name for name, ok in r[rank]["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    text = (tmp_path / "timeline.json.0").read_text()
    assert text.startswith("[") and '"shape": "[4]"' in text  # the timed allreduce of 4 values
