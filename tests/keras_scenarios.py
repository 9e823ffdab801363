"""Generated scenarios for hvdkit.keras's ``Session.fit`` (issue 49, deliverable 2): a grammar of
the inputs users give ``model.fit``, the shares hvdkit documents for them, the one-process
oracle, and the checks of the sample ledger.

A :class:`Case` is one training script's choices on one Keras backend: the input (arrays, a
list or dict of them, ``sample_weight``, ``tf.data`` shuffled without a seed, mapped, of
unknown length or repeating forever, a ``PyDataset`` loaded by threads or processes and
reordering its rows each epoch, a torch ``DataLoader`` with its own sampler and workers, a
torch ``Dataset``, a generator), ``validation_data`` or ``validation_split``,
``steps_per_epoch``, the optimizer and LR scaling, and a resume from the checkpoint after the
first epoch.
:func:`cases` draws them with Hypothesis (seeded), each backend only what it can take;
tests/workers/keras_scenario_worker.py runs a backend's cases in one 2-rank job, each rank
keeping a ledger of the sample ids of each step (column 0 of every row is its id, which the
model's first layer drops). :func:`oracle` trains one plain process on the global batches the
ledger recorded; :func:`check` compares the two, and the ledger with the shares this module
computes from the case alone (every sample once an epoch, plus the documented padding; the
exact global batches where the order is deterministic). Keras is imported only by the
functions that build models.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cache
from itertools import pairwise, product
from typing import Any

import numpy as np

SIZE = 2  # ranks of every job
FEATURES, VALIDATION, SPLIT = 4, 7, 0.25
LR = {"sgd": 0.05, "sgd_momentum": 0.02, "adam": 0.01}
BACKENDS = ("tensorflow", "torch", "jax")
ARRAYS = ("arrays", "list", "dict")
KINDS = (*ARRAYS, "tf.data", "pydataset", "loader", "torch-dataset", "generator")


@dataclass(frozen=True)
class Case:
    backend: str = "tensorflow"
    kind: str = "arrays"  # one of KINDS
    samples: int = 23
    batch: int = 4  # per rank: fit's batch_size, the dataset's batch, the loader's
    sample_weight: bool = False  # arrays kinds: fit(sample_weight=); tf.data: (x, y, w)
    shuffle: bool = False  # fit(shuffle=) (arrays' rows, a PyDataset's batches, a torch
    # Dataset's sampler); tf.data .shuffle(n) without a seed; DataLoader(shuffle=True)
    tf_map: str = "none"  # tf.data: "none", "plain", "py_function" (before the shuffle)
    length: str = "known"  # tf.data: "known", "unknown" (a filter), "forever" (.repeat());
    # generator: "forever" (the usual while True) or "finite"
    sampler: str = "default"  # DataLoader: "default", "subset", "weighted"
    workers: int = 0  # PyDataset workers (threads), DataLoader num_workers
    processes: bool = False  # PyDataset use_multiprocessing
    steps_per_epoch: int = 0  # 0: not given
    validation: str = "none"  # "none", "data" (arrays), "dataset" (a batched tf.data of them),
    # "split" (validation_split, arrays kinds)
    optimizer: str = "sgd"
    lr_scaling: str = "none"  # "none", "size"
    resume: bool = False  # fit one epoch, then a new setup() resumes from the checkpoint
    epochs: int = 2

    def reproducer(self, seed: int | None = None) -> str:
        """One line that runs this case again (tests/test_keras_scenarios.py)."""
        where = f"seed {seed}: " if seed is not None else ""
        spec = json.dumps(asdict(self))
        return f"{where}HVDKIT_SCENARIO='{spec}' pytest tests/test_keras_scenarios.py -k one_case"

    @property
    def streams(self) -> bool:
        """Whether an epoch is ``steps_per_epoch`` steps of one stream that goes on across
        the epochs of a ``fit`` (Keras keeps the iterator), not a pass over the data."""
        return self.steps_per_epoch > 0


def allowed(case: Case) -> bool:
    """Whether the case is a script its backend runs (the grammar's constraints)."""
    if case.kind not in ARRAYS and (case.validation == "split"):
        return False  # Keras refuses validation_split for what it cannot slice
    if case.sample_weight and case.kind not in (*ARRAYS, "tf.data"):
        return False
    if case.processes and (case.kind != "pydataset" or not case.workers):
        return False
    needs_steps = (case.kind == "tf.data" and case.length != "known") or case.kind == "generator"
    if needs_steps != bool(case.steps_per_epoch):
        return False
    if case.kind == "generator" and case.shuffle:
        return False
    if case.sampler != "default" and case.kind != "loader":
        return False
    if case.workers and case.kind not in ("pydataset", "loader"):
        return False
    if case.tf_map != "none" and case.kind != "tf.data":
        return False
    if case.length != "known" and case.kind not in ("tf.data", "generator"):
        return False
    if case.kind == "generator" and case.length == "known":
        return False
    if case.backend == "jax" and case.kind == "generator" and case.length == "finite":
        items = math.ceil(math.ceil(case.samples / case.batch) / SIZE)  # each rank's
        if case.validation != "none" and items % case.steps_per_epoch == 0:
            # An epoch that starts where the generator ran out, then validation: Keras's JAX
            # trainer raises a TypeError in one process too (a metric variable purged).
            return False
    if case.backend == "jax" and case.samples % case.batch:
        # On JAX each step's ledger is the global batch: where the ranks' batches differ in
        # size the oracle needs each rank's, which global_steps finds only where the case
        # fixes them.
        if case.kind == "pydataset" and case.workers and case.shuffle:
            return False
    return train_rows(case) >= SIZE


def cases(seed: int, count: int, backend: str) -> list[Case]:
    """``count`` cases of ``backend`` drawn by Hypothesis from the grammar, reproducibly."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    drawn: list[Case] = []

    @st.composite
    def case_of(draw: Any) -> Case:
        kind = draw(st.sampled_from(KINDS))
        streams = (kind == "tf.data" and draw(st.booleans())) or kind == "generator"
        length = "known"
        if kind == "tf.data" and streams:
            length = draw(st.sampled_from(["unknown", "forever"]))
        elif kind == "generator":
            length = draw(st.sampled_from(["forever", "forever", "finite"]))
        workers = draw(st.sampled_from([0, 0, 2])) if kind in ("pydataset", "loader") else 0
        batch = draw(st.integers(2, 5))
        samples = draw(st.integers(9, 41))
        return Case(
            backend=backend,
            kind=kind,
            samples=samples,
            batch=batch,
            sample_weight=kind in (*ARRAYS, "tf.data") and draw(st.booleans()),
            shuffle=kind != "generator" and draw(st.booleans()),
            tf_map=draw(st.sampled_from(["none", "plain", "py_function"]))
            if kind == "tf.data"
            else "none",
            length=length,
            sampler=draw(st.sampled_from(["default", "subset", "weighted"]))
            if kind == "loader"
            else "default",
            workers=workers,
            processes=kind == "pydataset" and bool(workers) and draw(st.booleans()),
            steps_per_epoch=draw(st.integers(2, 6)) if streams else 0,
            validation=draw(
                st.sampled_from(["none", "data", "dataset", "split"] if kind in ARRAYS
                                else ["none", "data", "dataset"])  # fmt: skip
            ),
            optimizer=draw(st.sampled_from(sorted(LR))),
            lr_scaling=draw(st.sampled_from(["none", "size"])),
            resume=draw(st.sampled_from([False, False, True])),
        )

    pool: list[Case] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count * 20, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case_of())
    def collect(case: Case) -> None:
        mine = sum(1 for c in pool if c.kind == case.kind)
        if mine < count and case not in pool and allowed(case):
            pool.append(case)

    collect()
    # Hypothesis starts from the simplest cases: take them round the input kinds instead,
    # from the whole pool, so that a slice of 15 holds every kind.
    rng = random.Random(seed)
    by_kind = {kind: [c for c in pool if c.kind == kind] for kind in KINDS}
    for group in by_kind.values():
        rng.shuffle(group)
    while len(drawn) < count and any(by_kind.values()):
        for kind in rng.sample(KINDS, len(KINDS)):
            if by_kind[kind] and len(drawn) < count:
                drawn.append(by_kind[kind].pop())
    return drawn


# --- what the worker and the oracle build alike -------------------------------------------


def data(case: Case) -> dict[str, np.ndarray]:
    """The case's samples (column 0 of ``x`` the id), their targets and weights, and the
    validation rows (ids after the samples'); the same on every rank."""
    rng = np.random.default_rng(11)
    n = case.samples + VALIDATION
    ids = np.arange(n, dtype="float32")[:, None]
    x = np.concatenate([ids, rng.normal(size=(n, FEATURES))], axis=1).astype("float32")
    y = (x[:, 1:2] - 0.5 * x[:, 2:3] + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    w = rng.uniform(0.5, 2.0, n).astype("float32")
    m = case.samples
    return {"x": x[:m], "y": y[:m], "w": w[:m], "vx": x[m:], "vy": y[m:]}


def inputs_of(case: Case, x: np.ndarray) -> Any:
    """``x`` as the model takes it: one array, a list or a dict (the second input derived)."""
    if case.kind == "list":
        return [x, x[:, 1:] * 2]
    if case.kind == "dict":
        return {"main": x, "extra": x[:, 1:] * 2}
    return x


@cache
def _ledger_class() -> Any:
    import keras

    class Ledger(keras.layers.Layer):
        """Drops the id column, keeping how often each id was in the batch it was called on
        (on JAX, where one program spans the ranks, the global batch's)."""

        def __init__(self, n: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.n = n

        def build(self, shape: Any) -> None:
            self.seen = self.add_weight(
                shape=(self.n,), initializer="zeros", trainable=False, name="seen"
            )

        def call(self, x: Any) -> Any:
            ids = keras.ops.cast(x[:, 0], "int32")
            self.seen.assign(keras.ops.sum(keras.ops.one_hot(ids, self.n), axis=0))
            return x[:, 1:]

    return Ledger


def build(case: Case) -> tuple[Any, Any]:
    """The model (seeded weights) and its ledger layer."""
    import keras

    keras.utils.set_random_seed(0)
    ledger = _ledger_class()(case.samples + VALIDATION, name="ledger")
    main = keras.Input((FEATURES + 1,), name="main")
    hidden = ledger(main)
    sources: Any = main
    if case.kind in ("list", "dict"):
        extra = keras.Input((FEATURES,), name="extra")
        hidden = keras.layers.Concatenate(name="both")([hidden, extra])
        sources = {"main": main, "extra": extra} if case.kind == "dict" else [main, extra]
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(hidden)
    # Named as a script's layers are in each new process: a resume matches them by path.
    return keras.Model(sources, keras.layers.Dense(1, name="out")(hidden)), ledger


def make_optimizer(case: Case, scale: float = 1.0) -> Any:
    import keras

    lr = LR[case.optimizer] * scale
    # Named, as in each new process: Keras numbers a second optimizer of a process (adam_1),
    # and a resume matches the optimizer's variables by their paths, which hold its name.
    if case.optimizer == "adam":
        return keras.optimizers.Adam(lr, name="adam")
    momentum = 0.9 if case.optimizer == "sgd_momentum" else 0.0
    return keras.optimizers.SGD(lr, momentum=momentum, name="sgd")


def trainable(model: Any) -> list[float]:
    import keras

    flat = [np.ravel(keras.ops.convert_to_numpy(v)) for v in model.trainable_weights]
    return np.concatenate(flat).astype("float64").tolist()


def pydataset_order(n: int, reorders: int) -> list[int]:
    """The rows of a reordering ``PyDataset`` after ``reorders`` calls of its
    ``on_epoch_end`` (each a permutation from its own seeded generator)."""
    rng, order = np.random.default_rng(5), list(range(n))
    for _ in range(reorders):
        order = rng.permutation(order).tolist()
    return order


def held_in(case: Case) -> list[int]:
    """A ``SubsetRandomSampler``'s rows: every row but each third (a held-out split)."""
    return [i for i in range(case.samples) if i % 3 != 2]


def weighted(case: Case) -> tuple[list[float], int]:
    """A ``WeightedRandomSampler``'s weights (the second half never drawn) and draws."""
    half = case.samples // 2
    return [1.0 + (i % 3) if i < half else 0.0 for i in range(case.samples)], case.samples


# --- the shares hvdkit documents, from the case alone -------------------------------------


def train_rows(case: Case) -> int:
    """Samples in the training part (``validation_split``: Keras's first floor(n(1-f)))."""
    if case.validation == "split":
        return math.floor(case.samples * (1 - SPLIT))
    return case.samples


def wrapped(n: int, rank: int) -> list[int]:
    """Positions ``rank, rank + SIZE, ...`` of ``n``, padded by wrapping around to the first."""
    return [(k * SIZE + rank) % n for k in range(math.ceil(n / SIZE))] if n else []


def own_padded(n: int, rank: int) -> list[int]:
    """Rows ``rank, rank + SIZE, ...`` of ``n``, a short share repeating its own first rows
    (``hvd.shard``)."""
    rows = list(range(rank, n, SIZE)) or [rank % n]
    want = math.ceil(n / SIZE)
    return (rows * want)[:want]


def batches(rows: list[int], b: int) -> list[list[int]]:
    return [rows[k : k + b] for k in range(0, len(rows), b)]


def shares(case: Case, reorders: int = 0) -> list[list[list[int]]] | None:
    """Each rank's batches of one pass ``[rank][step] -> ids``, in the input's own order
    (before any shuffle of fit's), where the case fixes what each rank gets; ``None`` where
    a sampler draws it (a shuffled loader, a subset, weights) or for a generator.
    ``reorders``: how often a ``PyDataset`` reordered its rows (its ``on_epoch_end``)."""
    n, b = train_rows(case), case.batch
    if case.kind in ARRAYS:
        return [batches(own_padded(n, r), b) for r in range(SIZE)]
    if case.kind == "tf.data":
        return [batches(wrapped(n, r), b) for r in range(SIZE)]
    if case.kind in ("loader", "torch-dataset"):
        if case.shuffle or case.sampler != "default":
            return None
        return [batches(wrapped(n, r), b) for r in range(SIZE)]
    if case.kind == "pydataset":
        mine = batches(pydataset_order(n, reorders), b)
        return [[mine[i] for i in wrapped(len(mine), r)] for r in range(SIZE)]
    return None


def rank_batches(case: Case) -> list[list[list[int]]] | None:
    """:func:`shares` where nothing reorders them (fit's ``shuffle`` of arrays' rows and of a
    ``PyDataset``'s batches, ``tf.data``'s ``shuffle``): the global batches one process
    trains, side by side."""
    return None if case.shuffle else shares(case)


def pass_counts(case: Case) -> Counter[int] | None:
    """The ids one pass trains over all ranks (each sample once, and the padding), where
    the case fixes them."""
    order = shares(case)
    return None if order is None else Counter(i for rank in order for b in rank for i in b)


def pass_steps(case: Case) -> int:
    """Steps of one pass over the data at ``SIZE`` ranks."""
    n, b = train_rows(case), case.batch
    if case.kind == "pydataset":
        return math.ceil(math.ceil(n / b) / SIZE)
    if case.kind == "loader" and case.sampler == "subset":
        n = len(held_in(case))
    elif case.kind == "loader" and case.sampler == "weighted":
        n = weighted(case)[1]
    return math.ceil(math.ceil(n / SIZE) / b)


def generator_ranked(case: Case, steps: int) -> list[list[list[int]]]:
    """A generator's batches ``[step][rank] -> ids``: rank ``r``'s ``k``-th item is the
    generator's ``k * SIZE + r``, its batch ``(k * SIZE + r) mod batches`` (the usual
    ``while True``)."""
    mine = batches(list(range(case.samples)), case.batch)
    return [[mine[(k * SIZE + r) % len(mine)] for r in range(SIZE)] for k in range(steps)]


# --- the oracle -----------------------------------------------------------------------------


def oracle(
    case: Case, start: list[float], steps: list[list[list[int]]], epoch_starts: list[int] = ()
) -> dict[str, Any]:
    """One plain Keras process from the ranks' start, trained on the ledger's global batches
    ``steps[k][rank] -> ids``: each step the mean over ranks of each rank's mean loss (a
    sample of rank ``r`` weighted ``N / (R * n_r)``, 1 where the ranks' batches are equal),
    at the single-process LR times the ranks where ``lr_scaling="size"``. Returns the weights
    and the validation loss with them.

    On TensorFlow, Keras's ``fit`` counts one more optimizer iteration (no update) in an
    epoch whose input runs out before ``steps_per_epoch`` (a finite generator), in one process
    too; Adam's bias correction sees it in the steps after. The oracle counts it as well: the
    epoch that begins at step ``epoch_starts[e]`` and has fewer steps than asked."""

    d = data(case)
    model, _ = build(case)
    values, flat = [], np.asarray(start, dtype="float32")
    for v in model.trainable_weights:
        size = int(np.prod(v.shape))
        values.append(flat[:size].reshape(v.shape))
        flat = flat[size:]
    for v, value in zip(model.trainable_weights, values, strict=True):
        v.assign(value)
    scale = SIZE if case.lr_scaling == "size" else 1
    model.compile(optimizer=make_optimizer(case, scale), loss="mse", jit_compile=False)
    bounds = [*epoch_starts, len(steps)]
    ran_out = {
        end - 1 for begin, end in zip(bounds, bounds[1:])  # noqa: B905 (one shorter)
        if case.backend == "tensorflow" and case.steps_per_epoch
        and 0 < end - begin < case.steps_per_epoch
    }  # fmt: skip
    for k, ranks in enumerate(steps):
        ids = [i for rank in ranks for i in rank]
        factor = np.concatenate(
            [np.full(len(rank), len(ids) / (len(ranks) * len(rank))) for rank in ranks if rank]
        )
        weight = factor * (d["w"][ids] if case.sample_weight else 1.0)
        model.train_on_batch(
            inputs_of(case, d["x"][ids]), d["y"][ids], sample_weight=weight.astype("float32")
        )
        if k in ran_out:
            model.optimizer.iterations.assign_add(1)
    result: dict[str, Any] = {"weights": trainable(model)}
    if case.validation != "none":
        vx, vy, vw = validation_of(case, d)
        result["val_loss"] = float(
            model.evaluate(inputs_of(case, vx), vy, sample_weight=vw, verbose=0)
        )
    return result


def validation_of(case: Case, d: dict[str, np.ndarray]) -> tuple[Any, Any, Any]:
    """What one process validates on: ``validation_data``, or the last rows (and their
    weights) that ``validation_split`` holds out."""
    if case.validation in ("data", "dataset"):
        return d["vx"], d["vy"], None
    at = train_rows(case)
    return d["x"][at:], d["y"][at:], d["w"][at:] if case.sample_weight else None


# --- the checks -----------------------------------------------------------------------------


def global_steps(case: Case, ranks: dict[int, dict[str, Any]]) -> list[list[list[int]]]:
    """``[step][rank] -> ids`` from the ranks' ledgers. On JAX each rank's ledger holds the
    global batch (one program spans the ranks): ``[step][0]``, split into the ranks' batches
    where the case fixes them (:func:`expected_ranked`: the one choice of a batch for each
    rank that makes the step's ids), so that the oracle weights a step whose ranks' batches
    differ in size as the ranks do (the mean of each rank's mean loss)."""
    if case.backend != "jax":
        return [list(rows) for rows in zip(*(ranks[r]["steps"] for r in sorted(ranks)),
                                           strict=True)]  # fmt: skip
    record = ranks[0]
    options = expected_ranked(case, record["epoch_starts"], record["fit_starts"],
                              len(record["steps"]))  # fmt: skip
    out = []
    for ids, candidates in zip(record["steps"], options, strict=True):
        fits = [] if candidates is None else [
            list(pick) for pick in product(*candidates)
            if Counter(i for batch in pick for i in batch) == Counter(ids)
        ]  # fmt: skip
        out.append(fits[0] if fits else [ids])
    return out


def check(
    case: Case, ranks: dict[int, dict[str, Any]], expected: dict[str, Any] | None
) -> list[str]:
    """Everything wrong with one case's records by rank (``expected``: :func:`oracle`'s result
    on them, ``None`` where it could not run): an error, ranks out of step, the ledger's
    coverage and global batches against the documented shares, the weights and the
    validation loss against the oracle (tests/workers/tolerance.py's path tolerance)."""
    from workers.tolerance import max_difference, paths_close

    errors = [f"rank {r}: {v['error']}" for r, v in sorted(ranks.items()) if v.get("error")]
    if errors:
        return errors
    if sorted(ranks) != list(range(SIZE)):
        return [f"results from ranks {sorted(ranks)}"]
    problems = []
    lengths = {r: len(v["steps"]) for r, v in ranks.items()}
    if len(set(lengths.values())) > 1:
        return [f"the ranks took different numbers of steps: {lengths}"]
    if len({json.dumps(v["weights"]) for v in ranks.values()}) != 1:
        problems.append("the ranks' weights differ")
    if case.backend == "jax" and len({json.dumps(v["steps"]) for v in ranks.values()}) != 1:
        problems.append("the ranks' ledgers of the global batches differ")
    steps = global_steps(case, ranks)
    problems += ledger_problems(case, steps, ranks[0]["epoch_starts"], ranks[0]["fit_starts"])
    if expected is None:
        return [*problems, "no oracle"]
    if expected.get("error"):
        return [*problems, f"oracle: {expected['error']}"]
    if not paths_close(ranks[0]["weights"], expected["weights"], steps=max(1, len(steps))):
        difference = max_difference(ranks[0]["weights"], expected["weights"])
        problems.append(f"weights differ from the oracle's by {difference:.3g}")
    if np.allclose(ranks[0]["weights"], ranks[0]["start"], atol=1e-6):
        problems.append("nothing trained")
    if case.validation != "none":
        mine, theirs = ranks[0].get("val_loss"), expected["val_loss"]
        if mine is None or not paths_close(mine, theirs, steps=max(1, len(steps))):
            problems.append(f"val_loss {mine}, one process {theirs}")
    return problems


def ledger_problems(
    case: Case, steps: list[list[list[int]]], epoch_starts: list[int], fit_starts: list[int]
) -> list[str]:
    """The ledger against the shares the case fixes: steps per epoch, each pass's samples
    (every sample once, plus the padding), the global batches where the order is fixed, no
    validation row ever trained."""
    problems = []
    per_step = [Counter(i for rank in ranks for i in rank) for ranks in steps]
    trained = {i for c in per_step for i in c}
    held_out = sorted(i for i in trained if i >= train_rows(case))
    if held_out:
        problems.append(f"validation rows trained: {held_out}")
    spans = list(zip(epoch_starts, [*epoch_starts[1:], len(steps)], strict=True))
    want = case.steps_per_epoch or pass_steps(case)
    finite_generator = case.kind == "generator" and case.length == "finite"
    lengths = [b - a for a, b in spans]
    if not finite_generator and lengths != [want] * len(spans):
        problems.append(f"steps per epoch {lengths}, expected {want}")
    if len(spans) != case.epochs and not finite_generator:
        problems.append(f"{len(spans)} epochs, expected {case.epochs}")
    if case.kind == "generator":
        if case.length == "forever":
            for a, b in pairwise([*fit_starts, len(steps)]):
                if per_step[a:b] != side_by_side(generator_ranked(case, b - a)):
                    problems.append(f"steps {a}-{b}: other global batches than the generator's")
        return problems
    if case.streams:  # passes of one stream per fit, over the epochs' boundaries
        size = pass_steps(case)
        chunks = [(a + k, a + k + size) for a, b in pairwise([*fit_starts, len(steps)])
                  for k in range(0, b - a - size + 1, size)]  # fmt: skip
    else:
        chunks = spans
    for number, (a, b) in enumerate(chunks):
        seen = sum(per_step[a:b], Counter())
        fit = max(i for i, s in enumerate(fit_starts) if s <= a)
        epoch = sum(1 for s in epoch_starts if fit_starts[fit] <= s <= a) - 1  # of this fit
        if case.kind == "pydataset":
            ranked = pydataset_epoch(case, epoch)
            if ranked is None:
                continue  # see pydataset_epoch
            fixed = None if case.shuffle else side_by_side(ranked)
            counts = sum(side_by_side(ranked), Counter())
        else:
            order = None if case.streams else rank_batches(case)
            fixed = None if order is None else side_by_side(list(zip(*order, strict=True)))
            counts = pass_counts(case)
        if counts is not None and seen != counts:
            problems.append(f"pass {number} (steps {a}-{b}): {describe(seen, counts)}")
        elif counts is None:
            problems += [f"pass {number}: {p}" for p in drawn_problems(case, seen)]
        if fixed is not None and per_step[a:b] != fixed:
            problems.append(f"pass {number}: other global batches than the shares'")
    return problems


def side_by_side(steps: list[list[list[int]]]) -> list[Counter[int]]:
    """The global batches of the ranks' batches ``steps[step][rank]``."""
    return [Counter(i for rank in step for i in rank) for step in steps]


def pydataset_epoch(case: Case, epoch: int) -> list[list[list[int]]] | None:
    """Each rank's batches ``[step][rank] -> ids`` of epoch ``epoch`` of a ``fit`` on the
    reordering ``PyDataset``, as Keras asks for them in one process, with or without hvdkit:
    its ``on_epoch_end`` runs once before the first epoch (epoch ``e`` trains the order of
    ``e + 1`` reorders), and on the torch and JAX backends with workers each epoch starts one
    batch late (its first batch read for the shapes) and ends with the next order's first.
    Under fit's shuffle (each rank reorders its batches) the steps are in another order, and
    with the late start not known: ``None``."""
    late = bool(case.workers) and case.backend in ("torch", "jax")
    if late and case.shuffle:
        return None
    if not late:
        ranks = shares(case, epoch + 1)
        assert ranks is not None
    else:
        now, then = shares(case, epoch), shares(case, epoch + 1)
        assert now is not None and then is not None
        ranks = [rank[1:] + [then[r][0]] for r, rank in enumerate(now)]
    return [list(step) for step in zip(*ranks, strict=True)]


def expected_ranked(
    case: Case, epoch_starts: list[int], fit_starts: list[int], total: int
) -> list[list[list[list[int]]] | None]:
    """For each global step, the batches each rank may have trained ``[rank] -> [batch]``
    where the case fixes them and they may differ in size: a generator's (one each; any of
    the rank's share where it is finite), a ``PyDataset``'s (the step's, or where fit
    shuffles them, any of the rank's epoch's); else ``None``."""
    found: list[list[list[list[int]]] | None] = [None] * total
    if case.kind == "generator" and case.length == "forever":
        for a, b in pairwise([*fit_starts, total]):
            found[a:b] = [[[batch] for batch in step] for step in generator_ranked(case, b - a)]
    elif case.kind == "generator":
        # A finite one: each rank's items rank, rank + SIZE, ..., the short shares padded with
        # the first items; an epoch after it ran out replays what Keras peeked of it first.
        items = batches(list(range(case.samples)), case.batch)
        every = [[items[p] for p in wrapped(len(items), r)] for r in range(SIZE)]
        found = [every] * total
    elif case.kind == "pydataset":
        for a, b in pairwise([*epoch_starts, total]):
            fit = max(i for i, s in enumerate(fit_starts) if s <= a)
            epoch = sum(1 for s in epoch_starts if fit_starts[fit] <= s <= a) - 1
            ranked = pydataset_epoch(case, epoch)
            if ranked is None or len(ranked) != b - a:
                continue
            if case.shuffle:
                every = [[step[r] for step in ranked] for r in range(SIZE)]
                found[a:b] = [every] * (b - a)
            else:
                found[a:b] = [[[batch] for batch in step] for step in ranked]
    return found


def drawn_problems(case: Case, seen: Counter[int]) -> list[str]:
    """A pass drawn by a sampler: each of its rows once and fewer than ``SIZE`` repeats
    (padding); a weighted sampler's draws only rows of non-zero weight."""
    total = sum(seen.values())
    if case.kind == "loader" and case.sampler == "weighted":
        weights, draws = weighted(case)
        zero = sorted(i for i in seen if weights[i] == 0)
        want = math.ceil(draws / SIZE) * SIZE
        return ([f"rows of weight 0 drawn: {zero}"] if zero else []) + (
            [f"{total} draws, expected {want}"] if total != want else []
        )
    rows = held_in(case) if case.sampler == "subset" else list(range(train_rows(case)))
    missing = sorted(set(rows) - set(seen))
    extra = sorted(set(seen) - set(rows))
    repeats = total - len(set(seen))
    found = []
    if missing:
        found.append(f"samples never trained: {missing}")
    if extra:
        found.append(f"samples outside the sampler trained: {extra}")
    if repeats >= SIZE:
        found.append(f"{repeats} repeats, padding is fewer than {SIZE}")
    return found


def describe(seen: Counter[int], counts: Counter[int]) -> str:
    missing = sorted((counts - seen).elements())
    extra = sorted((seen - counts).elements())
    return f"missing {missing}, extra {extra}"
