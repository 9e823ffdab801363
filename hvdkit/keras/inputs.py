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
every rank naming the fix otherwise. The index arithmetic and the pipeline surgery are pure;
the wrappers only apply them.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

LOADING = ("workers", "use_multiprocessing", "max_queue_size")
"""``fit`` arguments of Keras 2 (the seed's ``fit_generator(workers=8, ...)``): Keras 3 moved
them to ``PyDataset``; the session takes them and gives them to the sharded ``PyDataset``."""

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
        return Sharded(_tf_data(x, rank, size, spe, gather), None, kwargs, kind=kind)
    if kind == "pydataset":
        return Sharded(ShardedPyDataset(x, rank, size, spe, **loading), None, kwargs, kind=kind)
    if kind in ("torch-loader", "torch-dataset"):
        loader = _torch_loader(x, kind, rank, size, kwargs, gather)
        return Sharded(loader, None, kwargs, [_SamplerEpoch(loader.sampler)], kind)
    if spe is None:
        raise InputError(
            "fit(generator): a generator has no length, so the ranks cannot agree on an "
            "epoch's steps. Fix: give steps_per_epoch=N (batches per rank per epoch); each rank "
            "takes items rank, rank + size, ... of its own generator, so make every rank's "
            "generator yield the same items"
        )
    return Sharded(balanced(x, rank, size), None, kwargs, kind=kind)


# --- arrays -------------------------------------------------------------------------------


def _shard_arrays(x: Any, y: Any, kwargs: dict[str, Any], rank: int, size: int) -> Sharded:
    """The same rows of every array in ``x``, ``y`` and ``sample_weight``."""
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
    if lengths:
        rows = shard_rows(next(iter(lengths.values())), rank, size)
        given = {name: _map_leaves(lambda a: take_rows(a, rows), v) for name, v in given.items()}
    if given["sample_weight"] is not None:
        kwargs["sample_weight"] = given["sample_weight"]
    return Sharded(given["x"], given["y"], kwargs)


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


# --- tf.data ------------------------------------------------------------------------------

# tf.data ops that a shard below them leaves a partition of every epoch: they act on each
# element alone, or reorder and regroup elements without counting positions (unlike take,
# skip, zip, window, or flat_map/interleave, whose one input element may be the whole data).
SHARD_PASSES = frozenset(
    {
        "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2", "FilterDataset",
        "ParallelFilterDataset", "ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
        "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2", "BatchDataset",
        "BatchDatasetV2", "PaddedBatchDataset", "PaddedBatchDatasetV2", "ParallelBatchDataset",
        "MapAndBatchDataset", "UnbatchDataset", "DenseToSparseBatchDataset",
        "GroupByWindowDataset", "PrefetchDataset", "CacheDataset", "CacheDatasetV2",
        "RepeatDataset", "OptionsDataset", "IgnoreErrorsDataset", "PrivateThreadPoolDataset",
        "MaxIntraOpParallelismDataset", "ThreadPoolDataset", "ModelDataset", "OptimizeDataset",
        "OptimizeDatasetV2",
    }
)  # fmt: skip
# Random ops, and the inputs that hold their two seeds (both 0: a new seed per process).
RANDOM_SEEDS = {
    "ShuffleDataset": (2, 3), "ShuffleDatasetV3": (2, 3), "ShuffleAndRepeatDataset": (2, 3),
    "ShuffleAndRepeatDatasetV2": (2, 3), "RandomDataset": (0, 1), "RandomDatasetV2": (0, 1),
    "SamplingDataset": (2, 3), "ShuffleDatasetV2": None,  # seeds in a resource: unknown
}  # fmt: skip
METHODS = {
    "TensorSlice": "from_tensor_slices", "Tensor": "from_tensors", "ParallelMap": "map",
    "ParallelInterleave": "interleave", "ParallelBatch": "batch", "ShuffleAndRepeat": "shuffle",
    "Random": "Dataset.random", "Sampling": "rejection_resample", "AssertCardinality":
    "assert_cardinality", "LegacyParallelInterleave": "interleave",
}  # fmt: skip
SHARD_NODES = "hvdkit_shard"


@dataclass(frozen=True)
class Cut:
    """Where hvdkit shards a ``tf.data`` pipeline's graph: above node ``below`` (the lowest op
    a shard cannot pass, often the source), which node ``above`` reads."""

    below: str
    above: str
    op: str


