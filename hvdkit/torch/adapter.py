"""The PyTorch implementation of the six-step hooks of :class:`hvdkit.core.Adapter`."""

from __future__ import annotations

import copy
import os
import pickle
import random
import time
import types
from pathlib import Path
from typing import Any, cast

import horovod.torch as hvd
import numpy as np
import torch

from hvdkit import envvars, preempt
from hvdkit.checkpoint import CheckpointError, atomic_write
from hvdkit.core import Adapter, SetupConfig, Topology
from hvdkit.devices import pin
from hvdkit.lr import Warmup
from hvdkit.position import Position
from hvdkit.torch import zero
from hvdkit.torch.bf16 import Compression
from hvdkit.torch.functions import (
    broadcast_optimizer_state,
    broadcast_parameters,
    broadcast_state_dict,
    init,
    load_optimizer_state_,
)
from hvdkit.torch.optimizer import DistributedOptimizer, reset_pending

FORMAT = "hvdkit-torch-1"
TORCH_EXTRA_TYPES: tuple[type, ...] = (type(None), bool, int, float, str, bytes, torch.Tensor)
"""What a torch checkpoint's ``extra`` can hold (``torch.load(weights_only=True)`` reads it)."""
_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSION = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


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
    EXTRA_TYPES = TORCH_EXTRA_TYPES
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
        self.position = Position()
        self.scaler: Any = None  # the AMP GradScaler the session steps with, once it has one
        self.scaler_state: dict[str, Any] | None = None  # a resumed one's, until it is given
        self.scheduler_state: dict[str, Any] | None = None  # likewise, for a later scheduler
        self.resumed_groups: list[dict[str, Any]] = []  # and the groups' LRs it set
        self.legacy_batches = 0  # a checkpoint from before positions: batches of its epoch
        self.resumed_optimizer: dict[str, Any] | None = None  # the root's, for sharded ranks

    # The position's counters under the names the hooks and the LR step use.
    step_count = property(
        lambda self: self.position.step, lambda self, v: setattr(self.position, "step", v)
    )
    epoch = property(
        lambda self: self.position.epoch, lambda self, v: setattr(self.position, "epoch", v)
    )

    def outside(self) -> list[torch.Tensor]:
        """The optimizer's parameters that are not the model's (a learnable loss weight, an
        ArcFace head kept apart), in the optimizer's order: hvdkit moves, broadcasts, checks
        and checkpoints them with the model's."""
        mine = {id(p) for p in self.model.parameters()}
        groups = self.optimizer.param_groups
        return [p for g in groups for p in g["params"] if id(p) not in mine]

    def named_outside(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"hvdkit.outside.{i}", p) for i, p in enumerate(self.outside())]

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
        with torch.no_grad():
            for p in self.outside():
                p.data = p.data.to(self.device)

    def _wrap_optimizer(self) -> None:
        cfg = self.config
        if cfg.shard_optimizer:
            self.optimizer = zero.ShardedOptimizer(
                self.optimizer, compression=_COMPRESSION[cfg.compression], op=_OPS[cfg.op],
                gradients=cfg.shard_optimizer == "gradients",
            )  # fmt: skip
            self.optimizer.backward_passes_per_step = cfg.backward_passes_per_step  # type: ignore[attr-defined]
        else:
            self.optimizer = DistributedOptimizer(
                self.optimizer,
                named_parameters=[*self.model.named_parameters(), *self.named_outside()],
                compression=_COMPRESSION[cfg.compression],
                backward_passes_per_step=cfg.backward_passes_per_step,
                op=_OPS[cfg.op],
            )
        if cfg.backward_passes_per_step > 1:
            inner_zero_grad = self.optimizer.zero_grad

            def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
                # The usual loop zeroes before every micro-batch; between the passes of one
                # step that would drop the gradients accumulated so far.
                if not self.position.micro_step:
                    inner_zero_grad(set_to_none)

            self.optimizer.zero_grad = types.MethodType(zero_grad, self.optimizer)  # type: ignore[method-assign]
            inner_model_zero_grad = self.model.zero_grad

            def model_zero_grad(set_to_none: bool = True) -> None:
                # model.zero_grad() in the loop, the other usual spelling, alike.
                if not self.position.micro_step:
                    inner_model_zero_grad(set_to_none)

            self.model.zero_grad = model_zero_grad  # type: ignore[method-assign]

    def _scale_lr(self, warmup: Warmup) -> None:
        inner_step = self.optimizer.step

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            # The multiplier is applied around the step only, so the user's scheduler keeps
            # seeing (and setting) single-process LRs and composes with the scaling. It is
            # read from self.warmup, which an elastic reset replaces.
            assert self.warmup is not None
            multiplier = self.warmup.multiplier(self.step_count)
            groups = self.optimizer.param_groups
            # At a multiplier of 1 (one rank, or no scaling) the LRs are left as they are.
            saved = [group["lr"] for group in groups] if multiplier != 1.0 else None
            if saved is not None:
                for group in groups:
                    group["lr"] = group["lr"] * multiplier
            try:
                return inner_step(*args, **kwargs)
            finally:
                if saved is not None:
                    for group, lr in zip(groups, saved, strict=True):
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
            _copy_outside(self.outside(), state.get("outside"))
            if self.config.shard_optimizer:  # its slice; the other ranks take theirs later
                self.optimizer.load_state_dict(state["optimizer"])
                self.resumed_optimizer = state["optimizer"]
            else:
                load_optimizer_state_(self.optimizer, state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as exc:
            # torch names every missing and unexpected key and each shape on lines of their
            # own: all of it is kept (a long list is cut, saying how much).
            detail = "\n    ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            if len(detail) > 4000:
                detail = f"{detail[:4000]} ... ({len(detail) - 4000} more characters)"
            raise CheckpointError(
                self.config.checkpoint or "",
                f"does not match this model/optimizer:\n    {detail}\n ",
                "resume with the same model and optimizer it was saved from, or delete it",
            ) from exc

    def _broadcast_state(self) -> None:
        broadcast_parameters(self.model.state_dict(), self.config.root_rank)
        broadcast_parameters(
            [(n, p.detach()) for n, p in self.named_outside()], self.config.root_rank
        )
        if self.config.elastic:
            self._take_trainable()
        if self.config.shard_optimizer:
            # Every rank keeps its slice of the root's whole state (None: nothing resumed),
            # cut for the world as it is now (after an elastic reset, a new one).
            resumed = broadcast_state_dict(
                self.resumed_optimizer, self.config.root_rank, "hvdkit.resumed"
            )
            if resumed is not None:
                self.optimizer.load_state_dict(resumed)
            if not self.config.elastic:
                self.resumed_optimizer = None
        else:
            broadcast_optimizer_state(self.optimizer, self.config.root_rank)

    def _take_trainable(self) -> None:
        """Rank 0's ``requires_grad`` on every parameter, before the optimizer state is cut to
        the trainable ones (ZeRO's buffers hold those only). A worker joining an elastic job
        runs the script from its top: a layer the script has unfrozen (or frozen) since is not
        yet so there, and the script's code need not do it again."""
        params = [*self.model.parameters(), *self.outside()]
        flags = self._broadcast_object([p.requires_grad for p in params])
        for p, trainable in zip(params, flags, strict=True):
            p.requires_grad_(trainable)

    def _resume_info(self, state: dict[str, Any]) -> dict[str, Any]:
        info = {k: state[k] for k in ("step", "epoch", "extra", "scheduler", "rng")}
        info["world_size"] = state.get("world_size")
        info["position"] = state.get("position")
        info["scaler"] = state.get("scaler")
        return info

    def _apply_resume_info(self, info: dict[str, Any]) -> dict[str, Any] | None:
        if info["position"] is not None:
            self.position.load_state_dict(info["position"])
        else:  # hvdkit before positions: epoch and step, and a preemption's batch count
            self.position.load_state_dict({"epoch": info["epoch"], "step": info["step"]})
            stopped = (info["extra"] or {}).get(preempt.EXTRA) or {}
            self.legacy_batches = int(stopped.get("batches", 0))
        self.scaler_state = info["scaler"]
        if self.scaler is not None and self.scaler_state is not None:
            self.take_scaler(self.scaler)
        # The root rank loaded it with the weights, where a mismatch is reported to every rank.
        if self.scheduler is not None and info["scheduler"] is not None and not self.is_root:
            self.scheduler.load_state_dict(info["scheduler"])
        if self.scheduler is None and info["scheduler"] is not None:
            self._keep_for_scheduler(info["scheduler"])
        if info["world_size"] == hvd.size():
            set_rng_state(info["rng"][hvd.rank()])
        extra: dict[str, Any] | None = info["extra"]
        return extra

    def _enter_save(self) -> None:
        handle = hvd.allreduce_async(torch.zeros(1), op=hvd.Sum, name="hvdkit.save.enter")
        limit = float(os.environ.get(envvars.SAVE_TIMEOUT, "120"))
        deadline = time.monotonic() + limit
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                assert self.topology is not None
                raise RuntimeError(
                    f"hvdkit: save() on rank {self.topology.rank} waited {limit:g} s for the "
                    "other ranks to save too. save() is collective: every rank calls it "
                    "(hvdkit writes the file on rank 0 only), so a save under `if hvd.rank() "
                    "== 0:` waits forever. Fix: call session.save() on every rank. (If the "
                    f"others are only slow to get there, raise {envvars.SAVE_TIMEOUT}.)"
                )
            time.sleep(0.01)
        hvd.synchronize(handle)

    def _gather_for_checkpoint(self, extra: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
        # A sharded optimizer's state_dict() gathers the slices: collective, so here.
        optimizer = self.optimizer.state_dict() if self.config.shard_optimizer else None
        return hvd.allgather_object(rng_state(), name="hvdkit.rng"), optimizer

    def _checkpoint_state(
        self, extra: dict[str, Any], next_epoch: int, gathered: Any
    ) -> dict[str, Any]:
        rng, optimizer = gathered
        position = self.position.state_dict()
        if next_epoch != self.position.epoch:  # the end of an epoch: the next one from its start
            position.update(epoch=next_epoch, samples=0)
        return {
            "format": FORMAT,
            "position": position,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "model": self.model.state_dict(),
            "outside": [p.detach() for p in self.outside()],
            "optimizer": optimizer if optimizer is not None else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.step_count,
            "epoch": next_epoch,
            "extra": extra,
            "rng": rng,
            "world_size": hvd.size(),
        }

    def _write_checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        return atomic_write(path, lambda fh: torch.save(state, fh))

    def _snapshot(self) -> dict[str, Any]:
        # In host memory: a commit on the GPU would hold a second copy of the model there.
        # A sharded optimizer's whole state on every rank: any of them may be the root after
        # a reset; gathered one tensor at a time into fresh host tensors, so not copied again.
        optimizer = (
            zero.state_everywhere(self.optimizer)
            if self.config.shard_optimizer
            else _on_host(self.optimizer.state_dict())
        )
        snapshot: dict[str, Any] = {
            **_on_host(
                {"model": self.model.state_dict(), "outside": [p.detach() for p in self.outside()]}
            ),
            "optimizer": optimizer,
        }
        if self.config.shard_optimizer:  # what rank 0 gives the others at the next sync
            self.resumed_optimizer = snapshot["optimizer"]
        return snapshot

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(snapshot)
        self.model.load_state_dict(snapshot["model"])
        _copy_outside(self.outside(), snapshot["outside"])
        # Into the existing param groups: an LR scheduler drives those dicts, and torch's
        # load_state_dict would replace them (the scheduler then sets an LR nothing uses).
        if self.config.shard_optimizer:  # re-cut for the world after the reset, at the sync
            self.resumed_optimizer = snapshot["optimizer"]
            return
        load_optimizer_state_(self.optimizer, snapshot["optimizer"])
        reset_pending(self.optimizer)

    def _position(self) -> dict[str, Any]:
        # The groups' hyperparameters beside the scheduler that sets them: a reset that keeps
        # the scheduler's state as it is keeps the LR it set with it.
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        groups = _hyperparameters(self.optimizer)
        return copy.deepcopy(
            {"position": self.position.state_dict(), "scheduler": scheduler, "groups": groups}
        )

    def _set_position(self, position: dict[str, Any]) -> None:
        position = copy.deepcopy(position)
        self.position.load_state_dict(position["position"])
        for group, saved in zip(self.optimizer.param_groups, position["groups"], strict=False):
            group.update(saved)
        if self.scheduler is not None and position["scheduler"] is not None:
            self.scheduler.load_state_dict(position["scheduler"])
        elif position["scheduler"] is not None:  # a joiner whose script builds it after setup
            self._keep_for_scheduler(position["scheduler"])

    def _keep_for_scheduler(self, state: dict[str, Any]) -> None:
        """A resumed (or joined) scheduler state for one the script builds after setup
        (:meth:`take_scheduler`); building it sets the groups' LR and momentum to its start,
        so the resumed ones are kept too."""
        self.scheduler_state = state
        self.resumed_groups = copy.deepcopy(_hyperparameters(self.optimizer))

    def take_scheduler(self, scheduler: Any) -> None:
        """An LR scheduler built after setup: saved in the checkpoints from now on, and given
        the resumed one's state (the same on every rank) if there is one."""
        self.scheduler = scheduler
        if scheduler is not None and self.scheduler_state is not None:
            scheduler.load_state_dict(self.scheduler_state)
            for group, saved in zip(self.optimizer.param_groups, self.resumed_groups, strict=True):
                group.update(saved)
            self.scheduler_state, self.resumed_groups = None, []

    def take_scaler(self, scaler: Any) -> None:
        """The AMP ``GradScaler`` the session steps with: saved in its checkpoints, and given
        the resumed one's state (loss scale, growth tracker) the first time."""
        self.scaler = scaler
        if self.scaler_state is not None:
            scaler.load_state_dict(self.scaler_state)
            self.scaler_state = None

    def _broadcast_object(self, obj: Any) -> Any:
        return hvd.broadcast_object(obj, self.config.root_rank, name="hvdkit.object")


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (LR, momentum, weight decay...) without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _on_host(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied into host memory (a module's
    ``state_dict`` keeps its type and version metadata)."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = type(value)((k, _on_host(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(value, list | tuple):
        return type(value)(_on_host(v) for v in value)
    return copy.deepcopy(value)


def _copy_outside(params: list[torch.Tensor], saved: list[torch.Tensor] | None) -> None:
    """Saved values of the parameters outside the model into them (a checkpoint from before
    they were saved has none: they keep their values)."""
    if saved is None:
        return
    shapes = [tuple(p.shape) for p in params]
    saved_shapes = [tuple(t.shape) for t in saved]
    if shapes != saved_shapes:
        raise ValueError(
            f"the optimizer's parameters outside the model have shapes {shapes}, the "
            f"checkpoint's {saved_shapes}"
        )
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)
