"""Where training is: one small object a session owns, and the pure arithmetic of going on
from it at any world size.

A :class:`Position` counts the epoch, the samples of that epoch done by all ranks together,
the optimizer steps and the backward passes since the last step (gradient accumulation). It is
written into every checkpoint (end of epoch, mid-epoch, preemption), committed by elastic
sessions, and read by the session's sampler through ``session.position``: nobody keeps a
second count (Lightning's loop progress, ``loops/progress.py``, is the model).

Counting *global samples* rather than per-rank batches is what makes a resume at another
number of ranks right: the epoch's order does not depend on the world size (it is
``DistributedSampler``'s permutation of the whole dataset), and with ``B`` samples a rank a
step, step ``k`` of ``R`` ranks trains the contiguous slice ``order[k*B*R:(k+1)*B*R]`` of it. So
the samples not yet trained are always ``order[samples:]``, whatever ``R`` was and is now
(:func:`remaining`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Position:
    """Where training is. ``epoch``: the epoch in progress (the next one between epochs);
    ``samples``: samples of ``epoch`` done by all ranks together; ``step``: optimizer steps
    taken; ``micro_step``: backward passes since the last optimizer step (accumulation)."""

    epoch: int = 0
    samples: int = 0
    step: int = 0
    micro_step: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in fields(self):
            setattr(self, field.name, int(state.get(field.name, 0)))

    def end_epoch(self) -> None:
        """The epoch is done: the next one starts at its first sample."""
        self.epoch, self.samples = self.epoch + 1, 0


def epoch_order(length: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """An epoch's order of the whole dataset: ``DistributedSampler``'s permutation (seeded
    with ``seed + epoch``), or ``range(length)``; the same on every rank at every world size."""
    if not shuffle:
        return list(range(length))
    import torch

    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def shard_length(length: int, size: int, drop_last: bool) -> int:
    """How many samples each of ``size`` ranks gets of a whole epoch of ``length``
    (:func:`remaining` with nothing done)."""
    return length // size if drop_last else -(-length // size)


def remaining(order: list[int], done: int, size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank`` of ``size``'s share of ``order`` after the first ``done`` samples.

    Every rank gets the same count (no rank waits forever in an allreduce): the rest is cut to
    a multiple of ``size`` with ``drop_last``, else padded by repeating the epoch's first
    samples, as ``DistributedSampler`` pads. With ``done=0`` the split is
    ``DistributedSampler``'s, and a resume at the same size pads as the run it resumes did."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size}: not a valid rank")
    rest = order[max(0, done) :]
    if drop_last:
        rest = rest[: len(rest) - len(rest) % size]
    elif rest and len(rest) % size:
        rest += (order * size)[: size - len(rest) % size]
    return rest[rank::size]
