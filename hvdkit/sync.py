"""The sync guard: do all ranks hold the same weights? Pure (numpy); the adapters gather.

Data-parallel bugs are silent: a model whose weights were never broadcast, or a rank that
stepped differently, trains to the end with replicas that have drifted apart. The guard
compares a small fingerprint of every variable across ranks (two numbers each, gathered in
one collective), after the first step and at each epoch end, and stops every rank with an
error naming the first variable that differs and the likely cause.

Turn it off with ``HVDKIT_SYNC_CHECK=0`` (e.g. for variables meant to differ per rank that
hvdkit does not know about).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from hvdkit import envvars

ENV = envvars.SYNC_CHECK
RTOL = 1e-6
"""Relative tolerance: replicas on different CPUs may round differently in the last bits."""


class DivergenceError(RuntimeError):
    """Ranks hold different values for a variable that should be identical everywhere."""


def enabled() -> bool:
    """The guard runs unless ``HVDKIT_SYNC_CHECK`` is ``0``/``false``/``off``/``no``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


CHUNK = 1 << 16
"""Elements summarised at a time: the guard's extra memory is a few chunks, not a copy of the
model (a 7B model's float64 copy would be 56 GB a rank)."""


def fingerprint(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Per array: its sum, a position-weighted sum (so permuted values differ; the weights
    run from 1 to 2 along the flattened array) and the sum of absolute values (the scale for
    the tolerance), float64; shape ``(len(arrays), 3)``. Computed a chunk at a time."""
    out = np.zeros((len(arrays), 3), dtype=np.float64)
    for i, array in enumerate(arrays):
        flat = np.asarray(array).reshape(-1)
        step = 1.0 / (flat.size - 1) if flat.size > 1 else 0.0
        for start in range(0, flat.size, CHUNK):
            chunk = flat[start : start + CHUNK].astype(np.float64)
            weights = 1.0 + np.arange(start, start + chunk.size, dtype=np.float64) * step
            out[i] += chunk.sum(), chunk @ weights, np.abs(chunk).sum()
    return out


def first_divergence(gathered: np.ndarray) -> tuple[int, int] | None:
    """(variable index, rank) of the first variable on which some rank differs from rank 0, or
    None. ``gathered`` holds every rank's :func:`fingerprint`: shape ``(ranks, variables, 3)``.
    Every rank computes the same answer from the same gathered values."""
    tolerance = RTOL * (gathered[0, :, 2] + 1e-12)
    for var in range(gathered.shape[1]):
        for rank in range(1, gathered.shape[0]):
            if np.any(np.abs(gathered[rank, var, :2] - gathered[0, var, :2]) > tolerance[var]):
                return var, rank
    return None


def check(names: Sequence[str], gathered: np.ndarray, where: str) -> None:
    """Raise :class:`DivergenceError` (on every rank alike) if the ranks differ."""
    found = first_divergence(gathered)
    if found is not None:
        raise DivergenceError(divergence_message(names, gathered, where, *found))


def divergence_message(
    names: Sequence[str], gathered: np.ndarray, where: str, var: int, rank: int
) -> str:
    """The error every rank raises when the guard finds ranks apart."""
    return (
        f"hvdkit: ranks are out of sync {where}: variable {names[var]!r} (the first that "
        f"differs of {len(names)}) has sum {gathered[0, var, 0]:.9g} on rank 0 but "
        f"{gathered[rank, var, 0]:.9g} on rank {rank}. Likely causes: the initial weights were "
        "not broadcast from rank 0 (a model built at its first batch, e.g. a Sequential without "
        "an Input, needs BroadcastGlobalVariablesCallback or hvdkit's setup(); a custom loop "
        "must broadcast after its first step), the optimizer was not wrapped in "
        "DistributedOptimizer, or the ranks ran different code or step counts. A variable "
        "meant to differ per rank must be registered as local (register_local_var / "
        f"local_variables=). To turn this check off: {ENV}=0."
    )
