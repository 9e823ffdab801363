"""The sync guard's pure part: fingerprints and which variable/rank differs first."""

from __future__ import annotations

import numpy as np
import pytest

from hvdkit import sync


def test_identical_replicas_pass_and_permuted_values_do_not():
    a = [np.arange(6.0).reshape(2, 3), np.ones(4)]
    same = np.stack([sync.fingerprint(a), sync.fingerprint([x.copy() for x in a])])
    assert sync.first_divergence(same) is None
    permuted = [a[0][::-1].copy(), a[1]]  # same sum, other order
    gathered = np.stack([sync.fingerprint(a), sync.fingerprint(permuted)])
    assert sync.first_divergence(gathered) == (0, 1)


def test_last_bit_rounding_is_tolerated_and_a_real_drift_is_named():
    w = np.random.default_rng(0).normal(size=1000)
    fps = [sync.fingerprint([w, w]), sync.fingerprint([w * (1 + 1e-12), w]),
           sync.fingerprint([w, w + 1e-3])]  # fmt: skip
    gathered = np.stack(fps)
    assert sync.first_divergence(gathered) == (1, 2)
    with pytest.raises(sync.DivergenceError, match=r"variable 'b' .* on rank 2\. Likely causes"):
        sync.check(["a", "b"], gathered, "after the second batch")


def test_the_guard_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(sync.ENV, raising=False)
    assert sync.enabled()
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(sync.ENV, off)
        assert not sync.enabled()
