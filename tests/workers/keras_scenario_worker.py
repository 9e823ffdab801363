"""Runs tests/keras_scenarios.py's cases of one Keras backend (``KERAS_BACKEND``), one after the
other, in one multi-rank job: each case a user's script (``setup``, ``compile``,
``session.fit`` on the case's input, a resume from the checkpoint in a new ``setup``), each
rank keeping a ledger of the sample ids of each step, read off the model's first layer.

Usage: ``hvdkit run -np 2 -- python keras_scenario_worker.py CASES.json WORKDIR``, CASES a list
of ``{"id": ..., "case": {...}}``. Each rank prints one ``CASE {...}`` line a case. A case that
raises prints its error and ends the job (the other ranks may wait in a collective for it):
the cases after it are not run.

``python keras_scenario_worker.py --oracle ORACLES.json`` (one process, no Horovod) prints one
``ORACLE {...}`` line for each ``{"id", "case", "start", "steps"}``: :func:`oracle`'s result.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the grammar
from case_loop import run_items  # beside this file
from keras_scenarios import (
    ARRAYS,
    FEATURES,
    SPLIT,
    Case,
    batches,
    build,
    data,
    held_in,
    inputs_of,
    make_optimizer,
    oracle,
    pydataset_order,
    trainable,
    weighted,
)  # fmt: skip


class Book(keras.callbacks.Callback):
    """The ids of each step, read off the ledger layer, and where each epoch began."""

    def __init__(self, ledger: Any, record: dict[str, Any]) -> None:
        super().__init__()
        self.ledger, self.record = ledger, record

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.record["epoch_starts"].append(len(self.record["steps"]))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        _ = self.model  # on JAX, Keras puts the step's state back on the model when asked
        counts = np.rint(keras.ops.convert_to_numpy(self.ledger.seen)).astype(int)
        self.record["steps"].append(np.repeat(np.arange(len(counts)), counts).tolist())


class Rows(keras.utils.PyDataset):
    """Batches of ``batch`` rows, in an order the dataset changes in ``on_epoch_end`` (as a
    user's ``PyDataset`` shuffles its indices, with a seeded generator)."""

    def __init__(self, case: Case, d: dict[str, np.ndarray], **loading: Any) -> None:
        super().__init__(**loading)
        self.case, self.x, self.y = case, d["x"], d["y"]
        self.reorders, self.order = 0, list(range(len(self.x)))

    def __len__(self) -> int:
        return len(batches(self.order, self.case.batch))

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rows = batches(self.order, self.case.batch)[index]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self) -> None:
        self.reorders += 1
        self.order = pydataset_order(len(self.x), self.reorders)


def fit_input(case: Case, d: dict[str, np.ndarray]) -> tuple[Any, Any, dict[str, Any]]:
    """``session.fit``'s ``x``, ``y`` and keyword arguments, as the user's script gives them."""
    b, n = case.batch, case.samples
    given: dict[str, Any] = {}
    if case.validation == "data":
        given["validation_data"] = (inputs_of(case, d["vx"]), d["vy"])
    elif case.validation == "dataset":
        import tensorflow as tf

        inputs = inputs_of(case, d["vx"])
        inputs = tuple(inputs) if isinstance(inputs, list) else inputs  # two inputs, not one
        rows = tf.data.Dataset.from_tensor_slices((inputs, d["vy"]))
        given["validation_data"] = rows.batch(case.batch)
    elif case.validation == "split":
        given["validation_split"] = SPLIT
    if case.steps_per_epoch:
        given["steps_per_epoch"] = case.steps_per_epoch
    if case.kind in ARRAYS:
        if case.sample_weight:
            given["sample_weight"] = d["w"]
        return inputs_of(case, d["x"]), d["y"], {**given, "batch_size": b, "shuffle": case.shuffle}
    if case.kind == "tf.data":
        return tf_dataset(case, d), None, given
    if case.kind == "pydataset":
        loading = {"workers": case.workers, "use_multiprocessing": case.processes}
        given["shuffle"] = case.shuffle  # Keras's: the order of the batches
        return Rows(case, d), None, {**given, **(loading if case.workers else {})}
    if case.kind in ("loader", "torch-dataset"):
        import torch
        from torch.utils.data import (
            DataLoader,
            SubsetRandomSampler,
            TensorDataset,
            WeightedRandomSampler,
        )

        rows = TensorDataset(torch.from_numpy(d["x"]), torch.from_numpy(d["y"]))
        if case.kind == "torch-dataset":
            return rows, None, {**given, "batch_size": b, "shuffle": case.shuffle}
        options: dict[str, Any] = {"batch_size": b, "num_workers": case.workers}
        if case.sampler == "subset":
            options["sampler"] = SubsetRandomSampler(held_in(case))
        elif case.sampler == "weighted":
            weights, draws = weighted(case)
            options["sampler"] = WeightedRandomSampler(torch.tensor(weights), draws)
        else:
            options["shuffle"] = case.shuffle
        return DataLoader(rows, **options), None, given

    def generator():
        mine = batches(list(range(n)), b)
        while True:
            for rows in mine:
                yield d["x"][rows], d["y"][rows]
            if case.length == "finite":
                return

    return generator(), None, given


