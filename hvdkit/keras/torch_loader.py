"""How :meth:`hvdkit.keras.Session.fit` shards a torch ``DataLoader`` or map-style
``Dataset``: the loader keeps its own sampler (``SubsetRandomSampler``,
``WeightedRandomSampler``, shuffled or not), which every rank draws whole with one seed, each
keeping positions ``rank, rank + size, ...`` (:class:`RankSampler`), a new draw each epoch
(:class:`SamplerEpoch`). The ranks compare what their samplers draw before the first step.
torch is imported only when such an input is given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import keras

from hvdkit.keras.shares import Gather, InputError, agree, rank_indices, steps


def shard_loader(
    x: Any, kind: str, rank: int, size: int, kwargs: dict[str, Any], gather: Gather | None
) -> Any:
    """This rank's loader for a torch ``DataLoader`` (its own sampler's indices split) or
    map-style ``Dataset`` (``kind``; batches over a ``DistributedSampler``); its sampler's
    ``set_epoch`` is for :class:`SamplerEpoch` to call."""
    from torch.utils.data import DataLoader, DistributedSampler

    if kind == "torch-dataset":
        shuffle = bool(kwargs.pop("shuffle", True))
        batch_size = kwargs.pop("batch_size", None) or 32
        sampler: Any = DistributedSampler(x, num_replicas=size, rank=rank, shuffle=shuffle)
        return DataLoader(x, batch_size=batch_size, sampler=sampler)
    loader = x
    if loader.batch_size is None:
        raise InputError(
            "fit(DataLoader): the loader has its own batch_sampler, which hvdkit cannot shard. "
            "Fix: give the DataLoader batch_size and a sampler (or shuffle) instead, or shard "
            "the batch sampler yourself and call model.fit"
        )
    if isinstance(loader.sampler, DistributedSampler):
        return _sharded_already(loader, rank, size)
    sampler = RankSampler(loader.sampler, rank, size, _sampler_seed(loader.sampler, gather))
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )


def _sharded_already(loader: Any, rank: int, size: int) -> Any:
    sampler = loader.sampler
    if (sampler.num_replicas, sampler.rank) != (size, rank):
        raise InputError(
            f"fit(DataLoader): its DistributedSampler is rank {sampler.rank} of "
            f"{sampler.num_replicas}, and this is rank {rank} of {size}. Fix: give "
            "session.fit the loader with the sampler it had before (hvdkit shards it), or "
            "DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())"
        )
    return loader  # sharded by its user: taken as it is, its epoch set each epoch


class RankSampler:
    """This rank's share of a torch sampler: every rank draws the sampler's whole epoch with
    the same seed (``seed + epoch`` for the global torch generator, which
    ``SubsetRandomSampler``, ``WeightedRandomSampler`` and ``RandomSampler`` draw from when
    given no ``generator``) and keeps its positions (:func:`rank_indices`). A new draw each
    epoch, as one process gets; a sampler's own ``generator`` goes on from its state, the same
    on every rank."""

    def __init__(self, sampler: Any, rank: int, size: int, seed: int) -> None:
        self.sampler, self.rank, self.size, self.seed = sampler, rank, size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return steps(len(self.sampler), self.size)

    def __iter__(self) -> Iterator[Any]:
        return iter(rank_indices(self.draw(self.epoch), self.rank, self.size))

    def draw(self, epoch: int) -> list[Any]:
        """The sampler's indices for ``epoch`` (what one process would train on)."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed((self.seed + epoch) % 2**63)
            return list(self.sampler)


def _sampler_seed(sampler: Any, gather: Gather | None) -> int:
    """Rank 0's torch seed (the user's ``torch.manual_seed``, or a random one), after the
    ranks agreed that their samplers draw the same indices with one seed."""
    import torch

    if gather is None:
        return torch.initial_seed()
    part = f"its {type(sampler).__name__}'s indices"
    seeds = agree(gather, _probe(sampler), None, "DataLoader", part, torch.initial_seed())
    return int(seeds[0])


def _probe(sampler: Any) -> str:
    """A digest of the indices the sampler draws with a fixed seed, its own generator's
    state put back (so training draws what it would have)."""
    import torch

    generator = getattr(sampler, "generator", None)
    if not isinstance(generator, torch.Generator):
        indices = RankSampler(sampler, 0, 1, 0).draw(0)
    else:
        state = generator.get_state()
        try:
            indices = RankSampler(sampler, 0, 1, 0).draw(0)
        finally:
            generator.set_state(state)
    return hashlib.sha256(repr(indices).encode()).hexdigest()


class SamplerEpoch(keras.callbacks.Callback):
    """A sampler reshuffles by its epoch: set it at each epoch's start."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.sampler.set_epoch(epoch)
