"""The PyTorch implementation of the six-step hooks of :class:`hvdkit.core.Adapter`."""

from __future__ import annotations

import copy
import pickle
import random
import types
from pathlib import Path
from typing import Any, cast

import horovod.torch as hvd
import numpy as np
import torch

from hvdkit.checkpoint import CheckpointError, atomic_write
from hvdkit.core import Adapter, SetupConfig, Topology
from hvdkit.devices import pin
from hvdkit.lr import Warmup
from hvdkit.torch.functions import (
    broadcast_optimizer_state,
    broadcast_parameters,
    init,
    load_optimizer_state_,
)
from hvdkit.torch.optimizer import DistributedOptimizer

FORMAT = "hvdkit-torch-1"
_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, gauss = state
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


class TorchAdapter(Adapter):
    """Six steps for a ``torch.nn.Module`` and ``torch.optim.Optimizer``."""

    FORMAT = FORMAT
    FRAMEWORK = "PyTorch"
    MODULE = "hvdkit.torch"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: SetupConfig,
        scheduler: Any = None,
    ) -> None:
        super().__init__(config)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = torch.device("cpu")
        self.step_count = 0
        self.epoch = 0

    def _init(self) -> Topology:
        init()
        return Topology.of(hvd)

    def _pin_device(self, topology: Topology) -> None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nccl = bool(hvd.nccl_built())
        index = pin(topology, gpus, torch.cuda.set_device, torch.set_num_threads, nccl=nccl)
        if index is not None:
            self.device = torch.device("cuda", index)
        self.model.to(self.device)

    def _wrap_optimizer(self) -> None:
        cfg = self.config
        self.optimizer = DistributedOptimizer(
            self.optimizer,
            named_parameters=self.model.named_parameters(),
            compression=_COMPRESSION[cfg.compression],
            backward_passes_per_step=cfg.backward_passes_per_step,
            op=_OPS[cfg.op],
        )

    def _scale_lr(self, warmup: Warmup) -> None:
        inner_step = self.optimizer.step

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            # The multiplier is applied around the step only, so the user's scheduler keeps
            # seeing (and setting) single-process LRs and composes with the scaling. It is
            # read from self.warmup, which an elastic reset replaces.
            assert self.warmup is not None
            multiplier = self.warmup.multiplier(self.step_count)
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * multiplier
            try:
                return inner_step(*args, **kwargs)
            finally:
                for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    group["lr"] = lr
                self.step_count += 1

        # A bound method, this instance's only: an LR scheduler made on it later wraps
        # `step.__func__` (torch's check that the optimizer stepped first), which a plain
        # function lacks.
        self.optimizer.step = types.MethodType(step, self.optimizer)  # type: ignore[method-assign]

    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(
                path,
                f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "it is corrupt or not an hvdkit checkpoint: delete it to start fresh, or "
                "pass another path",
            ) from exc
        return state

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            load_optimizer_state_(self.optimizer, state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                self.config.checkpoint or "",
                f"does not match this model/optimizer: {str(exc).splitlines()[0][:300]}",
                "resume with the same model and optimizer it was saved from, or delete it",
            ) from exc

    def _broadcast_state(self) -> None:
        broadcast_parameters(self.model.state_dict(), self.config.root_rank)
        broadcast_optimizer_state(self.optimizer, self.config.root_rank)

    def _resume_info(self, state: dict[str, Any]) -> dict[str, Any]:
        info = {k: state[k] for k in ("step", "epoch", "extra", "scheduler", "rng")}
        info["world_size"] = state.get("world_size")
        return info

    def _apply_resume_info(self, info: dict[str, Any]) -> dict[str, Any] | None:
        self.step_count, self.epoch = info["step"], info["epoch"]
        # The root rank loaded it with the weights, where a mismatch is reported to every rank.
        if self.scheduler is not None and info["scheduler"] is not None and not self.is_root:
            self.scheduler.load_state_dict(info["scheduler"])
        if info["world_size"] == hvd.size():
            set_rng_state(info["rng"][hvd.rank()])
        extra: dict[str, Any] | None = info["extra"]
        return extra

    def _gather_for_checkpoint(self, extra: dict[str, Any]) -> list[dict[str, Any]]:
        return hvd.allgather_object(rng_state(), name="hvdkit.rng")

    def _checkpoint_state(
        self, extra: dict[str, Any], next_epoch: int, gathered: Any
    ) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.step_count,
            "epoch": next_epoch,
            "extra": extra,
            "rng": gathered,
            "world_size": hvd.size(),
        }

    def _write_checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        return atomic_write(path, lambda fh: torch.save(state, fh))

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        )

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(snapshot)
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])  # also drops pending allreduces

    def _position(self) -> dict[str, Any]:
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return copy.deepcopy({"epoch": self.epoch, "step": self.step_count, "scheduler": scheduler})

    def _set_position(self, position: dict[str, Any]) -> None:
        position = copy.deepcopy(position)
        self.epoch, self.step_count = position["epoch"], position["step"]
        if self.scheduler is not None and position["scheduler"] is not None:
            self.scheduler.load_state_dict(position["scheduler"])

    def _broadcast_object(self, obj: Any) -> Any:
        return hvd.broadcast_object(obj, self.config.root_rank, name="hvdkit.object")