def _tf_data(dataset: Any, rank: int, size: int, spe: int | None, gather: Gather | None) -> Any:
    if size > 1:
        dataset = _shard_pipeline(dataset, rank, size, gather)
    return _equal_steps(dataset, spe)


def _shard_pipeline(dataset: Any, rank: int, size: int, gather: Gather | None) -> Any:
    """``dataset`` with this rank's shard inserted at :func:`shard_cut` (padded to equal
    shares when the length there is known), after the ranks agreed that the part below the
    cut yields the same elements in the same order everywhere."""
    graph, unread = _graph_of(dataset)
    if graph is None:
        _agree(gather, "unread", None, "tf.data.Dataset", "its pipeline")
        warnings.warn(
            f"hvdkit: cannot read this tf.data pipeline ({unread}), so it shards the "
            "pipeline's output: every rank runs the whole pipeline and keeps elements rank, "
            "rank + size, ...; that partitions an epoch only if every rank's pipeline yields "
            "the same elements in the same order (give each shuffle a seed)",
            stacklevel=4,
        )
        return _shard_output(dataset, rank, size)
    cut = shard_cut(graph)
    refusal = unrepeatable(graph, cut, dataset.options().deterministic is False)
    part = f"the pipeline up to {_label(cut.op)}"
    _agree(gather, pipeline_digest(graph, cut), refusal, "tf.data.Dataset", part)
    length = _length_below(graph, cut)
    if length == 0:
        raise InputError("fit(tf.data.Dataset): the dataset is empty")
    return _dataset_of(insert_shard(graph, cut, rank, size, length), dataset.element_spec)


def _equal_steps(dataset: Any, spe: int | None) -> Any:
    """This rank's dataset, taking the same steps as every other rank's (refused without
    ``steps_per_epoch`` where the length is not known)."""
    import tensorflow as tf

    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        if spe is None:
            raise InputError(
                "fit(tf.data.Dataset): the dataset repeats forever, so the ranks cannot agree "
                "on an epoch's steps. Fix: give steps_per_epoch=N (batches per rank per epoch)"
            )
        return dataset
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        if spe is None:
            raise InputError(
                "fit(tf.data.Dataset): the dataset has a length TensorFlow cannot know "
                "(filter, from_generator...), so the ranks cannot agree on an epoch's steps. "
                "Fix: give steps_per_epoch=N (batches per rank per epoch; each rank then "
                "repeats its share, so that none runs out before the others), or tell "
                "TensorFlow its length: dataset.apply(tf.data.experimental.assert_cardinality(N))"
            )
        # Shares of unknown length differ between ranks: a rank that ran out would end fit
        # alone and leave the others waiting in the allreduce.
        return dataset.repeat()
    if cardinality == 0:
        raise InputError(
            "fit(tf.data.Dataset): this rank's share of the dataset has no batches (the "
            "dataset is empty, or batch(drop_remainder=True) gets fewer elements than a batch "
            "per rank). Fix: a smaller batch size or fewer ranks"
        )
    return dataset


def _shard_output(dataset: Any, rank: int, size: int) -> Any:
    import tensorflow as tf

    cardinality = int(dataset.cardinality())
    if cardinality > 0:
        return dataset.repeat().shard(size, rank).take(steps(cardinality, size))
    if cardinality == 0:
        raise InputError("fit(tf.data.Dataset): the dataset is empty")
    assert cardinality in (tf.data.INFINITE_CARDINALITY, tf.data.UNKNOWN_CARDINALITY)
    return dataset.shard(size, rank)


def _agree(
    gather: Gather | None, digest: str, refusal: str | None, what: str, part: str, extra: Any = None
) -> list[Any]:
    """Every rank's ``extra``, after raising on every rank when any rank refuses or when the
    ranks' digests differ."""
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


def _graph_of(dataset: Any) -> tuple[Any, str]:
    """The pipeline's GraphDef, or ``None`` and why it cannot be read."""
    import tensorflow as tf

    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # ignore: py_function and resources stay in this process
            strip_device_assignment=False,  # stripping breaks a py_function's device
        )
        return tf.compat.v1.GraphDef.FromString(serialized.numpy()), ""
    except (tf.errors.OpError, ValueError) as error:  # a 2 GB protobuf, an op with no graph
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _dataset_of(graph: Any, element_spec: Any) -> Any:
    import tensorflow as tf

    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    return tf.data.experimental.from_variant(variant, element_spec)


