"""The alpha-beta cost model of three allreduce schemes, and its fit to measured times.

One message of ``S`` bytes between two ranks costs ``alpha + beta * S``: ``alpha`` is the
latency (seconds per message), ``beta`` the inverse bandwidth (seconds per byte). An allreduce
of ``S`` bytes over ``N`` ranks then costs ``alpha`` per message step on its critical path plus
``beta`` per byte that the busiest rank's link carries along that path:

- ``parameter_server``: the server receives every worker's gradient, then sends the average
  back to each, one message at a time: ``2(N-1)`` steps, and its link carries ``2(N-1) S``.
  Independent of ``N`` per worker, linear in ``N`` at the server: the bottleneck.
- ``ring``: reduce-scatter then allgather, each ``N-1`` steps in which every rank sends
  ``S/N`` bytes to its right neighbour while receiving ``S/N`` from its left one: ``2(N-1)``
  steps, ``2(N-1)/N S`` per link, which tends to ``2S`` however large ``N`` grows.
- ``gather_bcast`` (the d2l way: sum on one rank, broadcast back): a linear gather to the
  root (``N-1`` messages of ``S`` into it), then a binomial-tree broadcast
  (``ceil(log2 N)`` rounds of ``S``), the algorithms MPI libraries typically pick for these.

ZeRO stage 1 (``hvdkit.torch.zero``) replaces the allreduce by a ``reduce_scatter`` of the
gradients and an ``allgather`` of the updated parameters (each rank broadcasts its slice in
place, which moves what an allgather moves): each ``N-1`` steps of ``S/N`` bytes, together
exactly the ring's steps and bytes (:func:`sharded_step`). What it changes is memory
(:func:`bytes_per_param`, :func:`rank_memory`, :func:`largest_model`).

The reduction arithmetic (the "gamma" term) is left out: the model counts messages and bytes.
Pure Python on numbers, so it is tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SCHEMES: tuple[str, ...] = ("gather_bcast", "parameter_server", "ring")
HALVES: tuple[str, ...] = ("reduce_scatter", "allgather")
"""The ring's two halves, each a collective of its own (ZeRO's)."""


@dataclass(frozen=True)
class Cost:
    """What one allreduce of ``S`` bytes over ``N`` ranks puts on its critical path."""

    steps: int
    """Sequential message steps (each pays ``alpha``)."""
    link_bytes: float
    """Bytes through the busiest rank's link, in and out, as the model serialises them."""
    sent_bytes: float
    """Bytes the busiest rank sends."""


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted latency ``alpha`` (s per message) and inverse bandwidth ``beta`` (s per byte)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """``1 / beta`` in bytes/s."""
        return 1.0 / self.beta

    def time(self, cost: Cost) -> float:
        """Predicted seconds for a scheme's :class:`Cost`."""
        return cost.steps * self.alpha + cost.link_bytes * self.beta


def tree_rounds(ranks: int) -> int:
    """Rounds of a binomial-tree broadcast over ``ranks`` ranks: ``ceil(log2 ranks)``."""
    return math.ceil(math.log2(ranks)) if ranks > 1 else 0


def cost(scheme: str, ranks: int, nbytes: float) -> Cost:
    """Steps and bytes of ``scheme`` (one of :data:`SCHEMES`) for ``nbytes`` over ``ranks``."""
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"bad arguments: ranks={ranks}, nbytes={nbytes}")
    n = ranks
    if scheme == "parameter_server":
        return Cost(2 * (n - 1), 2 * (n - 1) * nbytes, (n - 1) * nbytes)
    if scheme == "ring":
        per_link = 2 * (n - 1) / n * nbytes
        # Sends and receives of a Sendrecv step overlap, so the link carries one direction.
        return Cost(2 * (n - 1), per_link, per_link)
    if scheme in HALVES:  # N-1 steps, S/N bytes each, sent while the next chunk arrives
        per_link = (n - 1) / n * nbytes
        return Cost(n - 1, per_link, per_link)
    if scheme == "gather_bcast":
        rounds = tree_rounds(n)
        return Cost(n - 1 + rounds, (n - 1 + rounds) * nbytes, rounds * nbytes)
    raise ValueError(f"unknown scheme {scheme!r}: use one of {', '.join(SCHEMES + HALVES)}")


def predict(model: AlphaBeta, scheme: str, ranks: int, nbytes: float) -> float:
    """Seconds the model predicts for one allreduce of ``nbytes`` over ``ranks`` ranks."""
    return model.time(cost(scheme, ranks, nbytes))


