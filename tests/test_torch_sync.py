"""The sync guard in hvdkit.torch's session, and lazy modules, with real processes."""

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


def test_lazy_modules_get_a_clear_error_on_every_rank():
    r = results(horovodrun("torch_sync_worker.py", "lazy"))
    for rank in (0, 1):
        assert "uninitialized parameters of a lazy module" in r[rank]["error"]
        assert "run one forward pass" in r[rank]["error"]
