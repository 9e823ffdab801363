"""Epoch metrics averaged over ranks, weighted by each rank's sample count.

Keras 3's loss tracker is a ``Mean`` weighted by batch size, so its ``count`` is the number of
samples this rank saw; every metric in the epoch logs is averaged with those weights, which is
exact when shards differ. The hook sits where ``fit``/``evaluate`` build their epoch logs, so
the averaged values are what *every* callback sees, in whatever order the user lists them.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from hvdkit.keras import backend

HOOKED = "_hvdkit_metric_averaging"


def sample_count(model: keras.Model) -> float:
    """Samples behind the current metric values on this rank (1 if Keras does not say)."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None or not hasattr(tracker, "count"):
        return 1.0
    return float(keras.ops.convert_to_numpy(tracker.count))


def average_logs(logs: dict[str, Any], count: float) -> dict[str, Any]:
    """Collective: the sample-weighted global mean of each numeric entry of ``logs``."""
    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
    local = np.array([float(logs[k]) * count for k in keys] + [count], dtype=np.float64)
    hvd = backend.horovod()
    summed = hvd.allreduce(backend.current().from_host(local), op=hvd.Sum, name="hvdkit.metrics")
    summed = np.asarray(keras.ops.convert_to_numpy(summed), dtype=np.float64)
    out = dict(logs)
    if summed[-1] > 0:
        out.update({k: float(summed[i] / summed[-1]) for i, k in enumerate(keys)})
    return out


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def install_metric_averaging(model: keras.Model) -> None:
    """Make ``model``'s epoch-level logs (train and validation) global averages. Idempotent.
    From then on every rank must run ``fit``/``evaluate`` together."""
    if getattr(model, HOOKED, False):
        return
    inner = model._get_metrics_result_or_logs

    def averaged(logs: Any) -> Any:
        result = inner(logs)
        return (
            average_logs(dict(result), sample_count(model)) if isinstance(result, dict) else result
        )

    model._get_metrics_result_or_logs = averaged
    setattr(model, HOOKED, True)
