"""The six steps of data-parallel training with Horovod, in one place that owns their order.

Each framework adapter (``hvdkit.torch``, ``hvdkit.keras``) subclasses :class:`Adapter` and
implements only the ``_``-prefixed hooks; :meth:`Adapter.setup` runs them in this order:

1. ``_init`` Horovod, and learn the topology;
2. ``_pin_device``: one GPU per process by local rank (or the CPU);
3. ``_wrap_optimizer`` in Horovod's distributed optimizer;
4. resume: rank 0 reads the checkpoint (``_read_checkpoint``) if there is one;
5. ``_broadcast_state`` from rank 0, so every rank starts from identical weights (those of the
   checkpoint when resuming: no shared filesystem needed);
6. the LR scaled by world size with linear warmup (:mod:`hvdkit.lr`), applied by the adapter
   at each optimizer step (:meth:`Adapter.lr_multiplier`).

Saving is gated here as well: only rank 0 writes, atomically (:mod:`hvdkit.checkpoint`).
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdkit import rank_zero
from hvdkit.checkpoint import CheckpointError
from hvdkit.lr import LR_POLICIES, Warmup, scale_factor, warmup_steps

OPS = ("average", "sum", "adasum")
COMPRESSIONS = ("none", "fp16")


class RootRankError(RuntimeError):
    """Raised on the other ranks when rank 0 failed in a step they all take part in."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits: global and local rank and size."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int