def tf_dataset(case: Case, d: dict[str, np.ndarray]) -> Any:
    import tensorflow as tf

    parts = (d["x"], d["y"], d["w"]) if case.sample_weight else (d["x"], d["y"])
    rows = tf.data.Dataset.from_tensor_slices(parts)
    if case.tf_map == "plain":
        rows = rows.map(lambda a, *rest: (a * 1.0, *rest))
    elif case.tf_map == "py_function":

        def same(a):
            return tf.ensure_shape(tf.py_function(lambda v: v, [a], tf.float32), (FEATURES + 1,))

        rows = rows.map(lambda a, *rest: (same(a), *rest))
    if case.length == "unknown":
        rows = rows.filter(lambda a, *rest: a[0] >= 0)  # keeps every row; TF cannot know
    if case.shuffle:
        tf.random.set_seed(None)  # build()'s seed cleared: each process its own, as unseeded
        rows = rows.shuffle(case.samples)
    rows = rows.batch(case.batch)
    return rows.repeat() if case.length == "forever" else rows


def run_case(case: Case, where: Path) -> dict[str, Any]:
    """One case: its fit, or its first epoch and a new ``setup`` resuming from the
    checkpoint for the rest; the ledger, the start and end weights, the last val_loss."""
    import hvdkit.keras as hvd
    from hvdkit.keras import backend

    record: dict[str, Any] = {"steps": [], "epoch_starts": [], "fit_starts": []}
    d = data(case)
    checkpoint = where / "ckpt.npz" if case.resume else None
    if checkpoint is not None and checkpoint.exists() and hvd.rank() == 0:
        checkpoint.unlink()
    backend.horovod().allgather_object(0, name="scenario.fresh")  # after rank 0 removed it
    history = None
    for number, epochs in enumerate([1, case.epochs] if case.resume else [case.epochs]):
        model, ledger = build(case)
        session = hvd.setup(model, make_optimizer(case), lr_scaling=case.lr_scaling,
                            checkpoint=checkpoint)  # fmt: skip
        if number == 0:
            record["start"] = trainable(model)
        elif session.epoch != 1:
            raise AssertionError(f"resumed at epoch {session.epoch}, saved after epoch 1")
        model.compile(optimizer=session.optimizer, loss="mse")
        x, y, given = fit_input(case, d)
        record["fit_starts"].append(len(record["steps"]))
        history = session.fit(x, y, epochs=epochs, verbose=0, callbacks=[Book(ledger, record)],
                              **given)  # fmt: skip
    assert history is not None
    record["weights"] = trainable(model)
    record["val_loss"] = history.history.get("val_loss", [None])[-1]
    return record


def main() -> None:
    if sys.argv[1] == "--oracle":
        for item in json.loads(Path(sys.argv[2]).read_text()):
            try:
                result = oracle(Case(**item["case"]), item["start"], item["steps"],
                                item.get("epoch_starts", []))  # fmt: skip
            except Exception:  # noqa: BLE001 - reported per case
                result = {"error": traceback.format_exc()[-1200:]}
            print("ORACLE " + json.dumps({**result, "case": item["id"]}), flush=True)
        return
    import hvdkit.keras as hvd

    items = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    hvd.init()
    run_items(items, workdir, hvd.rank(), lambda item, where: run_case(Case(**item["case"]), where))


if __name__ == "__main__":
    main()
