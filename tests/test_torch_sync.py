"""The sync guard in hvdkit.torch's session, with real processes (a diverging job stops). Lazy
modules are refused inside the ranks of one job: tests/ranked/test_torch_session.py."""

from __future__ import annotations

import pytest
from conftest import horovodrun, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_ranks_that_drift_apart_stop_the_session(monkeypatch):
    out = horovodrun("torch_sync_worker.py", "diverge", check=False)
    assert out.returncode != 0
    r = results(out)
    assert r[0]["epoch"] == 0 and r[1]["epoch"] == 0  # in sync after the first step
    text = out.stdout + out.stderr
    assert "ranks are out of sync at the end of epoch 1: variable '2.weight'" in text
    monkeypatch.setenv("HVDKIT_SYNC_CHECK", "0")
    out = horovodrun("torch_sync_worker.py", "diverge")
    assert sorted(r["epoch"] for r in results(out).values()) == [1, 1]
