"""``hvdkit.keras.setup``: the six steps in one call, and the session it returns.

The twin of :mod:`hvdkit.torch.session`: both ``setup()`` functions return a ``Session`` with
the same core attributes (``model``, ``optimizer``, ``topology``, ``rank``, ``size``,
``epoch``, ``resumed``, ``lr_multiplier()``, ``print``, ``progress``). Keras's session also
unpacks as ``(optimizer, callbacks)``, the shape ``setup`` returned before, because a Keras
script hands both to ``compile`` and ``fit`` and the loop itself belongs to ``fit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Unpack

import keras

from hvdkit import rank_zero
from hvdkit.core import SetupConfig, SetupOptions
from hvdkit.keras import callbacks as cb
from hvdkit.keras.adapter import KerasAdapter


class Session:
    """What :func:`setup` returns: the wrapped optimizer, the ``fit()`` callbacks, the
    topology and the rank-0 helpers. ``optimizer, callbacks = session`` unpacks it."""

    def __init__(self, adapter: KerasAdapter, callbacks: list[keras.callbacks.Callback]) -> None:
        self._adapter = adapter
        assert adapter.topology is not None
        self.topology = adapter.topology
        self.resumed: dict[str, Any] | None = adapter.resumed
        self.callbacks = callbacks

    model = property(lambda self: self._adapter.model)
    optimizer = property(lambda self: self._adapter.optimizer)
    rank = property(lambda self: self.topology.rank)
    size = property(lambda self: self.topology.size)
    epoch = property(lambda self: self._adapter.epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.optimizer, self.callbacks))

    def lr_multiplier(self) -> float:
        """The world-size LR multiplier in force at the optimizer's current iteration."""
        assert self._adapter.warmup is not None
        step = int(keras.ops.convert_to_numpy(self.optimizer.iterations))
        return self._adapter.warmup.multiplier(step)

    print = staticmethod(rank_zero.print0)
    progress = staticmethod(rank_zero.progress)


def setup(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    *,
    checkpoint: str | Path | None = None,
    average_metrics: bool = True,
    **options: Unpack[SetupOptions],
) -> Session:
    """The six steps in one call: init Horovod, pin one GPU per process, scale the LR by world
    size (with warmup), wrap the optimizer, resume from ``checkpoint`` on rank 0 and broadcast
    to every rank. Returns a :class:`Session` that unpacks as the optimizer to compile with and
    the callbacks to give ``fit``: a progress bar on rank 0 only, metric averaging, the warmup
    (float LRs; a schedule is ramped inside the step) and, with ``checkpoint``, a rank-0 atomic
    checkpoint every epoch that ``fit`` resumes from.

    Give the optimizer the single-process LR. ``options`` are
    :class:`hvdkit.core.SetupConfig` fields: ``lr_scaling``, ``warmup_epochs`` (with
    ``steps_per_epoch``) or ``warmup_steps``, ``op`` (``average``/``sum``), ``compression``,
    ``backward_passes_per_step``, ``resume``, ``root_rank``. The model must have its weights
    (an input shape); on the TensorFlow backend with GPUs, call :func:`hvdkit.keras.init`
    before building it.

    Example::

        hvdkit.keras.init()
        model = make_model()
        optimizer, callbacks = hvdkit.keras.setup(
            model, keras.optimizers.Adam(1e-3), checkpoint="ckpt.npz", warmup_steps=100
        )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        model.fit(x_shard, y_shard, epochs=10, callbacks=callbacks, verbose=1)
    """
    config = SetupConfig(checkpoint=Path(checkpoint) if checkpoint else None, **options)
    adapter = KerasAdapter(model, optimizer, config)
    adapter.setup()
    if adapter.resumed is not None:
        rank_zero.print0(f"hvdkit: resumed from {config.checkpoint} at epoch {adapter.epoch}")
    callbacks: list[keras.callbacks.Callback] = [cb.ProgbarLogger()]
    if average_metrics:
        callbacks.append(cb.MetricAverageCallback())
    callbacks += adapter.callbacks
    if config.checkpoint is not None:
        callbacks.append(cb.BackupAndRestore.for_adapter(adapter))
    return Session(adapter, callbacks)
