"""horovod.torch's API beyond the basics, through hvdkit.torch, with real processes."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_collectives_process_sets_timeline_join_and_sync_batch_norm(
    tmp_path, controller, monkeypatch
):
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's switch for start_timeline
    timeline = tmp_path / "timeline.json"
    r = results(horovodrun("torch_collectives_worker.py", str(timeline), controller=controller))
    assert sorted(r) == [0, 1]
    for rank in (0, 1):
        failed = [name for name, ok in r[rank]["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    text = timeline.read_text()
    assert r[0]["timeline"] and "timed" in text
    assert text.lstrip().startswith("[")  # Chrome trace format: a JSON list of events