def _source(ref: str) -> str:
    """The node name in an input reference (``^ctrl``, ``node:0``, ``node:output:0``)."""
    return ref.lstrip("^").split(":")[0]


def shard_cut(graph: Any) -> Cut:
    """Where to shard: walking down from the pipeline's output through the ops in
    :data:`SHARD_PASSES` (an in-memory cache only), to just above the first op the shard
    cannot pass; for ``from_tensor_slices(...).map(f).shuffle(n).batch(b)``, above the
    source, so that each rank maps, shuffles and batches only its own elements."""
    nodes = {node.name: node for node in graph.node}
    above = next(node for node in graph.node if node.op == "_Retval")
    below = nodes[_source(above.input[0])]
    while _passes(below, nodes):
        above, below = below, nodes[_source(below.input[0])]
    return Cut(below.name, above.name, below.op)


def _passes(node: Any, nodes: dict[str, Any]) -> bool:
    if node.op not in SHARD_PASSES:
        return False
    if node.op.startswith("Cache"):  # a file cache would mix every rank's shard in one file
        return _const(nodes, node.input[1]) in (b"", "")
    return True


def _const(nodes: dict[str, Any], ref: str) -> Any:
    """The value of the Const node ``ref`` names (a scalar as a Python value), else ``None``."""
    import tensorflow as tf

    node = nodes.get(_source(ref))
    if node is None or node.op != "Const" or node.attr["dtype"].type == tf.resource:
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return value.item() if value.ndim == 0 else value


def _below(nodes: dict[str, Any], name: str) -> list[Any]:
    """Node ``name`` and every node it reads, directly or not."""
    seen, todo = {}, [name]
    while todo:
        node = nodes.get(_source(todo.pop()))
        if node is not None and node.name not in seen:
            seen[node.name] = node
            todo.extend(node.input)
    return list(seen.values())


def unrepeatable(graph: Any, cut: Cut, nondeterministic: bool) -> str | None:
    """Why the part of the pipeline below ``cut``, which every rank runs whole, would yield
    other elements or another order on each rank: an unseeded shuffle (in a function too),
    a parallel op that may reorder; ``None`` when it repeats."""
    nodes = {node.name: node for node in graph.node}
    functions = {f.signature.name: f for f in graph.library.function}
    below = _below(nodes, cut.below)
    for node, scope in _with_functions(below, nodes, functions):
        if _unseeded(node, scope):
            return (
                f"fit(tf.data.Dataset): the pipeline shuffles without a seed ({_label(node.op)}) "
                f"below {_label(cut.op)}, which hvdkit cannot shard under: every rank would "
                "run it with another seed, and their shares would overlap. Fix: give it a "
                "seed, the same on every rank (shuffle(n, seed=S), list_files(..., seed=S)), or "
                f"shuffle after {_label(cut.op)}"
            )
        if _reorders(node, nondeterministic):
            return (
                f"fit(tf.data.Dataset): {_label(node.op)} below {_label(cut.op)} may yield its "
                "elements in another order on each rank (deterministic=False), so keeping "
                "every size-th element would not split them. Fix: leave deterministic at "
                f"its default there, or move {_label(cut.op)} to the end of the pipeline"
            )
    return None