def cores_per_process(processes: int) -> int:
    """This host's cores shared out among ``processes`` (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def threads_per_rank(topology: Topology) -> int:
    """CPU threads for one process: its share of this host's cores, so the ranks on a host do
    not all fight for every core."""
    return cores_per_process(topology.local_size)


def require_gpu_per_rank(topology: Topology, visible_gpus: int) -> None:
    """Raise when this host runs more processes than it has GPUs: NCCL refuses two ranks on
    one GPU, and sharing one would be slow anyway."""
    if topology.local_rank >= visible_gpus:
        raise RuntimeError(
            f"rank {topology.rank}: this host runs {topology.local_size} processes but only "
            f"{visible_gpus} GPU(s) are visible; one GPU per process is required. Fix: start at "
            f"most {visible_gpus} processes per host (slots in the hostfile / -np), or check "
            "CUDA_VISIBLE_DEVICES."
        )


@dataclass(frozen=True, kw_only=True)
class SetupConfig:
    """Options of the six steps, shared by every adapter.

    ``lr_scaling``: ``size`` (default), ``local_size`` (the usual choice with Adasum) or
    ``none``. Warmup goes from the single-process LR to the scaled one over ``warmup_epochs``
    (needs ``steps_per_epoch``) or ``warmup_steps``. ``checkpoint`` is a file path; with
    ``resume`` it is loaded on rank 0 and broadcast when it exists.
    """

    lr_scaling: str = "size"
    warmup_epochs: float = 0.0
    warmup_steps: int = 0
    steps_per_epoch: int | None = None
    op: str = "average"
    compression: str = "none"
    backward_passes_per_step: int = 1
    checkpoint: Path | None = None
    resume: bool = True
    root_rank: int = 0

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_POLICIES:
            raise ValueError(f"lr_scaling={self.lr_scaling!r}: use one of {LR_POLICIES}")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: use one of {OPS}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: use one of {COMPRESSIONS}")
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        # Validates the warmup arguments early, before any process starts talking.
        warmup_steps(
            epochs=self.warmup_epochs, steps=self.warmup_steps, steps_per_epoch=self.steps_per_epoch
        )


class Adapter(abc.ABC):
    """Template for a framework adapter: :meth:`setup` owns the six steps and their order."""

    def __init__(self, config: SetupConfig) -> None:
        self.config = config
        self.topology: Topology | None = None
        self.warmup: Warmup | None = None
        self.resumed: dict[str, Any] | None = None

    def setup(self) -> None:
        """Run the six steps. Afterwards ``topology``, ``warmup`` and ``resumed`` (the extra
        state of the checkpoint resumed from, or None) are set."""
        cfg = self.config
        self.topology = topo = self._init()
        rank_zero.set_rank(topo.rank)
        self._pin_device(topo)
        factor = scale_factor(cfg.lr_scaling, topo.size, topo.local_size)
        steps = warmup_steps(
            epochs=cfg.warmup_epochs, steps=cfg.warmup_steps, steps_per_epoch=cfg.steps_per_epoch
        )
        self.warmup = Warmup(factor=factor, steps=steps)
        self._wrap_optimizer()
        self.resume()

    def resume(self) -> dict[str, Any] | None:
        """Steps 4 and 5 (collective): rank 0 reads the checkpoint if there is one, then the
        state is broadcast from it. Returns the checkpoint's extra state (None when fresh)."""
        cfg = self.config
        if self.topology is None:  # joining a job initialised elsewhere (e.g. a fit callback)
            self.topology = self._init()
        state, error = None, None
        if cfg.resume and cfg.checkpoint is not None and self.topology.rank == cfg.root_rank:
            if Path(cfg.checkpoint).exists():
                try:
                    state = self._read_checkpoint(Path(cfg.checkpoint))
                except CheckpointError as exc:
                    error = exc
        self.raise_on_root_error(error)
        self.resumed = self._broadcast_state(state)
        return self.resumed

    def raise_on_root_error(self, error: Exception | None) -> None:
        """Collective: if rank 0 hit ``error``, raise it on every rank. Without this, rank 0
        would stop on a bad checkpoint while the others wait for it forever."""
        message = self._broadcast_object(str(error) if error is not None else None)
        if error is not None:
            raise error
        if message is not None:
            raise RootRankError(f"rank {self.config.root_rank} failed: {message}")

    def lr_multiplier(self, step: int) -> float:
        """The world-size LR multiplier for optimizer step ``step`` (after setup)."""
        assert self.warmup is not None, "call setup() first"
        return self.warmup.multiplier(step)

    def save_checkpoint(
        self, extra: dict[str, Any] | None = None, *, next_epoch: int = 0
    ) -> Path | None:
        """Collective: rank 0 writes the checkpoint atomically while the others wait, so no
        rank races ahead to read a file that is not there yet, and a failed write (disk
        full) stops every rank instead of leaving them waiting. Returns the path on rank 0."""
        if self.config.checkpoint is None:
            raise ValueError("no checkpoint path was configured: pass checkpoint=PATH to setup")
        state = self._gather_checkpoint_state(extra or {}, next_epoch)
        path, error = None, None
        if state is not None:
            try:
                path = self._write_checkpoint(Path(self.config.checkpoint), state)
            except OSError as exc:
                error = CheckpointError(
                    self.config.checkpoint,
                    f"cannot be written: {exc}",
                    "check free space and permissions of that directory",
                )
        self.raise_on_root_error(error)
        return path

    # Hooks, in the order setup() calls them.
    @abc.abstractmethod
    def _init(self) -> Topology:
        """Initialise Horovod; return the topology."""

    @abc.abstractmethod
    def _pin_device(self, topology: Topology) -> None:
        """Bind this process to one accelerator by local rank (or the CPU)."""

    @abc.abstractmethod
    def _wrap_optimizer(self) -> None:
        """Wrap the optimizer so gradients are reduced across ranks."""

    @abc.abstractmethod
    def _read_checkpoint(self, path: Path) -> dict[str, Any]:
        """Rank 0: load ``path``; raise CheckpointError naming the file when it is unusable."""

    @abc.abstractmethod
    def _broadcast_state(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Apply ``state`` (rank 0's checkpoint, None elsewhere or when fresh) and broadcast
        model and optimizer state from rank 0; return the checkpoint's extra state on every
        rank (None when not resuming)."""

    @abc.abstractmethod
    def _gather_checkpoint_state(
        self, extra: dict[str, Any], next_epoch: int
    ) -> dict[str, Any] | None:
        """Collective: everything to save, returned on rank 0 (None on the other ranks);
        resuming will start at ``next_epoch``."""

    @abc.abstractmethod
    def _write_checkpoint(self, path: Path, state: dict[str, Any]) -> Path:
        """Rank 0: write ``state`` to ``path`` atomically."""

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable values)."""
