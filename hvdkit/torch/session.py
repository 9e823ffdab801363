"""``hvdkit.torch.setup``: the six steps in one call, and the session it returns."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, Unpack, cast

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from hvdkit import preempt, rank_zero, sync
from hvdkit.core import SetupConfig, SetupOptions
from hvdkit.devices import cores_per_process
from hvdkit.elastic import SessionElastic
from hvdkit.torch.adapter import TorchAdapter
from hvdkit.torch.optimizer import backward_and_step


class _ElasticSampler(Sampler[int]):
    """An elastic session's shard: the epoch's order (the same as ``DistributedSampler``'s
    with the same seed) past the samples all ranks have done, split over the ranks there are
    now. Read at each iteration, so a reset re-splits what is left of the epoch."""

    def __init__(
        self, length: int, session: Session, shuffle: bool, seed: int, drop_last: bool
    ) -> None:
        self.length, self.session = length, session
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last

    def _rows(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.session.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        rest, size = order[self.session._offset :], self.session.size
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % size]
        elif rest and len(rest) % size:
            rest += (rest * size)[: size - len(rest) % size]  # every rank the same count
        return rest[self.session.rank :: size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


class _ResumableSampler(Sampler[int]):
    """A ``DistributedSampler`` that can leave out the first ``skip`` samples of its epoch: a
    job resumed from a mid-epoch (preemption) checkpoint goes on with the next batch."""

    def __init__(self, inner: DistributedSampler) -> None:
        self.inner, self.skip = inner, 0

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        # Once: DataLoader asks for the indices at its first batch, not when iterated.
        skip, self.skip = self.skip, 0
        return iter(list(self.inner)[skip:])

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


class _EpochLoader:
    """A DataLoader whose sampler is told the session's epoch each time it is iterated, so
    every epoch is shuffled differently and identically on every rank. In an elastic session
    it also restarts from the restored position when the session recovers mid-epoch."""

    def __init__(self, loader: DataLoader, sampler: Any, session: Session) -> None:
        self.loader, self.sampler, self.session = loader, sampler, session

    def __iter__(self) -> Iterator[Any]:
        elastic, session = self.session._elastic, self.session
        if elastic is None:
            self.sampler.set_epoch(session.epoch)
            done = session._take_resume_batches()
            self.sampler.skip = done * (self.loader.batch_size or 1)
            # The checkpoint holds the RNG as it was mid-epoch, after the iterator drew its
            # seed at the epoch's start: a resumed epoch's iterator must not draw again.
            state = torch.random.get_rng_state() if done else None
            batches = iter(self.loader)
            if state is not None:
                torch.random.set_rng_state(state)
            session._epoch_batches = done
            for batch in batches:
                session._epoch_batches += 1
                yield batch
            return
        while True:
            generation = elastic.generation
            for batch in self.loader:
                self.session._batch_samples = (self.loader.batch_size or 1) * self.session.size
                yield batch
                if elastic.generation != generation:
                    break  # recovered: go on from the restored position, re-split
            else:
                return

    def __len__(self) -> int:
        return len(self.loader)


class Session:
    """What :func:`setup` returns: the wrapped model and optimizer, the device, the topology,
    and the rank-aware helpers (data sharding, stepping, metrics, checkpoints, output)."""

    def __init__(self, adapter: TorchAdapter) -> None:
        self._adapter = adapter
        assert adapter.topology is not None
        self.topology = adapter.topology
        self.resumed: dict[str, Any] | None = adapter.resumed
        self._steps = 0
        self._offset = 0  # samples of this epoch done by all ranks (elastic)
        self._batch_samples = 0
        self._elastic: SessionElastic | None = None
        self._epoch_batches = 0  # batches of this epoch handed out (a preemption's position)
        self._resume_batches = int(adapter.preempted_at["batches"]) if adapter.preempted_at else 0
        self._extra: dict[str, Any] = dict(self.resumed or {})  # the last save()'s extra
        self._preempt: preempt.Preemption | None = None
        if adapter.config.checkpoint is not None and not adapter.config.elastic:
            # Where a checkpoint can be written, SIGTERM/SIGUSR1 stop at a step boundary.
            self._preempt = preempt.Preemption(
                lambda flag, seconds: hvd.allreduce_async(
                    torch.tensor([flag, seconds], dtype=torch.float64),
                    op=hvd.Max,
                    name="hvdkit.preempt",
                ),
                lambda handle: tuple(hvd.synchronize(handle).tolist()),
            )
            self._preempt.install()
        if adapter.config.elastic:
            self._elastic = SessionElastic(
                hvd,
                adapter,
                lambda obj: hvd.broadcast_object(obj, 0, name="hvdkit.elastic"),
                position=lambda: {"offset": self._offset},
                set_position=lambda p: setattr(self, "_offset", p["offset"]),
                on_reset=self._after_reset,
            )

    def _after_reset(self) -> None:
        assert self._adapter.topology is not None
        self.topology = self._adapter.topology
        self._steps = 0  # every rank, joined or not, checks the sync after its next step

    def _take_resume_batches(self) -> int:
        done, self._resume_batches = self._resume_batches, 0
        return done

    def _stop_if_preempted(self) -> None:
        """At a step boundary: after a SIGTERM/SIGUSR1 on any rank, every rank checkpoints
        (mid-epoch, with the batch position) and exits with :data:`hvdkit.preempt.EXIT_CODE`."""
        if self._preempt is None or not self._preempt.step_done():
            return
        position = {"batches": self._epoch_batches, "signal": self._preempt.describe()}
        path = self.save(end_of_epoch=False, **self._extra, **{preempt.EXTRA: position})
        self.print(
            preempt.announce(
                self._preempt.describe(), self.epoch, self._epoch_batches, self.step_count, path
            ),
            flush=True,
        )
        raise preempt.Preempted()

    model = property(lambda self: self._adapter.model)
    optimizer = property(lambda self: self._adapter.optimizer)
    scheduler = property(lambda self: self._adapter.scheduler)
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
        """``for epoch in session.epochs(n)``: resumes after the last saved epoch. Elastic:
        commits at each epoch end, and goes on from where a reset left it."""
        if self._elastic is not None:
            while self._adapter.epoch < total:
                epoch = self._adapter.epoch
                yield epoch
                self._adapter.epoch, self._offset = epoch + 1, 0
                self.check_sync(f"at the end of epoch {epoch + 1}")
                self._elastic.commit()
            return
        start = self._adapter.epoch
        for epoch in range(start, total):
            self._adapter.epoch = epoch
            yield epoch
            self.check_sync(f"at the end of epoch {epoch + 1}")
        self._adapter.epoch = total

    def check_sync(self, where: str = "") -> None:
        """The sync guard (collective, :mod:`hvdkit.sync`): raise ``DivergenceError`` on every
        rank if the model's parameters differ between ranks. Run after the first step and at
        each epoch end of :meth:`epochs`; ``HVDKIT_SYNC_CHECK=0`` turns it off. Buffers
        (BatchNorm's running statistics) follow each rank's data and are not compared."""
        if not sync.enabled():
            return
        named = list(self.model.named_parameters())
        local = sync.fingerprint([p.detach().cpu().double().numpy() for _, p in named])
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
        """
        if not pad:
            if shuffle or drop_last:
                raise ValueError("pad=False is for evaluation: use it with shuffle=False")
            rows = range(self.rank, len(cast(Sized, dataset)), self.size)  # a map-style dataset
            subset = Subset(dataset, rows)
            return DataLoader(subset, batch_size=batch_size, shuffle=False, **loader_kwargs)
        sampler: Any
        if self._elastic is not None:
            length = len(cast(Sized, dataset))
            sampler = _ElasticSampler(length, self, shuffle, seed, drop_last)
        else:
            sampler = _ResumableSampler(
                DistributedSampler(
                    dataset,
                    num_replicas=self.size,
                    rank=self.rank,
                    shuffle=shuffle,
                    seed=seed,
                    drop_last=drop_last,
                )
            )
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
        return _EpochLoader(loader, sampler, self)

    def backward_and_step(self, loss: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """See :func:`hvdkit.torch.backward_and_step` (AMP scaler and clipping options)."""
        ok, norm = self._collective(
            lambda: backward_and_step(
                loss, self.optimizer, parameters=self.model.parameters(), **kwargs
            )
        )
        if not ok:
            return None  # a worker was lost: this batch is dropped, the loader goes back
        self._offset += self._batch_samples
        self._steps += 1
        if self._steps == 1:
            self.check_sync("after the first step")
        self._stop_if_preempted()
        if self._elastic is not None and self._elastic.step_done():
            self._elastic.commit()
        return norm

    def average(self, total: float, count: int | float, name: str = "metric") -> float:
        """The global mean of a metric from each rank's sum and sample count, so ranks with
        more samples weigh more: exact even when shards differ."""
        pair = torch.tensor([float(total), float(count)], dtype=torch.float64)
        _, summed = self._collective(
            lambda: hvd.allreduce(pair, op=hvd.Sum, name=f"hvdkit.avg.{name}"), again=True
        )
        return (summed[0] / summed[1]).item() if summed[1] > 0 else float("nan")

    def save(self, *, end_of_epoch: bool = True, **extra: Any) -> Path | None:
        """Checkpoint (collective): rank 0 writes atomically; ``extra`` comes back in
        ``session.resumed`` on resume. At the end of an epoch, resuming starts at the next
        epoch; mid-epoch (``end_of_epoch=False``) it restarts the current one, so keep the
        batch position in ``extra`` to skip what was done."""
        if preempt.EXTRA not in extra:
            self._extra = dict(extra)
        _, path = self._collective(
            lambda: self._adapter.save_checkpoint(extra, next_epoch=self.epoch + int(end_of_epoch)),
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
    ``backward_passes_per_step``, ``resume``, ``root_rank``, ``elastic``, ``commit_every``.

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
