"""The Keras 3 implementation of the six-step hooks of :class:`hvdkit.core.Adapter`, for both
backends (everything backend-specific goes through :mod:`hvdkit.keras.backend`).

Checkpoints are ``.npz`` archives of the model's and the optimizer's variables in order, with
a JSON header (format, epoch, world size, LR factor, the user's extra state). They hold no
pickles and load on either backend.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvdkit.checkpoint import CheckpointError, atomic_write
from hvdkit.compression import BF16Compressor
from hvdkit.core import Adapter, SetupConfig, Topology
from hvdkit.keras import backend
from hvdkit.keras.lr import LearningRateWarmupCallback, Schedule, WarmupSchedule, lr_holder
from hvdkit.keras.optimizer import DistributedOptimizer
from hvdkit.lr import Warmup

FORMAT = "hvdkit-keras-1"
GROUPS = ("model", "optimizer")


def _unnumbered(paths: list[str]) -> list[str]:
    """Variable paths without the numbers Keras appends to repeated names (``dense_3``,
    ``adam_1/sequential_1_dense_3_kernel_momentum``): the same model built twice in one process
    gets the same list."""
    return [re.sub(r"_\d+(?=[/_]|$)", "", p) for p in paths]


def forbid_xla(model: keras.Model) -> None:
    """On the TensorFlow backend, make ``model.compile`` use ``jit_compile=False``: Horovod's
    ops have no XLA kernels, and Keras turns XLA on by itself when a GPU is present."""
    if not backend.current().has_xla or getattr(model, "_hvdkit_no_xla", False):
        return
    inner = model.compile

    def compile(*args: Any, jit_compile: Any = "auto", **kwargs: Any) -> Any:  # noqa: A001
        if jit_compile is True:
            raise ValueError(
                "model.compile(jit_compile=True): Horovod's TensorFlow ops have no XLA kernels, "
                "so the training step cannot be compiled with XLA. Fix: leave jit_compile out "
                "(hvdkit sets it to False) or pass jit_compile=False."
            )
        return inner(*args, jit_compile=False, **kwargs)

    model.compile = compile
    model._hvdkit_no_xla = True
    if getattr(model, "compiled", False):
        model.jit_compile = False


class KerasAdapter(Adapter):
    """Six steps for a Keras 3 model and optimizer."""

    FORMAT = FORMAT
    FRAMEWORK = "Keras"
    MODULE = "hvdkit.keras"

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        config: SetupConfig,
    ) -> None:
        super().__init__(config)
        backend.require_keras3(optimizer)
        self.model = model
        self.optimizer = optimizer
        self.epoch = 0
        # fit() callbacks that step 6 needs (a float LR's warmup), for setup() to hand out.
        self.callbacks: list[keras.callbacks.Callback] = []

    def _init(self) -> Topology:
        return backend.init()

    def _pin_device(self, topology: Topology) -> None:
        backend.pin_device(topology)

    def _wrap_optimizer(self) -> None:
        cfg = self.config
        hvd = backend.horovod()
        self.optimizer = DistributedOptimizer(
            self.optimizer,
            compression={"fp16": hvd.Compression.fp16, "bf16": BF16Compressor}.get(cfg.compression),
            backward_passes_per_step=cfg.backward_passes_per_step,
            op=hvd.Sum if cfg.op == "sum" else hvd.Average,
        )
        forbid_xla(self.model)

    def _scale_lr(self, warmup: Warmup) -> None:
        factor, steps = warmup.factor, warmup.steps
        lr = lr_holder(self.optimizer)
        if isinstance(lr, Schedule):
            # Computed inside the compiled step: scaled, and ramped from 1x over the warmup.
            self.optimizer.learning_rate = WarmupSchedule(lr, steps, start=1 / factor, scale=factor)
        else:
            scaled = float(keras.ops.convert_to_numpy(self.optimizer.learning_rate)) * factor
            self.optimizer.learning_rate = scaled
            if steps:
                # A float LR stays settable (ReduceLROnPlateau): ramped batch by batch.
                self.callbacks.append(
                    LearningRateWarmupCallback(
                        scaled, warmup_steps=steps, start=1 / factor, offset=0
                    )
                )

    def _prepare_state(self) -> None:
        if not self.model.built or not self.model.variables:
            raise ValueError(
                "the model has no weights yet, so there is nothing to broadcast. Fix: give it an "
                "input shape (keras.Input(...) as its first layer, or model.build(shape)) "
                "before hvdkit.keras.setup / resume."
            )
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def _variables(self) -> dict[str, list[keras.Variable]]:
        backend.write_back(self.model)  # a checkpoint in mid-epoch reads the live values
        return {"model": list(self.model.variables), "optimizer": list(self.optimizer.variables)}

    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            meta = json.loads(bytes(arrays.pop("meta")).decode())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise CheckpointError(
                path,
                f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "it is corrupt or not an hvdkit Keras checkpoint: delete it to start fresh, or "
                "pass another path",
            ) from exc
        found = meta.get("format") if isinstance(meta, dict) else None
        return {"format": found, "meta": meta, "arrays": arrays}

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        """Assign the checkpoint's values by variable path, after checking that every path is
        there with its shape (a checkpoint from before paths: by position, shapes checked)."""
        meta, arrays, path = state["meta"], state["arrays"], self.config.checkpoint or ""
        variables = self._variables()
        plan = [
            (variable, arrays[key])
            for group in GROUPS
            for variable, key in self._match(group, meta, variables[group], arrays, path)
        ]
        for variable, value in plan:
            variable.assign(value)
        lr = lr_holder(self.optimizer)
        if isinstance(lr, keras.Variable) and self.warmup is not None:
            # Saved at another world size: keep the user's LR, rescaled to this one.
            lr.assign(lr * (self.warmup.factor / meta["lr_factor"]))

    @staticmethod
    def _match(
        group: str, meta: dict[str, Any], mine: list[keras.Variable], arrays: dict, path: Any
    ) -> list[tuple[keras.Variable, str]]:
        """Each of ``mine`` with the checkpoint array it gets; CheckpointError naming every
        missing, extra and reshaped variable when they do not fit."""
        fix = "resume with the model and optimizer it was saved from, or delete it"
        count = meta["counts"][group]
        saved_paths = meta.get("paths", {}).get(group)
        paths = [v.path for v in mine]
        if saved_paths is None or len(set(paths)) != len(paths):
            if count != len(mine):  # by position: a checkpoint from before paths
                raise CheckpointError(
                    path, f"holds {count} {group} variables, this {group} has {len(mine)}", fix
                )
            pairs = [(v, f"{group}.{i}") for i, v in enumerate(mine)]
        else:
            index = {p: i for i, p in enumerate(saved_paths)}
            missing = [p for p in paths if p not in index]
            extra = [p for p in saved_paths if p not in set(paths)]
            if (
                (missing or extra)
                and _unnumbered(paths) == _unnumbered(saved_paths)
                and all(index.get(p, i) == i for i, p in enumerate(paths))
            ):
                # The same layers built again in one process (a notebook's second run):
                # Keras numbered their names on, so the paths differ only in those numbers.
                # A path on both sides must sit at the same place: numbered blocks with one
                # removed and one added are another model, not renamed layers.
                index = {p: i for i, p in enumerate(paths)}
                missing = extra = []
            if missing or extra:
                raise CheckpointError(
                    path,
                    f"{group} variables differ: not in the checkpoint: {missing or 'none'}; "
                    f"only in the checkpoint: {extra or 'none'}",
                    f"{fix} (variables are matched by path: a renamed or added layer does not "
                    "receive another layer's weights)",
                )
            pairs = [(v, f"{group}.{index[v.path]}") for v in mine]
        reshaped = [
            f"{v.path}: {tuple(v.shape)} here, {arrays[key].shape} in the checkpoint"
            for v, key in pairs
            if tuple(v.shape) != arrays[key].shape
        ]
        if reshaped:
            raise CheckpointError(path, f"{group} variables have other shapes: {reshaped}", fix)
        return pairs

    def _broadcast_state(self) -> None:
        variables = self._variables()
        backend.broadcast_variables(variables["model"] + variables["optimizer"])

    def _resume_info(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"epoch": state["meta"]["epoch"], "extra": state["meta"]["extra"]}

    def _apply_resume_info(self, info: dict[str, Any]) -> dict[str, Any] | None:
        self.epoch = info["epoch"]
        extra: dict[str, Any] | None = info["extra"]
        return extra

    def _gather_for_checkpoint(self, extra: dict[str, Any]) -> None:
        try:
            json.dumps(extra)
        except TypeError as exc:  # on every rank, before rank 0 could fail alone
            raise TypeError(f"checkpoint extra state must be JSON values: {exc}") from None

    def _checkpoint_state(
        self, extra: dict[str, Any], next_epoch: int, gathered: Any
    ) -> dict[str, Any]:
        assert self.topology is not None
        arrays, counts, paths = {}, {}, {}
        for group, variables in self._variables().items():
            counts[group] = len(variables)
            paths[group] = [v.path for v in variables]
            for i, variable in enumerate(variables):
                arrays[f"{group}.{i}"] = keras.ops.convert_to_numpy(variable.value)
        meta = {
            "format": FORMAT,
            "epoch": next_epoch,
            "extra": extra,
            "counts": counts,
            "paths": paths,
            "world_size": self.topology.size,
            "lr_factor": self.warmup.factor if self.warmup is not None else 1.0,
        }
        return {"meta": meta, "arrays": arrays}

    def _write_checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        header = np.frombuffer(json.dumps(state["meta"]).encode(), dtype=np.uint8)
        return atomic_write(path, lambda fh: np.savez(fh, meta=header, **state["arrays"]))

    def _rescale_lr(self, old: Warmup, new: Warmup) -> None:
        ratio = new.factor / old.factor
        lr = lr_holder(self.optimizer)
        if isinstance(lr, WarmupSchedule):  # traced again: the session drops the compiled step
            lr.scale, lr.start = new.factor, 1 / new.factor
        elif isinstance(lr, keras.Variable):
            lr.assign(lr * ratio)
        for callback in self.callbacks:
            if isinstance(callback, LearningRateWarmupCallback) and callback.initial_lr:
                callback.initial_lr *= ratio
                callback.start = 1 / new.factor

    def _snapshot(self) -> list[np.ndarray]:
        return [
            np.array(keras.ops.convert_to_numpy(v.value))
            for group in self._variables().values()
            for v in group
        ]

    def _restore_snapshot(self, snapshot: list[np.ndarray]) -> None:
        variables = [v for group in self._variables().values() for v in group]
        for variable, value in zip(variables, snapshot, strict=True):
            variable.assign(value)

    def _position(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def _set_position(self, position: dict[str, Any]) -> None:
        self.epoch = position["epoch"]

    def _broadcast_object(self, obj: Any) -> Any:
        return backend.broadcast_object(obj, self.config.root_rank)
