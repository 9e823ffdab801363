"""The arithmetic of each rank's share of an input, and what every input kind of
:meth:`hvdkit.keras.Session.fit` raises and compares across the ranks (pure: no framework).

Rank ``r``'s ``k``-th element is the input's ``k * size + r``; a finite input of ``n``
elements that does not divide by the ranks gives every rank ``ceil(n / size)``, the short
shares padded (:func:`shard_rows` with the rank's own first rows, the others wrapping around to
the input's first elements), so step ``k`` trains what one process would on the ``size``
ranks' batches together and no rank waits in an allreduce the others never join.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

Gather = Callable[[Any], list[Any]]
"""Every rank's value in rank order (a collective every rank calls at the same point)."""


class InputError(ValueError):
    """An input ``fit`` cannot shard so that every rank takes the same steps; says the fix."""


def steps(batches: int, size: int) -> int:
    """Batches per rank for an input of ``batches`` batches over ``size`` ranks."""
    return math.ceil(batches / size)


def source_batch(index: int, rank: int, size: int, batches: int | None) -> int:
    """The input's batch that is rank ``rank``'s ``index``-th (wrapping around when finite)."""
    at = rank + index * size
    return at if batches is None else at % batches


def shard_rows(n: int, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s rows of ``n``: ``rank, rank + size, ...``, the short shares repeating
    their own first rows up to ``ceil(n / size)`` (:func:`hvdkit.keras.shard`'s ``pad``)."""
    rows = np.arange(rank, n, size)
    if n and not len(rows):
        rows = np.array([rank % n])
    return np.resize(rows, steps(n, size)) if len(rows) < steps(n, size) else rows


def rank_indices(indices: list[Any], rank: int, size: int) -> list[Any]:
    """Positions ``rank, rank + size, ...`` of one epoch's ``indices``, padded by wrapping
    around to the first ones so that every rank gets ``ceil(len / size)``."""
    total = steps(len(indices), size) * size
    padded = [indices[i % len(indices)] for i in range(total)] if indices else []
    return padded[rank::size]


def balanced(items: Iterable[Any], rank: int, size: int) -> Iterator[Any]:
    """Items ``rank, rank + size, ...`` of ``items``. When its length ``n`` turns out not to
    divide by ``size``, the ranks that have no item in the last round take one of the first
    items instead (rank ``r``: item ``(r - n % size) mod n``, as :func:`source_batch` wraps),
    so every rank yields ``ceil(n / size)`` and all run out at the same step."""
    head: list[Any] = []
    count = 0
    for item in items:
        if len(head) < size:
            head.append(item)
        if count % size == rank:
            yield item
        count += 1
    short = count % size
    if short and rank >= short:
        yield head[(rank - short) % count]


def validation_at(n: int, fraction: float) -> int:
    """Where ``fit(validation_split=fraction)`` cuts ``n`` samples, as Keras does for one
    process: rows before it train, the last ``fraction`` of them (as given, before any
    shuffle) validate."""
    at = math.floor(n * (1.0 - fraction))
    if not 0 < at < n:
        raise InputError(
            f"fit(validation_split={fraction}): {n} samples leave {max(at, 0)} to train and "
            f"{n - min(max(at, 0), n)} to validate. Fix: a validation_split between 0 and 1 "
            "that leaves a sample on each side, or more data"
        )
    return at


def validation_rows(n: int, rank: int, size: int, everyone: bool = False) -> np.ndarray:
    """Rank ``rank``'s rows of ``n`` validation samples: ``rank, rank + size, ...``, not padded
    (a row counted twice would change the averaged metrics; the ranks need not take equal
    validation steps, as no gradient is reduced). Every row where ``everyone`` (each rank must
    feed batches of one shape) or where a rank would get none: each rank's means are then
    those of the ``n`` rows, and so is their average."""
    return np.arange(n) if everyone or n < size else np.arange(rank, n, size)


def agree(
    gather: Gather | None, digest: str, refusal: str | None, what: str, part: str, extra: Any = None
) -> list[Any]:
    """Every rank's ``extra``, after raising on every rank when any rank refuses or when the
    ranks' digests of what they must draw alike (``part`` of ``fit(what)``) differ."""
    views = [(digest, refusal, extra)] if gather is None else gather((digest, refusal, extra))
    refusals = [view[1] for view in views if view[1]]
    if refusals:
        raise InputError(refusals[0])
    odd = [rank for rank, view in enumerate(views) if view[0] != views[0][0]]
    if odd:
        raise InputError(
            f"fit({what}): {part} differs between the ranks (rank 0 and rank{'s' * (len(odd) > 1)}"
            f" {', '.join(map(str, odd))} hold other data, or other random seeds), so their "
            "shares would overlap. Fix: build the same input on every rank: give each random "
            "step a seed (keras.utils.*_dataset_from_directory(seed=S), a random split with "
            "np.random.default_rng(S), torch.Generator().manual_seed(S))"
        )
    return [view[2] for view in views]
