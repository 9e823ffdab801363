"""What :meth:`hvdkit.keras.Session.fit` takes, as ``model.fit`` does, each sharded per rank
so that the ranks' shares partition every epoch and every rank takes the same number of steps
(each step is an allreduce all ranks join: a rank with one batch fewer would leave the others
waiting forever).

==========================  ================================================================
input                        this rank's share
==========================  ================================================================
arrays: NumPy, tensors,      rows ``rank, rank + size, ...`` of every array at once (as
Python lists, dicts and      :func:`hvdkit.keras.shard`): ``x``, ``y`` and ``sample_weight``,
lists of arrays              each a single array or a dict/list/tuple of them (multi-input)
``tf.data.Dataset``          the pipeline with a shard inserted at its source (or above the
                             first op a shard cannot pass, :func:`shard_cut`): each rank maps,
                             shuffles (reshuffling each epoch) and batches its own elements
                             ``rank, rank + size, ...`` only
``keras.utils.PyDataset``    batches ``rank, rank + size, ...``, loaded with ``workers``,
                             ``use_multiprocessing`` and ``max_queue_size``
torch ``DataLoader``         positions ``rank, rank + size, ...`` of its own sampler's indices
                             (``SubsetRandomSampler``, ``WeightedRandomSampler``, shuffled or
                             not), drawn with one seed on every rank, a new draw each epoch
torch ``Dataset``            batches of ``batch_size`` over a ``DistributedSampler``
generator, iterator          items ``rank, rank + size, ...``; ``steps_per_epoch`` required
==========================  ================================================================

A finite input of ``n`` elements (rows, batches, indices, items) that does not divide by the
ranks gives every rank ``ceil(n / size)`` of them, the short shares padded: arrays repeat the
rank's first rows (:func:`shard_rows`), the others wrap around to the input's first elements
(:func:`source_batch`, :func:`rank_indices`, :func:`balanced`). Rank ``r``'s ``k``-th element
being the input's ``k * size + r``, step ``k`` trains what one process would on the
``size`` ranks' batches together. An input whose length nobody knows (a ``tf.data`` filter, a
generator) needs ``steps_per_epoch``: each rank repeats its ``tf.data`` share, and a finite
generator's shares are padded to one length, so no rank runs out before the others.

Where every rank must draw the same thing (a ``tf.data`` source, a sampler's indices), the
session checks with one collective (``gather``) before the first step that they did, and stops
every rank naming the fix otherwise. This module picks the way for each kind (:func:`kind_of`,
:func:`shard_input`) and shards arrays and ``PyDataset``; :mod:`hvdkit.keras.tf_pipeline`
shards ``tf.data`` pipelines, :mod:`hvdkit.keras.torch_loader` torch loaders, and
:mod:`hvdkit.keras.shares` holds the index arithmetic they share (pure).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from hvdkit.keras import profiling, tf_pipeline, torch_loader
from hvdkit.keras.shares import (
    Gather,
    InputError,
    balanced,
    shard_rows,
    source_batch,
    steps,
    validation_at,
    validation_rows,
)

LOADING = ("workers", "use_multiprocessing", "max_queue_size")
"""``fit`` arguments of Keras 2 (the seed's ``fit_generator(workers=8, ...)``): Keras 3 moved
them to ``PyDataset``; the session takes them and gives them to the sharded ``PyDataset``."""


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


def gather_over_ranks(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order, through Horovod (the hook :class:`Session` gives
    :func:`shard_input`)."""
    from hvdkit.keras import backend

    return list(backend.horovod().allgather_object(value, name="hvdkit.inputs"))


def shard_input(
    x: Any,
    y: Any,
    kwargs: dict[str, Any],
    rank: int,
    size: int,
    gather: Gather | None = None,
) -> Sharded:
    """This rank's share of ``x`` (with ``y`` and ``sample_weight``, arrays only), and
    ``fit``'s arguments for it. ``gather`` (every rank calls it, or none does) checks that the
    ranks drew the same ``tf.data`` source and sampler indices; without it, nothing is
    compared across ranks."""
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
        return _shard_arrays(x, y, kwargs, rank, size)
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
        dataset = tf_pipeline.shard_dataset(x, rank, size, spe, gather)
        return Sharded(dataset, None, kwargs, kind=kind)
    if kind == "pydataset":
        return Sharded(ShardedPyDataset(x, rank, size, spe, **loading), None, kwargs, kind=kind)
    if kind in ("torch-loader", "torch-dataset"):
        loader = torch_loader.shard_loader(x, kind, rank, size, kwargs, gather)
        return Sharded(loader, None, kwargs, [torch_loader.SamplerEpoch(loader.sampler)], kind)
    if spe is None:
        raise InputError(
            "fit(generator): a generator has no length, so the ranks cannot agree on an "
            "epoch's steps. Fix: give steps_per_epoch=N (batches per rank per epoch); each rank "
            "takes items rank, rank + size, ... of its own generator, so make every rank's "
            "generator yield the same items"
        )
    return Sharded(balanced(_timed(x), rank, size), None, kwargs, kind=kind)


def _timed(items: Iterable[Any]) -> Iterator[Any]:
    """``items``, each ``next`` a load under ``--profile`` (a compiled step's data)."""
    iterator = iter(items)
    while True:
        with profiling.loading():
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


# --- arrays -------------------------------------------------------------------------------


def _shard_arrays(x: Any, y: Any, kwargs: dict[str, Any], rank: int, size: int) -> Sharded:
    """The same rows of every array in ``x``, ``y`` and ``sample_weight``; with
    ``validation_split``, the global arrays split first (:func:`_split_validation`)."""
    given = {"x": x, "y": y, "sample_weight": kwargs.pop("sample_weight", None)}
    lengths = {
        path: _length(path, leaf) for name in given for path, leaf in _leaves(given[name], name)
    }
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{path}: {n}" for path, n in lengths.items())
        raise InputError(
            f"fit(x, y, sample_weight): the arrays differ in length ({listed}), so their rows "
            "cannot be sharded together. Fix: give every array one row per sample"
        )
    n = next(iter(lengths.values())) if lengths else None
    if n is not None and kwargs.get("validation_split") and kwargs.get("validation_data") is None:
        given, n = _split_validation(given, n, kwargs, rank, size)
        kwargs.pop("validation_split")
    if n is not None:
        rows = shard_rows(n, rank, size)
        given = {name: _map_leaves(lambda a: take_rows(a, rows), v) for name, v in given.items()}
    if given["sample_weight"] is not None:
        kwargs["sample_weight"] = given["sample_weight"]
    return Sharded(given["x"], given["y"], kwargs)


def _split_validation(
    given: dict[str, Any], n: int, kwargs: dict[str, Any], rank: int, size: int
) -> tuple[dict[str, Any], int]:
    """The training part of ``given`` (its first rows, and how many), as one process's
    ``fit`` splits the whole arrays; the rest becomes ``kwargs["validation_data"]``, this
    rank's rows :func:`validation_rows` of it."""
    at = validation_at(n, kwargs["validation_split"])
    everyone = keras.config.backend() == "jax"  # one program over the ranks: equal shapes
    rows = at + validation_rows(n - at, rank, size, everyone)
    held = {name: _map_leaves(lambda a: take_rows(a, rows), v) for name, v in given.items()}
    kwargs["validation_data"] = (held["x"], held["y"], held["sample_weight"])
    head = np.arange(at)
    return {name: _map_leaves(lambda a: take_rows(a, head), v) for name, v in given.items()}, at


def _is_rows(value: Any) -> bool:
    """A Python list (or tuple) of numbers, or of such lists: one array, not several inputs."""
    scalars = (int, float, bool, complex, str, bytes, np.generic)
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, scalars) or _is_rows(v) for v in value)
    )


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(path, array)`` for each array in a dict/list/tuple structure (``None`` skipped)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)) and not _is_rows(value):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif value is not None:
        yield path, value