def fit(steps: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares ``seconds ~ alpha * steps + beta * nbytes`` in relative error.

    Each point weighs ``1 / seconds**2``, so a 4 KiB message counts as much as a 16 MiB one
    (plain least squares would let the largest sizes fix both numbers and leave ``alpha`` to
    noise). A negative ``alpha`` (latency below the noise) is set to 0 and ``beta`` refitted.
    """
    if not (len(steps) == len(nbytes) == len(seconds)) or len(seconds) < 2:
        raise ValueError("need at least two (steps, bytes, seconds) points of equal length")
    if min(seconds) <= 0:
        raise ValueError("times must be positive")
    w = [1.0 / t**2 for t in seconds]
    smm = sum(wi * m * m for wi, m in zip(w, steps, strict=True))
    smb = sum(wi * m * b for wi, m, b in zip(w, steps, nbytes, strict=True))
    sbb = sum(wi * b * b for wi, b in zip(w, nbytes, strict=True))
    smt = sum(wi * m * t for wi, m, t in zip(w, steps, seconds, strict=True))
    sbt = sum(wi * b * t for wi, b, t in zip(w, nbytes, seconds, strict=True))
    det = smm * sbb - smb * smb
    if det > 0:
        alpha, beta = (smt * sbb - sbt * smb) / det, (sbt * smm - smt * smb) / det
        if alpha >= 0 and beta > 0:
            return AlphaBeta(alpha, beta)
    if sbb <= 0:
        raise ValueError("cannot fit beta: every message is empty")
    beta = sbt / sbb
    if beta <= 0:
        raise ValueError("times do not grow with message size: no bandwidth to fit")
    return AlphaBeta(0.0, beta)


def sharded_step(model: AlphaBeta, ranks: int, grad_bytes: float, param_bytes: float) -> float:
    """Seconds of ZeRO-1's communication per step: a reduce-scatter of ``grad_bytes`` (the
    gradients as they travel) and an all-gather of ``param_bytes`` (the parameters)."""
    return predict(model, "reduce_scatter", ranks, grad_bytes) + predict(
        model, "allgather", ranks, param_bytes
    )


# Bytes per parameter on one rank: (weights, gradients, optimizer state) for Adam. "fp32": all
# in float32, Adam's two moments. "bf16": mixed precision, bf16 weights and gradients, and a
# float32 master copy with the two moments (12 bytes) as the optimizer's state.
PRECISIONS: dict[str, tuple[float, float, float]] = {
    "fp32": (4.0, 4.0, 8.0),
    "bf16": (2.0, 2.0, 12.0),
}

FUSION_THRESHOLD = 128 * 2**20
"""Horovod 0.28.1's default fusion buffer (``HOROVOD_FUSION_THRESHOLD``): a plain optimizer's
allreduce copies the gradients into it, so up to that many bytes of it are touched."""


def bytes_per_param(
    precision: str, ranks: int = 1, sharded: bool = False, gradients: bool = False
) -> float:
    """Bytes one parameter costs each rank with Adam, as hvdkit lays them out: weights and
    gradients whole; ZeRO-1 (:mod:`hvdkit.torch.zero`) divides the optimizer state by
    ``ranks`` (the reduced gradient of the rank's slice is written over its own, no extra);
    ZeRO-2 (``gradients``) the gradients too. Activations and fixed-size buffers are not per
    parameter (:func:`rank_memory`)."""
    weights, grads, state = PRECISIONS[precision]
    if sharded and gradients:
        return weights + (grads + state) / ranks
    return weights + grads + (state / ranks if sharded else state)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at its peak, in bytes, by part: the model the bench's memory
    section prints beside the measured peak."""

    weights: float
    grads: float
    state: float
    buffers: float
    """Communication buffers: Horovod's fusion buffer, kept once touched (plain); ZeRO's
    received pieces in flight during the backward pass (sharded)."""
    resident: float
    """Activations and what the framework keeps between steps: measured at one rank (where
    nothing is communicated), the same at any world size."""
    transient: float
    """The optimizer's temporaries during its step, measured at one rank."""
    sharded: bool = False

    @property
    def total(self) -> float:
        # ZeRO's pieces in flight are summed and freed before the optimizer steps, so its
        # buffers and the step's temporaries are never held together; Horovod's fusion
        # buffer stays.
        passing = max(self.buffers, self.transient) if self.sharded else (
            self.buffers + self.transient)  # fmt: skip
        return self.weights + self.grads + self.state + self.resident + passing


def rank_memory(
    params: int,
    precision: str,
    ranks: int,
    sharded: bool,
    *,
    zero_buffers: float,
    resident: float = 0.0,
    transient: float = 0.0,
    fusion_threshold: float = FUSION_THRESHOLD,
    gradients: bool = False,
    largest_param: float = 0.0,
) -> RankMemory:
    """The bytes of :class:`RankMemory` for a model of ``params`` parameters with Adam.
    ``zero_buffers``: ZeRO's bound on what its reduce-scatters receive in flight
    (:func:`hvdkit.torch.zero.in_flight_bytes`), beside which autograd makes the gradient of
    the ``largest_param`` (bytes) before adding it into the parameter's (zeroed, kept) one. A
    plain run's fusion buffer is counted as Horovod can touch it, up to the gradients' size or
    ``fusion_threshold`` (it touches what its largest fused response held: less in a short
    run). None of these exists at one rank.

    ``gradients`` (ZeRO stage 2, sharded): the gradients are the reduced slice's, 1/N; the
    buffers add the buckets' own inputs in flight, bounded at 1/N of the outputs. These are
    bounds the implementation keeps whatever the timing, so the model holds for the rank that
    peaks highest (each receives its slice at a different point of the backward pass)."""
    weights, grads, state = (b * params for b in PRECISIONS[precision])
    many = ranks > 1
    if sharded and gradients and many:
        buffers = zero_buffers * (1 + 1 / ranks) + largest_param
        return RankMemory(weights, grads / ranks, state / ranks, buffers, resident, transient,
                          True)  # fmt: skip
    if sharded:
        buffers = min(zero_buffers, grads) + largest_param if many else 0.0
        return RankMemory(weights, grads, state / ranks, buffers, resident, transient, True)
    buffers = min(fusion_threshold, grads) if many else 0.0
    return RankMemory(weights, grads, state, buffers, resident, transient)


def largest_model(
    memory_bytes: float,
    precision: str,
    ranks: int,
    sharded: bool,
    fixed_bytes: float = 0.0,
    gradients: bool = False,
) -> float:
    """Parameters that fit in ``memory_bytes`` per rank (weights, gradients, Adam's state)
    once ``fixed_bytes`` (buffers, activations) are set aside."""
    per = bytes_per_param(precision, ranks, sharded, gradients)
    return max(0.0, memory_bytes - fixed_bytes) / per
