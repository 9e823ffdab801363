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


def test_the_torch_guard_needs_little_host_memory_beside_the_weights():
    """The fingerprint is taken a chunk at a time where each tensor lives: peak host memory
    grows by under 10% of the weights' bytes (it was 4x: a float64 copy of every tensor and a
    weight vector per tensor). Measured in a fresh process, as the growth of its peak RSS."""
    import subprocess
    import sys

    code = """
import resource, torch
from hvdkit.torch.session import _fingerprint
model = torch.nn.Sequential(torch.nn.Linear(4000, 4000), torch.nn.Linear(4000, 2000))
weights = sum(p.numel() for p in model.parameters()) * 4
_fingerprint(torch.ones(10))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.stack([_fingerprint(p.detach()) for p in model.parameters()])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / weights)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.10, out.stdout
