"""How :meth:`hvdkit.keras.Session.fit` shards a ``tf.data.Dataset``: it reads the pipeline's
graph, finds where a shard can go without changing what an epoch holds (:func:`shard_cut`: at
the source, or above the first op a shard cannot pass), checks that what lies below runs the
same on every rank (:func:`unrepeatable`, :func:`pipeline_digest`), and inserts the shard there
(:func:`insert_shard`): each rank maps, shuffles (reshuffling each epoch) and batches its own
elements ``rank, rank + size, ...`` only. The graph surgery works on GraphDefs; TensorFlow is
imported only when a dataset is given.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hvdkit.keras.shares import Gather, InputError, agree, steps

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


def shard_dataset(
    dataset: Any, rank: int, size: int, spe: int | None, gather: Gather | None
) -> Any:
    """This rank's share of ``dataset`` (sharded at :func:`shard_cut`, or at its output where
    its graph cannot be read), taking as many steps as every other rank's."""
    if size > 1:
        dataset = _shard_pipeline(dataset, rank, size, gather)
    return _equal_steps(dataset, spe)


def _shard_pipeline(dataset: Any, rank: int, size: int, gather: Gather | None) -> Any:
    """``dataset`` with this rank's shard inserted at :func:`shard_cut` (padded to equal
    shares when the length there is known), after the ranks agreed that the part below the
    cut yields the same elements in the same order everywhere."""
    graph, unread = _graph_of(dataset)
    if graph is None:
        agree(gather, "unread", None, "tf.data.Dataset", "its pipeline")
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
    agree(gather, pipeline_digest(graph, cut), refusal, "tf.data.Dataset", part)
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
