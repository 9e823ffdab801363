"""The six steps of data-parallel training with Horovod, in one place that owns their order.

The steps, numbered as in the docs (docs/index.md) and the examples:

1. init Horovod, and learn where this process sits (:class:`Topology`);
2. pin one GPU per process by local rank (on a CPU: a share of the cores);
3. wrap the optimizer in Horovod's distributed optimizer;
4. broadcast the initial state (model and optimizer) from rank 0;
5. checkpoint on rank 0 only, atomically, and resume by reading the checkpoint on rank 0 and
   broadcasting it (step 4 carries it: no shared filesystem needed);
6. scale the LR by world size, with linear warmup (:mod:`hvdkit.lr`).

Each framework adapter (``hvdkit.torch``, ``hvdkit.keras``) subclasses :class:`Adapter` and
implements only the ``_``-prefixed hooks. :meth:`Adapter.setup` runs them in the order
1, 2, 3, 6, 5, 4: the LR is scaled (6) before resuming (5), because a checkpoint saved at
another world size is rescaled to this one, and the broadcast (4) comes last so that it carries
what rank 0 resumed. :meth:`Adapter.save_checkpoint` is step 5's other half: the rank-0 gate,
the atomic write and the error every rank sees live here, the format in the adapter.

"The LR" means the same in both adapters: the single-process LR the user gives the optimizer
(and any schedule computes); hvdkit multiplies it by the warmup multiplier. Where the
multiplied value lives differs by framework: PyTorch's ``param_groups`` keep the user's LR and
the multiplier is applied around each step (so LR schedulers keep composing); Keras's optimizer
holds the multiplied LR (a schedule is wrapped so that it is computed inside the compiled
step), so Keras callbacks such as ``ReduceLROnPlateau`` act on the LR in force.

Where this differs from STYLE.md's examples: the facades' ``setup()`` take their options as
keywords typed by :class:`SetupOptions` (``Unpack``), not a config object the caller builds,
because Horovod scripts pass plain keywords; :class:`SetupConfig` is still the one typed,
validated dataclass behind them. The elastic half of the template lives in
:mod:`hvdkit.elastic`, which calls the hooks from outside the class (its docstring says why).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypedDict, get_args

from hvdkit import preempt, rank_zero
from hvdkit.checkpoint import CheckpointError, plain_extra
from hvdkit.lr import LR_POLICIES, LrScaling, Warmup, scale_factor, warmup_steps

ReduceOp = Literal["average", "sum", "adasum"]
CompressionName = Literal["none", "fp16", "bf16"]
OPS: tuple[str, ...] = get_args(ReduceOp)
COMPRESSIONS: tuple[str, ...] = get_args(CompressionName)


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

    @classmethod
    def of(cls, hvd: Any) -> Topology:
        """The topology an initialised Horovod module (any framework's) reports."""
        return cls(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank())


@dataclass(frozen=True, kw_only=True)
class SetupConfig:
    """Options of the six steps, shared by every adapter.

    ``lr_scaling``: ``size`` (default), ``local_size`` (the usual choice with Adasum) or
    ``none``. Warmup goes from the single-process LR to the scaled one over ``warmup_epochs``
    (needs ``steps_per_epoch``) or ``warmup_steps``. ``checkpoint`` is a file path; with
    ``resume`` it is loaded on rank 0 and broadcast when it exists. ``elastic`` makes the
    session survive lost and added workers (``hvdkit run --min-np``), committing its state in
    memory every ``commit_every`` optimizer steps and at each epoch end.
    ``shard_optimizer=True`` (torch only): ZeRO stage 1, each rank
    keeps the optimizer state of its slice of the parameters (:mod:`hvdkit.torch.zero`);
    ``shard_optimizer="gradients"``: stage 2, the gradients too.
    """

    lr_scaling: LrScaling = "size"
    warmup_epochs: float = 0.0
    warmup_steps: int = 0
    steps_per_epoch: int | None = None
    op: ReduceOp = "average"
    compression: CompressionName = "none"
    backward_passes_per_step: int = 1
    checkpoint: Path | None = None
    resume: bool = True
    root_rank: int = 0
    elastic: bool = False
    commit_every: int = 10
    shard_optimizer: bool | Literal["gradients"] = False

    def __post_init__(self) -> None:
        if self.shard_optimizer not in (False, True, "gradients"):
            raise ValueError(
                f"shard_optimizer={self.shard_optimizer!r}: use False, True (ZeRO stage 1: "
                "the optimizer state) or 'gradients' (stage 2: the gradients too)"
            )
        if self.lr_scaling not in LR_POLICIES:
            raise ValueError(f"lr_scaling={self.lr_scaling!r}: use one of {LR_POLICIES}")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: use one of {OPS}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: use one of {COMPRESSIONS}")
        if self.op == "adasum":
            # Horovod's Adasum optimizer cannot skip its own synchronization, which the
            # session's backward/reduce/clip/step order needs (the first step failed inside
            # Horovod: "Skipping synchronization is not supported when using Adasum").
            raise ValueError(
                "op='adasum' is not supported by setup(): its step order (reduce, clip, step) "
                "needs a synchronization Adasum cannot skip. Fix: use op='average', or wrap "
                "the optimizer yourself as Horovod does: DistributedOptimizer(optimizer, "
                "op=hvd.Adasum)"
            )
        if self.op == "sum" and self.lr_scaling == "size":
            raise ValueError(
                "op='sum' with lr_scaling='size': the summed gradient is already the number "
                "of ranks times the average, and the LR would be multiplied by it once more "
                "(a step N times too large). Fix: pass lr_scaling='none' with op='sum', or "
                "use op='average' (the default)"
            )
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if self.commit_every < 1:
            raise ValueError(f"commit_every={self.commit_every}: commit every 1 step or more")
        if self.elastic and self.root_rank != 0:
            raise ValueError(
                "elastic=True needs root_rank=0: after a reset, rank 0 holds the state"
            )
        # Validates the warmup arguments early, before any process starts talking.
        warmup_steps(
            epochs=self.warmup_epochs, steps=self.warmup_steps, steps_per_epoch=self.steps_per_epoch
        )


class SetupOptions(TypedDict, total=False):
    """The options both facades' ``setup()`` take as keywords: :class:`SetupConfig`'s fields
    but ``checkpoint``, which the facades take as a path of any kind. A TypedDict and not the
    dataclass itself (STYLE.md's typed configs): scripts pass plain keywords, as Horovod's do,
    and a type checker still checks each one through ``Unpack``."""

    lr_scaling: LrScaling
    warmup_epochs: float
    warmup_steps: int
    steps_per_epoch: int | None
    op: ReduceOp
    compression: CompressionName
    backward_passes_per_step: int
    resume: bool
    root_rank: int
    elastic: bool
    commit_every: int
    shard_optimizer: bool | Literal["gradients"]


def start(init: Callable[[], Topology], pin_device: Callable[[Topology], None]) -> Topology:
    """Steps 1 and 2: ``init`` Horovod, tell :mod:`hvdkit.rank_zero` the rank, ``pin_device``.
    The one way into them, for :meth:`Adapter.setup` and for ``hvdkit.keras.init``."""
    topology = init()
    rank_zero.set_rank(topology.rank)
    pin_device(topology)
    return topology


def restart(hvd: Any) -> Topology:
    """An elastic reset's step 1: Horovod shut down and initialised again at the new world
    size, through :func:`start`. Step 2 is not run again: the process keeps the device its
    model and optimizer live on (a survivor's local rank may change; its GPU does not)."""

    def init() -> Topology:
        hvd.shutdown()
        hvd.init()
        return Topology.of(hvd)

    return start(init, lambda topology: None)


class Adapter(abc.ABC):
    """Template for a framework adapter: :meth:`setup` owns the six steps and their order.

    ``FORMAT`` names the checkpoints the adapter writes (checked on resume, here);
    ``FRAMEWORK`` and ``MODULE`` name them in messages; ``EXTRA_TYPES`` are the values a
    checkpoint's ``extra`` can hold (:func:`hvdkit.checkpoint.plain_extra` checks them when
    saving)."""

    FORMAT: ClassVar[str]
    FRAMEWORK: ClassVar[str]
    MODULE: ClassVar[str]
    EXTRA_TYPES: ClassVar[tuple[type, ...]] = (type(None), bool, int, float, str)

    def __init__(self, config: SetupConfig) -> None:
        self.config = config
        self.topology: Topology | None = None
        self.warmup: Warmup | None = None
        self.resumed: dict[str, Any] | None = None
        self.preempted_at: dict[str, Any] | None = None  # a preempted run's position

    @property
    def is_root(self) -> bool:
        """Whether this process is the root rank (the one that reads and writes checkpoints)."""
        assert self.topology is not None, "call setup() first"
        return self.topology.rank == self.config.root_rank

    def setup(self, *, resume_only: bool = False) -> None:
        """Run the six steps (see the module docstring for their order). Afterwards
        ``topology``, ``warmup`` and ``resumed`` (the extra state of the checkpoint resumed
        from, or None) are set.

        ``resume_only``: steps 1, 5 and 4 only, for a callback joining a script that did the
        rest itself (Horovod initialised, device pinned, optimizer wrapped, LR chosen)."""
        cfg = self.config
        if resume_only:
            self.topology = self._init()
        else:
            self.topology = start(self._init, self._pin_device)
            self._wrap_optimizer()
            factor = scale_factor(cfg.lr_scaling, self.topology.size, self.topology.local_size)
            steps = warmup_steps(
                epochs=cfg.warmup_epochs,
                steps=cfg.warmup_steps,
                steps_per_epoch=cfg.steps_per_epoch,
            )
            self.warmup = Warmup(factor=factor, steps=steps)
            self._scale_lr(self.warmup)
        self._resume()

    def _resume(self, *, read_checkpoint: bool = True) -> None:
        """Steps 5 and 4 (collective): rank 0 reads and applies the checkpoint if there is one,
        then model and optimizer are broadcast from it, then what else it resumed. An elastic
        reset runs it again with ``read_checkpoint=False``: the same collectives as a joining
        worker's ``setup()``, with rank 0's state in memory in place of the file."""
        cfg = self.config
        self._prepare_state()
        state, error = None, None
        if read_checkpoint and cfg.resume and cfg.checkpoint is not None and self.is_root:
            path = Path(cfg.checkpoint)
            if path.exists():
                try:
                    state = self._read_checkpoint(path)
                    self._check_format(path, state)
                    self._load_checkpoint(state)
                except CheckpointError as exc:
                    error = exc
        self._raise_on_root_error(error)
        self._broadcast_state()
        info = self._broadcast_object(self._resume_info(state) if state is not None else None)
        resumed = None if info is None else self._apply_resume_info(info)
        self.resumed, self.preempted_at = preempt.split_extra(resumed)

    def rescale(self, topology: Topology) -> None:
        """After an elastic reset: take the new ``topology`` and scale the LR to its size (the
        same rule as at setup; a warmup in progress goes on at its step, towards the new
        factor)."""
        cfg = self.config
        assert self.warmup is not None, "call setup() first"
        old, self.topology = self.warmup, topology
        factor = scale_factor(cfg.lr_scaling, topology.size, topology.local_size)
        self.warmup = Warmup(factor=factor, steps=old.steps)
        self._rescale_lr(old, self.warmup)

    def _check_format(self, path: Path, state: Any) -> None:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        if found != self.FORMAT:
            raise CheckpointError(
                path,
                f"is not an hvdkit {self.FRAMEWORK} checkpoint (format {found!r}, expected "
                f"{self.FORMAT!r})",
                f"pass a checkpoint written by {self.MODULE}, or delete it to start fresh",
            )

    def _raise_on_root_error(self, error: Exception | None) -> None:
        """Collective: if rank 0 hit ``error``, raise it on every rank. Without this, rank 0
        would stop on a bad checkpoint while the others wait for it forever."""
        message = self._broadcast_object(str(error) if error is not None else None)
        if error is not None:
            raise error
        if message is not None:
            raise RootRankError(f"rank {self.config.root_rank} failed: {message}")

    def save_checkpoint(
        self, extra: dict[str, Any] | None = None, *, next_epoch: int = 0
    ) -> Path | None:
        """Collective: rank 0 writes the checkpoint atomically while the others wait, so no
        rank races ahead to read a file that is not there yet, and a failed write (disk
        full) stops every rank instead of leaving them waiting. Returns the path on rank 0."""
        if self.config.checkpoint is None:
            raise ValueError("no checkpoint path was configured: pass checkpoint=PATH to setup")
        extra = plain_extra(extra or {}, self.EXTRA_TYPES)  # every rank, before any collective
        self._enter_save()
        shared = self._gather_for_checkpoint(extra)
        path, error = None, None
        if self.is_root:
            state = self._checkpoint_state(extra, next_epoch, shared)
            try:
                path = self._write_checkpoint(Path(self.config.checkpoint), state)
            except OSError as exc:
                error = CheckpointError(
                    self.config.checkpoint,
                    f"cannot be written: {exc}",
                    "check free space and permissions of that directory",
                )
        self._raise_on_root_error(error)
        return path

    # Hooks, in the order setup() calls them, then save_checkpoint()'s.
    @abc.abstractmethod
    def _init(self) -> Topology:
        """Step 1: initialise Horovod (idempotent); return the topology
        (:meth:`Topology.of`)."""

    @abc.abstractmethod
    def _pin_device(self, topology: Topology) -> None:
        """Step 2: bind this process to one accelerator by local rank (or the CPU)."""

    @abc.abstractmethod
    def _wrap_optimizer(self) -> None:
        """Step 3: wrap the optimizer so gradients are reduced across ranks."""

    @abc.abstractmethod
    def _scale_lr(self, warmup: Warmup) -> None:
        """Step 6: apply ``warmup.multiplier(step)`` to the user's LR at each optimizer step."""

    def _rescale_lr(self, old: Warmup, new: Warmup) -> None:  # noqa: B027 - optional hook
        """After an elastic reset: move the LR scaling from ``old`` to ``new`` (an adapter
        whose step reads ``self.warmup`` needs nothing)."""

    def _snapshot(self) -> Any:
        """Elastic: a copy in host memory of everything a step changes (weights, optimizer
        and scheduler state, step counters), for :meth:`_restore_snapshot`."""
        raise NotImplementedError(f"{self.MODULE}: elastic sessions are not supported")

    def _restore_snapshot(self, snapshot: Any) -> None:
        """Elastic: put a :meth:`_snapshot` back."""
        raise NotImplementedError(f"{self.MODULE}: elastic sessions are not supported")

    def _position(self) -> dict[str, Any]:
        """Elastic: where training is, as picklable values a joining worker takes from rank 0
        (epoch, step, what step 4 does not broadcast)."""
        raise NotImplementedError(f"{self.MODULE}: elastic sessions are not supported")

    def _set_position(self, position: dict[str, Any]) -> None:
        """Elastic: take a :meth:`_position` (rank 0's, or this rank's last commit)."""
        raise NotImplementedError(f"{self.MODULE}: elastic sessions are not supported")

    def _prepare_state(self) -> None:  # noqa: B027 - optional hook
        """Every rank, before steps 5 and 4: make sure the state to load and broadcast exists
        (Keras builds the optimizer's variables here); raise on every rank when it cannot."""

    @abc.abstractmethod
    def _read_checkpoint(self, path: Path) -> Any:
        """Step 5, rank 0: load ``path`` (its ``format`` is checked here after); raise
        CheckpointError naming the file when it cannot be read."""

    @abc.abstractmethod
    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        """Step 5, rank 0: put ``state`` into the model and optimizer; raise CheckpointError
        when it does not fit them."""

    @abc.abstractmethod
    def _broadcast_state(self) -> None:
        """Step 4 (collective): model and optimizer state from the root rank to every rank."""

    @abc.abstractmethod
    def _resume_info(self, state: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: what besides the weights every rank takes from the checkpoint (epoch,
        step, the user's extra state...), as picklable values."""

    @abc.abstractmethod
    def _apply_resume_info(self, info: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank: take ``info`` (from :meth:`_resume_info`); return the user's extra
        state."""

    def _enter_save(self) -> None:  # noqa: B027 - optional hook
        """Collective, every rank, first in :meth:`save_checkpoint`: fail with the fix when the
        other ranks do not come (a save called on rank 0 only would wait for them forever)."""

    @abc.abstractmethod
    def _gather_for_checkpoint(self, extra: dict[str, Any]) -> Any:
        """Collective, every rank: check ``extra`` and gather what rank 0 needs from the
        others (e.g. their RNG states); returned to rank 0's :meth:`_checkpoint_state`."""

    @abc.abstractmethod
    def _checkpoint_state(self, extra: dict[str, Any], next_epoch: int, gathered: Any) -> Any:
        """Rank 0: everything to save; resuming will start at ``next_epoch``."""

    @abc.abstractmethod
    def _write_checkpoint(self, path: Path, state: Any) -> Path:
        """Rank 0: write ``state`` to ``path`` atomically."""

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable values)."""
