"""``hvdkit.torch.setup``: the six steps in one call, and the session it returns."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, Unpack, cast

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from hvdkit import preempt, rank_zero, sync
from hvdkit.core import SetupConfig, SetupOptions
from hvdkit.devices import cores_per_process
from hvdkit.elastic import SessionElastic
from hvdkit.position import Position, epoch_order, remaining, shard_length
from hvdkit.profile import recorder as profile_recorder
from hvdkit.torch.adapter import TorchAdapter
from hvdkit.torch.optimizer import reduce_and_step, step_or_accumulate


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`hvdkit.sync.fingerprint` of one tensor, computed where it lives (GPU or CPU), a
    chunk at a time: three float64 numbers, not a float64 copy of the tensor on the host."""
    flat = tensor.reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=tensor.device)
    step = 1.0 / (flat.numel() - 1) if flat.numel() > 1 else 0.0
    for start in range(0, flat.numel(), sync.CHUNK):
        chunk = flat[start : start + sync.CHUNK].double()
        weights = (
            torch.arange(start, start + chunk.numel(), dtype=torch.float64, device=tensor.device)
            .mul_(step)
            .add_(1.0)
        )
        out += torch.stack([chunk.sum(), chunk @ weights, chunk.abs().sum()])
    return out


class _PositionSampler(Sampler[int]):
    """The session's shard of a dataset: the epoch's order (``DistributedSampler``'s, same
    seed) past the samples all ranks have done, split over the ranks there are now
    (:func:`hvdkit.position.remaining`). The loader tells it the epoch, the samples done and
    the world at each iteration, so a resume (at any world size) and an elastic reset go on
    from the next global sample."""

    def __init__(self, length: int, shuffle: bool, seed: int, drop_last: bool) -> None:
        self.length, self.shuffle, self.seed, self.drop_last = length, shuffle, seed, drop_last
        self.epoch, self.done, self.size, self.rank = 0, 0, 1, 0

    def begin(self, epoch: int, done: int, size: int, rank: int) -> None:
        self.epoch, self.done, self.size, self.rank = epoch, done, size, rank

    def set_epoch(self, epoch: int) -> None:
        """``DistributedSampler``'s method, for scripts that call it themselves."""
        self.epoch = epoch

    def _rows(self) -> list[int]:
        order = epoch_order(self.length, self.epoch, self.seed, self.shuffle)
        return remaining(order, self.done, self.size, self.rank, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


class _EpochLoader:
    """A DataLoader over :class:`_PositionSampler`.

    The loader whose batches reach ``backward_and_step`` owns the session's position (the
    training loader): at each pass its sampler is given the position, so every epoch is
    shuffled differently (and identically on every rank) and a resumed or recovered epoch
    goes on from the next global sample; outside :meth:`Session.epochs` (a plain
    ``for epoch in range(n)`` loop) its full pass ends the position's epoch, so the next pass
    is shuffled anew too. Any other loader of the session (validation, made with the same
    defaults and iterated inside or after the epoch) goes over its whole epoch and leaves
    the position alone. Before the first step, a pass that starts while no other pass is
    open takes the position provisionally (a resumed epoch goes on from its next sample); it
    ends nothing unless one of its batches was stepped on."""

    def __init__(self, loader: DataLoader, sampler: _PositionSampler, session: Session) -> None:
        self.loader, self.sampler, self.session = loader, sampler, session
        self.open = False  # inside a pass
        self.batch_samples = 0  # samples one batch is, over all ranks

    def __iter__(self) -> Iterator[Any]:
        session, elastic = self.session, self.session._elastic
        position = session.position
        drives = session._drives(self)
        self.open = True
        try:
            while True:
                if session._trains(self):  # the last pass's, after the epoch-end code
                    session._commit_if_due()
                generation = elastic.generation if elastic is not None else 0
                self.batch_samples = (self.loader.batch_size or 1) * session.size
                if drives:
                    session._begin_pass(self)
                    done = position.samples
                else:
                    done = 0
                resumed = drives and done > 0 and elastic is None
                self.sampler.begin(position.epoch, done, session.size, session.rank)
                # A checkpoint holds the RNG as it was mid-epoch, after the iterator drew its
                # seed at the epoch's start: a resumed epoch's iterator must not draw again.
                state = torch.random.get_rng_state() if resumed else None
                batches = iter(self.loader)
                if state is not None:
                    torch.random.set_rng_state(state)
                yielded = False
                for batch in batches:
                    if drives:
                        session._stop_if_due()
                    session._current, yielded = self, True
                    yield batch
                    if session._owner is self:  # the step is over: its scheduler has stepped
                        session._commit_if_due()
                    if elastic is not None and elastic.generation != generation:
                        if drives:
                            elastic.back_to_the_reset()
                        break  # recovered: go on from the restored position, re-split
                else:
                    if session._owner is None and drives and done > 0 and not yielded:
                        # A resumed epoch saved after its last batch: the rest is empty, and
                        # this loader is the one that trained it.
                        session._owner = self
                    if session._owner is not self:
                        return  # not the training loader: nothing of the position's to end
                    session._flush()
                    if elastic is not None and elastic.generation != generation:
                        continue  # recovered during that last step: from the restored position
                    session._stop_if_due()
                    session._end_pass()
                    return
        finally:
            self.open = False

    def __len__(self) -> int:
        """The batches of a whole epoch at the current world size (what a scheduler's
        ``total_steps`` and a progress bar want; a resumed epoch's first pass yields fewer)."""
        sampler, session = self.sampler, self.session
        rows = shard_length(sampler.length, session.size, sampler.drop_last)
        batch = self.loader.batch_size or 1
        return rows // batch if self.loader.drop_last else -(-rows // batch)


class Session:
    """What :func:`setup` returns: the wrapped model and optimizer, the device, the topology,
    and the rank-aware helpers (data sharding, stepping, metrics, checkpoints, output)."""

    def __init__(self, adapter: TorchAdapter) -> None:
        self._adapter = adapter
        assert adapter.topology is not None
        self.topology = adapter.topology
        self.resumed: dict[str, Any] | None = adapter.resumed
        self._synced_once = False
        self._owner: _EpochLoader | None = None  # the loader whose batches are stepped on
        self._current: _EpochLoader | None = None  # the loader whose batch came last
        self._loaders: weakref.WeakSet[_EpochLoader] = weakref.WeakSet()  # from shard()
        self._in_epochs = False  # whether epochs() drives the position's epoch
        self._pending_step: dict[str, Any] | None = None  # an accumulating step's options
        self._extra: dict[str, Any] = dict(self.resumed or {})  # the last save()'s extra
        self._preempt: preempt.Preemption | None = None
        self._stop_due = False  # the ranks agreed to stop: at the script's next call
        self._commit_due = False  # an elastic commit, taken when the script asks for a batch
        if adapter.config.checkpoint is not None and not adapter.config.elastic:
            # Where a checkpoint can be written, SIGTERM/SIGUSR1 stop at a step boundary; the
            # ranks agree on it through a collective (not elastic: the size stays).
            self._preempt = preempt.among(
                self.topology.size,
                lambda flag, seconds: hvd.allreduce_async(
                    torch.tensor([flag, seconds], dtype=torch.float64),
                    op=hvd.Max,
                    name="hvdkit.preempt",
                ),
                lambda handle: tuple(hvd.synchronize(handle).tolist()),
            )
            self._preempt.install()
        self._elastic: SessionElastic | None = None
        if adapter.config.elastic:
            # The position travels with the adapter's (one object): nothing of the session's.
            self._elastic = SessionElastic(
                hvd,
                adapter,
                lambda obj: hvd.broadcast_object(obj, 0, name="hvdkit.elastic"),
                position=dict,
                set_position=lambda p: None,
                on_reset=self._after_reset,
            )

    @property
    def position(self) -> Position:
        """Where training is (:class:`hvdkit.position.Position`): the epoch, the samples of it
        done by all ranks, the optimizer step and the backward passes since it. Saved in every
        checkpoint and elastic commit; resuming at any world size goes on from it."""
        return self._adapter.position

    def _after_reset(self) -> None:
        assert self._adapter.topology is not None
        self.topology = self._adapter.topology
        self._synced_once = False  # every rank, joined or not, checks the sync after a step

    @property
    def _batch_samples(self) -> int:
        """Samples one batch of the training loader is, over all ranks (0: none yet)."""
        return self._owner.batch_samples if self._owner is not None else 0

    def _drives(self, loader: _EpochLoader) -> bool:
        """Whether ``loader``'s pass starting now follows (and may end) the position: the
        training loader's does; before it is known (or between its passes, when a new one
        may replace it), a pass that starts with no other one open."""
        if self._owner is loader:
            return True
        if self._owner is not None and self._owner.open:
            return False
        return not any(other.open for other in self._loaders if other is not loader)

    def _trains(self, loader: _EpochLoader) -> bool:
        """Whether ``loader``'s pass is the training loop's: the training loader's, or that of
        one made anew over its dataset (each epoch). Elastic commits are taken there only: a
        worker that joins at a commit runs its script's loop from the top, to the next
        training batch, so the others must go on to it too; taken at a validation pass after
        the epoch, they would wait in its collectives while the new worker trains."""
        owner = self._owner
        if owner is None or owner is loader:
            return owner is not None
        return self._drives(loader) and loader.loader.dataset is owner.loader.dataset

    def _begin_pass(self, loader: _EpochLoader) -> None:
        if self._adapter.legacy_batches:  # a checkpoint from before positions (hvdkit-torch-1)
            done, self._adapter.legacy_batches = self._adapter.legacy_batches, 0
            self.position.samples = done * loader.batch_samples

    def _stepping(self) -> _EpochLoader | None:
        """At a backward pass: the loader whose batch it is becomes the training loader when
        there is none, or the last one's pass is over (a loader made anew each epoch)."""
        current = self._current
        if current is not None and current is not self._owner and current.open:
            if self._owner is None or not self._owner.open:
                self._owner = current
        return self._owner if current is self._owner else None

    def _commit(self) -> None:
        assert self._elastic is not None
        self._commit_due = False
        self._elastic.commit()

    def _commit_if_due(self) -> None:
        if self._commit_due:
            self._commit()

    def _end_pass(self) -> None:
        if self._in_epochs:
            self.position.samples = 0  # epochs() ends the epoch, and commits after its code
        else:
            self.position.end_epoch()  # a plain loop: the next pass is the next epoch
        if self._elastic is None:
            return
        # Saved here: a worker lost before the next commit (in a validation pass, in the
        # script's epoch-end code) must not take the ranks back to the last commit inside
        # this pass. With epochs(), nothing would train the steps since it again (a step
        # short); with the script's own `for epoch in range(n)`, which has left the epoch,
        # the ranks would count their epochs differently (both found by the scenario
        # generator).
        self._elastic.save_at_pass_end()
        if not self._in_epochs:
            self._commit_due = True  # when the next pass starts, after the epoch-end code

    def _stop_if_preempted(self) -> None:
        """After each step: whether the ranks agree that a SIGTERM/SIGUSR1 arrived on any of
        them. The stop itself waits for the script's next call into the session
        (:meth:`_stop_if_due`): what the script does after the step (a scheduler stepped
        per batch, a log line) belongs to it and is in the checkpoint."""
        if self._preempt is not None and self._preempt.step_done():
            self._stop_due = True

    def _stop_if_due(self) -> None:
        """At the script's next call into the session after a preempted step (the training
        loader's next batch or the end of its pass, the next epoch, ``backward_and_step``):
        every rank checkpoints (mid-epoch, with the position) and exits with
        :data:`hvdkit.preempt.EXIT_CODE`."""
        if not self._stop_due or self._preempt is None:
            return
        self._stop_due = False
        position = {"signal": self._preempt.describe()}
        path = self.save(end_of_epoch=False, **self._extra, **{preempt.EXTRA: position})
        batches = self.position.samples // max(1, self._batch_samples)
        self.print(
            preempt.announce(self._preempt.describe(), self.epoch, batches, self.step_count, path),
            flush=True,
        )
        self._preempt.uninstall()  # horovodrun's SIGTERM, once a rank is out, stops this one
        raise preempt.Preempted()

    model = property(lambda self: self._adapter.model)
    optimizer = property(lambda self: self._adapter.optimizer)

    @property
    def scheduler(self) -> Any:
        """The LR scheduler the session checkpoints. One built after ``setup()`` (from
        ``len(loader)``, say) is given to it by assigning it here: it is then saved, and a
        resumed run's scheduler state is loaded into it."""
        return self._adapter.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self._adapter.take_scheduler(scheduler)

    device = property(lambda self: self._adapter.device)
    rank = property(lambda self: self.topology.rank)
    size = property(lambda self: self.topology.size)
    epoch = property(lambda self: self._adapter.epoch)
    step_count = property(lambda self: self._adapter.step_count)

    def lr_multiplier(self) -> float:
        """The world-size LR multiplier the next optimizer step will use."""
        assert self._adapter.warmup is not None
        return self._adapter.warmup.multiplier(self._adapter.step_count)

    def epochs(self, total: int) -> Iterator[int]:
        """``for epoch in session.epochs(n)``: resumes after the last saved epoch (mid-epoch
        after a preemption: the same epoch, from its next sample). Elastic: commits at each
        epoch end, and goes on from where a reset left it."""
        position = self.position
        self._in_epochs = True
        try:
            while position.epoch < total:
                self._stop_if_due()
                epoch = position.epoch
                yield epoch
                position.end_epoch()
                self.check_sync(f"at the end of epoch {epoch + 1}")
                if self._elastic is not None:
                    self._commit()
        finally:
            self._in_epochs = False

    def check_sync(self, where: str = "") -> None:
        """The sync guard (collective, :mod:`hvdkit.sync`): raise ``DivergenceError`` on every
        rank if the model's parameters differ between ranks. Run after the first step and at
        each epoch end of :meth:`epochs`; ``HVDKIT_SYNC_CHECK=0`` turns it off. Buffers
        (BatchNorm's running statistics) follow each rank's data and are not compared."""
        if not sync.enabled():
            return
        named = [*self.model.named_parameters(), *self._adapter.named_outside()]
        local = torch.stack([_fingerprint(p.detach()) for _, p in named]).cpu().numpy()
        ok, gathered = self._collective(
            lambda: hvd.allgather(torch.from_numpy(local)[None], name="hvdkit.sync").numpy()
        )
        if ok:  # after a reset the state was just synced: nothing to compare
            sync.check([name for name, _ in named], gathered, where)

    def _collective(self, run: Any, *, again: bool = False) -> tuple[bool, Any]:
        """Run one of the session's collectives; in an elastic session, recover when a worker
        is lost during it, and with ``again`` run it once more in the new world."""
        if self._elastic is None:
            return True, run()
        ok, result = self._elastic.guard(run)
        if not ok and again:
            ok, result = self._elastic.guard(run)
        return ok, result

    def shard(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = True,
        seed: int = 0,
        num_workers: int | None = None,
        **loader_kwargs: Any,
    ) -> _EpochLoader | DataLoader:
        """A DataLoader over this rank's shard of ``dataset``; ``batch_size`` is per rank.

        For training, every rank gets the same number of batches (the sampler pads the last
        shard by repeating samples unless ``drop_last``), so no rank waits forever in an
        allreduce. For evaluation pass ``shuffle=False, pad=False``: each sample is seen exactly
        once, so metrics averaged with :meth:`average` are exact (ranks may then differ by one
        batch: reduce once at the end, not per batch).

        The loader whose batches reach :meth:`backward_and_step` owns the session's position;
        a second one (validation, with these defaults, inside or after the epoch) goes over
        its whole epoch and leaves the position alone. ``len()`` is the batches of a whole
        epoch at the current world size, from the start.
        """
        if not pad:
            if shuffle or drop_last:
                raise ValueError("pad=False is for evaluation: use it with shuffle=False")
            rows = range(self.rank, len(cast(Sized, dataset)), self.size)  # a map-style dataset
            subset = Subset(dataset, rows)
            return DataLoader(subset, batch_size=batch_size, shuffle=False, **loader_kwargs)
        sampler = _PositionSampler(len(cast(Sized, dataset)), shuffle, seed, drop_last)
        if num_workers is None:
            num_workers = (
                0
                if self.device.type == "cpu"
                else min(4, cores_per_process(self.topology.local_size))
            )
        options: dict[str, Any] = {"pin_memory": self.device.type == "cuda"}
        if num_workers > 0:
            options.update(persistent_workers=True, prefetch_factor=2)
        options.update(loader_kwargs)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            **options,
        )
        epoch_loader = _EpochLoader(loader, sampler, self)
        self._loaders.add(epoch_loader)
        return epoch_loader

    def backward_and_step(
        self, loss: torch.Tensor, *, scaler: torch.amp.GradScaler | None = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """See :func:`hvdkit.torch.backward_and_step` (AMP scaler and clipping options).

        With ``backward_passes_per_step=N`` each call is one backward pass, and every N-th
        steps the optimizer on the gradients summed over the N passes (Horovod's rule),
        averaged over ranks; the ``zero_grad()`` of the usual loop is skipped in between, so
        the loop stays the same. A ``scaler`` is saved in the session's checkpoints and, when
        resuming, given back its state the first time it is passed here."""
        self._stop_if_due()
        # Batches not from shard()'s loaders: the commit before the next step. A reset in it
        # leaves the state as it is now (synced, or this commit restored): the batch stands.
        self._commit_if_due()
        if scaler is not None:
            self._adapter.take_scaler(scaler)
        # Clipping (``clip_grad_norm``) covers every parameter of the optimizer, those outside
        # the model too (a learnable loss weight), unless ``parameters`` says otherwise.
        options = {"parameters": None, "scaler": scaler, **kwargs}
        loader = self._stepping()
        passes = self._adapter.config.backward_passes_per_step
        accumulate = self.position.micro_step + 1 < passes
        ok, result = self._collective(
            lambda: step_or_accumulate(loss, self.optimizer, accumulate=accumulate, **options)
        )
        if not ok:
            return None  # a worker was lost: this batch is dropped, the loader goes back
        stepped, norm = result
        if loader is not None:
            self.position.samples += loader.batch_samples
        if not stepped:
            self.position.micro_step += 1
            self._pending_step = options
            return None
        return self._stepped(norm)

    def _flush(self) -> None:
        """At the end of a pass over the data: the backward passes of an unfinished
        accumulation step (an epoch of 5 batches with ``backward_passes_per_step=2``) step
        now, on what they summed, as Lightning does; they do not leak into the next epoch."""
        if not self.position.micro_step or self._pending_step is None:
            return
        options, self._pending_step = self._pending_step, None
        ok, norm = self._collective(lambda: reduce_and_step(self.optimizer, **options))
        if ok:
            self._stepped(norm)

    def _stepped(self, norm: Any) -> torch.Tensor | None:
        """After every optimizer step."""
        self.position.micro_step = 0
        self._pending_step = None
        if self._synced_once and self._preempt is None and self._elastic is None:
            return cast(torch.Tensor | None, norm)  # nothing of hvdkit's own after this step
        with profile_recorder.phase("other"):  # hvdkit's own per-step work
            if not self._synced_once:
                self._synced_once = True
                self.check_sync("after the first step")
            self._stop_if_preempted()
            if self._elastic is not None and self._elastic.step_done():
                # Taken at the script's next batch, not here: the script's own code after
                # the step (a per-step scheduler) belongs in it. Committed now, a worker
                # joining would start with the scheduler a step behind rank 0's.
                self._commit_due = True
        return cast(torch.Tensor | None, norm)

    def average(self, total: float, count: int | float, name: str = "metric") -> float:
        """The global mean of a metric from each rank's sum and sample count, so ranks with
        more samples weigh more: exact even when shards differ."""
        pair = torch.tensor([float(total), float(count)], dtype=torch.float64)
        with profile_recorder.phase("other"):
            _, summed = self._collective(
                lambda: hvd.allreduce(pair, op=hvd.Sum, name=f"hvdkit.avg.{name}"), again=True
            )
        return (summed[0] / summed[1]).item() if summed[1] > 0 else float("nan")

    def save(self, *, end_of_epoch: bool = True, **extra: Any) -> Path | None:
        """Checkpoint (collective: every rank calls it): rank 0 writes atomically; ``extra``
        comes back in ``session.resumed`` on resume. At the end of an epoch, resuming starts
        at the next epoch; mid-epoch (``end_of_epoch=False``, or any save while the training
        loader's pass is open) it goes on in the same epoch
        from the next sample not yet trained (the session's :attr:`position`), at any world
        size. ``extra`` values are checked here, on every rank: numbers, strings, bytes,
        None, tensors, and lists, tuples and dicts of them; numpy scalars are saved as Python
        numbers; anything else is refused naming its key."""
        with profile_recorder.phase("checkpoint"):  # under --profile: apart from the steps
            return self._save(end_of_epoch, extra)

    def _save(self, end_of_epoch: bool, extra: dict[str, Any]) -> Path | None:
        if self.position.micro_step:
            raise ValueError(
                f"save() after {self.position.micro_step} of the "
                f"{self._adapter.config.backward_passes_per_step} backward passes of a step: "
                "the gradients accumulated so far are not saved. Fix: save after the step "
                "(when session.position.micro_step is 0), e.g. at the end of the epoch"
            )
        if preempt.EXTRA not in extra:
            self._extra = dict(extra)
        # After a full pass of a plain loop the position is at the next epoch already; inside
        # the training loader's pass the epoch is not over, whatever end_of_epoch says.
        mid_pass = self._owner is not None and self._owner.open and self.position.samples > 0
        ended = end_of_epoch and not mid_pass and (self._in_epochs or self.position.samples > 0)
        _, path = self._collective(
            lambda: self._adapter.save_checkpoint(extra, next_epoch=self.epoch + int(ended)),
            again=True,
        )
        return cast(Path | None, path)

    print = staticmethod(rank_zero.print0)
    progress = staticmethod(rank_zero.progress)


def setup(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    checkpoint: str | Path | None = None,
    **options: Unpack[SetupOptions],
) -> Session:
    """The six steps in one call (:mod:`hvdkit.core`'s numbering and order): (1) init Horovod,
    (2) pin the device, (3) wrap the optimizer, (6) scale the LR by world size with warmup,
    (5) resume from ``checkpoint`` on rank 0 and (4) broadcast to all ranks.

    ``options`` are :class:`hvdkit.core.SetupConfig` fields: ``lr_scaling``,
    ``warmup_epochs``/``warmup_steps`` (+ ``steps_per_epoch``), ``op``, ``compression``,
    ``backward_passes_per_step``, ``resume``, ``root_rank``, ``elastic``, ``commit_every``,
    ``shard_optimizer``.

    ``shard_optimizer=True`` (ZeRO stage 1, :mod:`hvdkit.torch.zero`): each rank keeps the
    optimizer state of its 1/N slice of the parameters only; checkpoints hold the plain
    optimizer's state, so they move between sharded and plain runs at any number of ranks.
    ``shard_optimizer="gradients"`` (stage 2): the gradients too (``p.grad`` is None after
    the backward pass; clip with ``backward_and_step(..., clip_grad_norm=)``).

    ``elastic=True`` (under ``hvdkit run --min-np``): the same loop survives lost and added
    workers. The session commits in memory every ``commit_every`` steps and at each epoch
    end; a lost worker makes ``backward_and_step`` return after putting back the last commit
    (the loader then goes on from that sample, re-split over the ranks left); an added one
    joins at the next commit through its own ``setup()``. The LR multiplier follows the new
    size at once (a warmup in progress goes on at its step). Collectives of your own outside
    the session's methods are not protected.

    Example::

        session = hvdkit.torch.setup(model, optimizer, checkpoint="ckpt.pt", warmup_steps=100)
        loader = session.shard(train_set, batch_size=64)
        for epoch in session.epochs(10):
            for x, y in loader:
                session.optimizer.zero_grad()
                session.backward_and_step(loss_fn(session.model(x), y))
            session.save()
    """
    config = SetupConfig(checkpoint=Path(checkpoint) if checkpoint else None, **options)
    adapter = TorchAdapter(model, optimizer, config, scheduler=scheduler)
    adapter.setup()
    return Session(adapter)