def _map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each array, the structure kept."""
    if isinstance(value, dict):
        return type(value)((key, _map_leaves(fn, item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not _is_rows(value):
        items = [_map_leaves(fn, item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return None if value is None else fn(value)


def _length(path: str, array: Any) -> int:
    shape = getattr(array, "shape", None)
    if shape is not None and len(shape) and shape[0] is not None:
        return int(shape[0])
    try:
        return len(array)
    except TypeError:
        raise InputError(
            f"fit({path}): {type(array).__name__} {array!r:.40} is not an array of rows. Fix: "
            "give an array (or a list) with one row per sample"
        ) from None


def take_rows(array: Any, rows: np.ndarray) -> Any:
    """``array``'s ``rows``, in its own type where it has one (a Python list becomes NumPy)."""
    if hasattr(array, "iloc"):  # pandas: [] would pick columns
        return array.iloc[rows]
    if type(array).__module__.startswith("tensorflow"):  # no fancy indexing on tf.Tensor
        import tensorflow as tf

        return tf.gather(array, rows)
    if isinstance(array, (list, tuple)):
        array = np.asarray(array)
    return array[rows]


# --- keras.utils.PyDataset ------------------------------------------------------------------


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
        with profiling.loading():  # under --profile: a compiled step's data, timed here
            return self.dataset[source_batch(index, self.rank, self.size, self.batches)]

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()
