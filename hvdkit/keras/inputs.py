"""What :meth:`hvdkit.keras.Session.fit` takes, as ``model.fit`` does, each sharded per rank
with the same number of steps on every rank (each step is an allreduce all ranks join: a rank
with one batch fewer would leave the others waiting forever).

==========================  ================================================================
input                        this rank's share
==========================  ================================================================
arrays (NumPy, lists)        rows ``rank, rank + size, ...`` (:func:`hvdkit.keras.shard`)
``tf.data.Dataset``          elements (batches) ``rank, rank + size, ...``
``keras.utils.PyDataset``    batches ``rank, rank + size, ...``, loaded with ``workers``,
                             ``use_multiprocessing`` and ``max_queue_size``
torch ``DataLoader``         the same loader over a ``DistributedSampler`` (its shuffling kept,
                             the same permutation on every rank, reshuffled each epoch)
torch ``Dataset``            batches of ``batch_size`` over a ``DistributedSampler``
generator, iterator          items ``rank, rank + size, ...``; ``steps_per_epoch`` required
==========================  ================================================================

A finite input whose batch count ``n`` does not divide by the ranks gives every rank
``ceil(n / size)`` batches, the short shards wrapping around to the first ones (as the arrays'
``pad``). Rank ``r``'s ``k``-th batch being the input's batch ``k * size + r``, step ``k`` of
``size`` ranks trains what one process would on the input's batches ``k * size`` to
``k * size + size - 1`` together. The index arithmetic is pure (:func:`steps`,
:func:`source_batch`); the wrappers only apply it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras

LOADING = ("workers", "use_multiprocessing", "max_queue_size")
"""``fit`` arguments of Keras 2 (the seed's ``fit_generator(workers=8, ...)``): Keras 3 moved
them to ``PyDataset``; the session takes them and gives them to the sharded ``PyDataset``."""


class InputError(ValueError):
    """An input ``fit`` cannot shard so that every rank takes the same steps; says the fix."""


def steps(batches: int, size: int) -> int:
    """Batches per rank for an input of ``batches`` batches over ``size`` ranks."""
    return math.ceil(batches / size)


def source_batch(index: int, rank: int, size: int, batches: int | None) -> int:
    """The input's batch that is rank ``rank``'s ``index``-th (wrapping around when finite)."""
    at = rank + index * size
    return at if batches is None else at % batches


@dataclass
class Sharded:
    """What ``model.fit`` gets on this rank: ``x``, ``y``, its keyword arguments, and callbacks
    the input needs (a sampler's epoch)."""

    x: Any
    y: Any
    kwargs: dict[str, Any]
    callbacks: list[keras.callbacks.Callback] = field(default_factory=list)
    kind: str = "arrays"


def kind_of(x: Any) -> str:
    """``arrays``, ``tf.data``, ``pydataset``, ``torch-loader``, ``torch-dataset``,
    ``torch-iterable`` or ``generator`` (a framework is imported only when ``x`` is its)."""
    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    module = type(x).__module__
    if module.startswith("tensorflow") and _is_tf_dataset(x):
        return "tf.data"
    if module.startswith("torch") or _has_torch_base(x):
        from torch.utils.data import DataLoader, Dataset, IterableDataset

        if isinstance(x, DataLoader):
            return "torch-loader"
        if isinstance(x, Dataset) and not isinstance(x, IterableDataset):
            return "torch-dataset"
        if isinstance(x, IterableDataset):
            return "torch-iterable"
    if inspect.isgenerator(x) or isinstance(x, Iterator):
        return "generator"
    return "arrays"


def _is_tf_dataset(x: Any) -> bool:
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def _iterable(dataset: Any) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def _has_torch_base(x: Any) -> bool:
    return any(c.__module__.startswith("torch.utils.data") for c in type(x).__mro__[1:])


def shard_input(x: Any, y: Any, kwargs: dict[str, Any], rank: int, size: int) -> Sharded:
    """This rank's share of ``x`` (and ``y``, arrays only), and ``fit``'s arguments for it."""
    kwargs = dict(kwargs)
    loading = {k: kwargs.pop(k) for k in LOADING if k in kwargs}
    kind = kind_of(x)
    if loading and kind != "pydataset":
        raise InputError(
            f"fit({', '.join(f'{k}=' for k in loading)}...): these load a keras.utils.PyDataset "
            f"in parallel (Keras 3 moved them there from fit), and x is {kind}. Fix: give fit a "
            "PyDataset; for a torch DataLoader set its num_workers; for tf.data use "
            "num_parallel_calls and prefetch"
        )
    if kind == "arrays":
        from hvdkit.keras import shard

        arrays = shard(x) if y is None else shard(x, y)
        xs, ys = (arrays, None) if y is None else arrays
        return Sharded(xs, ys, kwargs)
    if y is not None:
        raise InputError(f"fit(x, y): x is {kind}, which holds its targets; give y=None")
    spe = kwargs.get("steps_per_epoch")
    if kind == "torch-iterable" or (kind == "torch-loader" and _iterable(x.dataset)):
        raise InputError(
            "fit(torch IterableDataset): it has no indices for a DistributedSampler to split. "
            "Fix: make each rank's dataset yield its own share (hvdkit.keras.rank() and "
            "size()), wrap it in a DataLoader and give fit steps_per_epoch; or use a map-style "
            "Dataset"
        )
    if kind == "tf.data":
        return Sharded(_tf_data(x, rank, size, spe), None, kwargs, kind=kind)
    if kind == "pydataset":
        return Sharded(ShardedPyDataset(x, rank, size, spe, **loading), None, kwargs, kind=kind)
    if kind in ("torch-loader", "torch-dataset"):
        loader = _torch_loader(x, kind, rank, size, kwargs)
        return Sharded(loader, None, kwargs, [_SamplerEpoch(loader.sampler)], kind)
    if spe is None:
        raise InputError(
            "fit(generator): a generator has no length, so the ranks cannot agree on an "
            "epoch's steps. Fix: give steps_per_epoch=N (batches per rank per epoch); each rank "
            "takes items rank, rank + size, ... of its own generator, so make every rank's "
            "generator yield the same items"
        )
    return Sharded(_every(x, rank, size), None, kwargs, kind=kind)


def _every(items: Any, start: int, step: int) -> Iterator[Any]:
    """Items ``start, start + step, ...`` as a generator (what Keras recognises)."""
    yield from itertools.islice(iter(items), start, None, step)


def _tf_data(dataset: Any, rank: int, size: int, steps_per_epoch: int | None) -> Any:
    import tensorflow as tf

    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY or cardinality == tf.data.UNKNOWN_CARDINALITY:
        if steps_per_epoch is None:
            what = (
                "repeats forever"
                if cardinality == tf.data.INFINITE_CARDINALITY
                else ("has a length TensorFlow cannot know (filter, from_generator...)")
            )
            raise InputError(
                f"fit(tf.data.Dataset): the dataset {what}, so the ranks cannot agree on an "
                "epoch's steps. Fix: give steps_per_epoch=N (batches per rank per epoch)"
                + (
                    ""
                    if cardinality == tf.data.INFINITE_CARDINALITY
                    else ", or tell TensorFlow its length: "
                    "dataset.apply(tf.data.experimental.assert_cardinality(N))"
                )
            )
        return dataset.shard(size, rank)
    if cardinality == 0:
        raise InputError("fit(tf.data.Dataset): the dataset is empty")
    return dataset.repeat().shard(size, rank).take(steps(cardinality, size))


class ShardedPyDataset(keras.utils.PyDataset):
    """This rank's batches of a ``PyDataset``: ``rank, rank + size, ...`` (wrapping around),
    loaded with the given ``workers``/``use_multiprocessing``/``max_queue_size`` (else the
    dataset's own)."""

    def __init__(
        self, dataset: Any, rank: int, size: int, steps_per_epoch: int | None, **loading: Any
    ) -> None:
        super().__init__(**{k: loading.get(k, getattr(dataset, k)) for k in LOADING})
        self.dataset, self.rank, self.size = dataset, rank, size
        self.batches: int | None = dataset.num_batches
        if self.batches is None and steps_per_epoch is None:
            raise InputError(
                "fit(PyDataset): the dataset has no length (num_batches is None), so the ranks "
                "cannot agree on an epoch's steps. Fix: give steps_per_epoch=N"
            )
        if self.batches == 0:
            raise InputError("fit(PyDataset): the dataset has no batches")

    @property
    def num_batches(self) -> int | None:
        return None if self.batches is None else steps(self.batches, self.size)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[source_batch(index, self.rank, self.size, self.batches)]

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()


def _torch_loader(x: Any, kind: str, rank: int, size: int, kwargs: dict[str, Any]) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if kind == "torch-dataset":
        shuffle = bool(kwargs.pop("shuffle", True))
        batch_size = kwargs.pop("batch_size", None) or 32
        sampler: Any = DistributedSampler(x, num_replicas=size, rank=rank, shuffle=shuffle)
        return DataLoader(x, batch_size=batch_size, sampler=sampler)
    loader = x
    if loader.batch_size is None:
        raise InputError(
            "fit(DataLoader): the loader has its own batch_sampler, which hvdkit cannot shard. "
            "Fix: give the DataLoader batch_size (and shuffle) instead, or shard the sampler "
            "yourself and call model.fit"
        )
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
    )
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
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )


class _SamplerEpoch(keras.callbacks.Callback):
    """A ``DistributedSampler`` reshuffles by its epoch: set it at each epoch's start."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.sampler.set_epoch(epoch)
