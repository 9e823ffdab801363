"""``hvdkit.torch.setup``: the six steps in one call, and the session it returns."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, Unpack, cast

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from hvdkit import rank_zero, sync
from hvdkit.core import SetupConfig, SetupOptions
from hvdkit.devices import cores_per_process
from hvdkit.torch.adapter import TorchAdapter
from hvdkit.torch.optimizer import backward_and_step


class _EpochLoader:
    """A DataLoader whose sampler is told the session's epoch each time it is iterated, so
    every epoch is shuffled differently and identically on every rank."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, session: Session) -> None:
        self.loader, self.sampler, self.session = loader, sampler, session

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.session.epoch)
        return iter(self.loader)

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
        """``for epoch in session.epochs(n)``: resumes after the last saved epoch."""
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
        gathered = hvd.allgather(torch.from_numpy(local)[None], name="hvdkit.sync").numpy()
        sync.check([name for name, _ in named], gathered, where)

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
        sampler: DistributedSampler = DistributedSampler(
            dataset,
            num_replicas=self.size,
            rank=self.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
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
        norm = backward_and_step(loss, self.optimizer, parameters=self.model.parameters(), **kwargs)
        self._steps += 1
        if self._steps == 1:
            self.check_sync("after the first step")
        return norm

    def average(self, total: float, count: int | float, name: str = "metric") -> float:
        """The global mean of a metric from each rank's sum and sample count, so ranks with
        more samples weigh more: exact even when shards differ."""
        pair = torch.tensor([float(total), float(count)], dtype=torch.float64)
        summed = hvd.allreduce(pair, op=hvd.Sum, name=f"hvdkit.avg.{name}")
        return (summed[0] / summed[1]).item() if summed[1] > 0 else float("nan")

    def save(self, *, end_of_epoch: bool = True, **extra: Any) -> Path | None:
        """Checkpoint (collective): rank 0 writes atomically; ``extra`` comes back in
        ``session.resumed`` on resume. At the end of an epoch, resuming starts at the next
        epoch; mid-epoch (``end_of_epoch=False``) it restarts the current one, so keep the
        batch position in ``extra`` to skip what was done."""
        return self._adapter.save_checkpoint(extra, next_epoch=self.epoch + int(end_of_epoch))

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
    """The six steps in one call: init, pin the device, scale the LR (with warmup), wrap the
    optimizer, resume from ``checkpoint`` on rank 0 and broadcast to all ranks.

    ``options`` are :class:`hvdkit.core.SetupConfig` fields: ``lr_scaling``,
    ``warmup_epochs``/``warmup_steps`` (+ ``steps_per_epoch``), ``op``, ``compression``,
    ``backward_passes_per_step``, ``resume``, ``root_rank``.

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