def _with_functions(
    below: list[Any], nodes: dict[str, Any], functions: dict[str, Any]
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Each node below the cut with the nodes its inputs name, then those of the functions
    they call (map, interleave, filter...), recursively."""
    todo, done = [(node, nodes) for node in below], set()
    while todo:
        node, scope = todo.pop(0)
        yield node, scope
        for name in _called(node):
            if name in functions and name not in done:
                done.add(name)
                body = {n.name: n for n in functions[name].node_def}
                todo.extend((n, body) for n in functions[name].node_def)


def _called(node: Any) -> list[str]:
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _unseeded(node: Any, scope: dict[str, Any]) -> bool:
    if node.op not in RANDOM_SEEDS:
        return False
    seeds = RANDOM_SEEDS[node.op]
    if seeds is None:
        return True
    values = [_const(scope, node.input[i]) for i in seeds if i < len(node.input)]
    return len(values) == 2 and values == [0, 0]


def _reorders(node: Any, nondeterministic: bool) -> bool:
    attr = node.attr
    if "sloppy" in attr and attr["sloppy"].b:
        return True
    if "deterministic" in attr:
        setting = attr["deterministic"].s
        return setting == b"false" or (setting == b"default" and nondeterministic)
    return False


def _label(op: str) -> str:
    """``take (TakeDataset)``: the Python method, and the op TensorFlow names."""
    stem = re.sub(r"(Dataset)?(V\d+)?$", "", op)
    if stem.startswith("Experimental"):
        stem = stem[len("Experimental") :]
    method = METHODS.get(stem) or re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()
    return f"{method} ({op})"


def pipeline_digest(graph: Any, cut: Cut) -> str:
    """A digest of what every rank must run alike: the ops below ``cut`` and their constants
    (the data, the seeds), not the names TensorFlow numbers per process."""
    import tensorflow as tf

    nodes = {node.name: node for node in graph.node}
    digest = hashlib.sha256()
    for node in sorted(_below(nodes, cut.below), key=lambda n: n.name):
        digest.update(node.op.encode())
        if node.op == "Const" and node.attr["dtype"].type != tf.resource:
            digest.update(node.attr["value"].tensor.SerializeToString(deterministic=True))
    return digest.hexdigest()


def _length_below(graph: Any, cut: Cut) -> int:
    """How many elements the node below the cut yields (TensorFlow's -1 infinite, -2
    unknown); read off the graph for an in-memory source, else computed by TensorFlow."""
    import tensorflow as tf

    nodes = {node.name: node for node in graph.node}
    below = nodes[cut.below]
    if below.op == "TensorDataset":
        return 1
    first = nodes.get(_source(below.input[0])) if below.input else None
    if below.op == "TensorSliceDataset" and first is not None and first.op == "Const":
        return int(first.attr["value"].tensor.tensor_shape.dim[0].size)
    part = tf.compat.v1.GraphDef()
    part.library.CopyFrom(graph.library)
    part.versions.CopyFrom(graph.versions)
    part.node.extend(_below(nodes, cut.below))
    retval = part.node.add()
    retval.CopyFrom(next(node for node in graph.node if node.op == "_Retval"))
    retval.input[0] = cut.below
    variant = tf.raw_ops.DatasetFromGraph(graph_def=part.SerializeToString())
    return int(tf.raw_ops.DatasetCardinality(input_dataset=variant))


def insert_shard(graph: Any, cut: Cut, rank: int, size: int, length: int) -> Any:
    """A copy of ``graph`` where ``cut.above`` reads rank ``rank``'s shard of ``cut.below``:
    elements ``rank, rank + size, ...``, a finite ``length`` first padded to a multiple of
    ``size`` with the first elements again (so every rank gets ``ceil(length / size)``)."""
    import tensorflow as tf

    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph)
    nodes = {node.name: node for node in out.node}
    below, tail = nodes[cut.below], cut.below
    if length > 0 and length % size:
        tail = _add_dataset_op(out, "RepeatDataset", tail, [-1], below)
        tail = _add_dataset_op(out, "TakeDataset", tail, [steps(length, size) * size], below)
    tail = _add_dataset_op(out, "ShardDataset", tail, [size, rank], below)
    nodes[cut.above].input[0] = tail
    return out


def _add_dataset_op(graph: Any, op: str, input_name: str, args: list[int], like: Any) -> str:
    """Add dataset op ``op`` reading ``input_name`` with int64 ``args``, typed as ``like``."""
    import tensorflow as tf

    name = f"{SHARD_NODES}/{op}"
    inputs = [input_name]
    for i, value in enumerate(args):
        const = graph.node.add(name=f"{name}/arg{i}", op="Const")
        const.attr["dtype"].type = tf.int64.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int64))
        inputs.append(const.name)
    node = graph.node.add(name=name, op=op, input=inputs)
    types = like.attr["output_types"] if "output_types" in like.attr else like.attr["Toutput_types"]
    node.attr["output_types"].CopyFrom(types)
    node.attr["output_shapes"].CopyFrom(like.attr["output_shapes"])
    return name


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
        return self.dataset[source_batch(index, self.rank, self.size, self.batches)]

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()


# --- torch ----------------------------------------------------------------------------------


def _torch_loader(
    x: Any, kind: str, rank: int, size: int, kwargs: dict[str, Any], gather: Gather | None
) -> Any:
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
    seeds = _agree(gather, _probe(sampler), None, "DataLoader", part, torch.initial_seed())
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


class _SamplerEpoch(keras.callbacks.Callback):
    """A sampler reshuffles by its epoch: set it at each epoch's start."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.sampler.set_epoch(epoch)
