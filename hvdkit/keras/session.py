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
from types import SimpleNamespace
from typing import Any, Unpack

import keras

from hvdkit import rank_zero
from hvdkit.core import SetupConfig, SetupOptions
from hvdkit.elastic import SessionElastic
from hvdkit.keras import backend, inputs
from hvdkit.keras import callbacks as cb
from hvdkit.keras.adapter import KerasAdapter
from hvdkit.keras.elastic import UpdateBatchStateCallback, drop_compiled, translate
from hvdkit.keras.profiling import ProfileCallback
from hvdkit.profile import recorder as profile_recorder


class _ElasticProgress(UpdateBatchStateCallback):
    """An elastic session's place in ``fit``: the batches done in the epoch and the first
    epoch after a reset cut to the batches it had left (as :class:`UpdateBatchStateCallback`),
    the epoch, and a commit every ``commit_every`` batches and at each epoch end (raising out
    of ``fit`` when workers were added)."""

    def __init__(self, session: Session) -> None:
        super().__init__(session._place)
        assert session._elastic is not None
        self.session, self.elastic = session, session._elastic

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self.session._adapter.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self.elastic.step_done():
            self.elastic.commit_or_raise()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        self.session._adapter.epoch = epoch + 1
        self.elastic.commit_or_raise()


class Session:
    """What :func:`setup` returns: the wrapped optimizer, the ``fit()`` callbacks, the
    topology and the rank-0 helpers. ``optimizer, callbacks = session`` unpacks it."""

    def __init__(self, adapter: KerasAdapter, callbacks: list[keras.callbacks.Callback]) -> None:
        self._adapter = adapter
        assert adapter.topology is not None
        self.topology = adapter.topology
        self.resumed: dict[str, Any] | None = adapter.resumed
        self.callbacks = callbacks
        self._place = SimpleNamespace(batch=0)  # batches done in the epoch (elastic)
        self._elastic: SessionElastic | None = None
        if adapter.config.elastic:
            self._elastic = SessionElastic(
                backend.horovod(),
                adapter,
                backend.broadcast_object,
                position=lambda: {"batch": self._place.batch},
                set_position=lambda p: setattr(self._place, "batch", p["batch"]),
                on_reset=self._after_reset,
            )

    def _after_reset(self) -> None:
        assert self._adapter.topology is not None
        self.topology = self._adapter.topology
        drop_compiled(self.model)

    def fit(self, x: Any, y: Any = None, *, callbacks: Any = (), **kwargs: Any) -> Any:
        """``model.fit`` on this rank's shard of ``x`` and ``y``: whole arrays (a dict or
        list of them for several inputs; ``sample_weight`` sharded with them), a
        ``tf.data.Dataset`` (sharded at its source), a ``keras.utils.PyDataset`` (``workers``,
        ``use_multiprocessing`` and ``max_queue_size`` may be given here, as to Keras 2's
        ``fit``), a torch ``DataLoader`` (its own sampler's indices split) or ``Dataset``, or
        a generator with ``steps_per_epoch``; the shares partition every epoch and each rank
        takes the same number of steps (:mod:`hvdkit.keras.inputs`). What every rank must
        draw alike is compared across the ranks first, and an input hvdkit cannot shard so
        is refused before the first step, naming the fix. The session's callbacks come before
        ``callbacks``; it resumes from the session's epoch. In an elastic session a lost or
        added worker ends ``fit`` on every rank; the session recovers (last commit, new size,
        LR rescaled) and calls ``fit`` again on a new shard, the interrupted epoch cut to the
        batches it had left (Horovod's Keras rule: the count of batches is kept, not which
        samples they were). Returns the last ``fit``'s history."""
        kwargs.setdefault("initial_epoch", self.epoch)
        while True:
            gather = inputs.gather_over_ranks if self.size > 1 else None
            mine = inputs.shard_input(x, y, kwargs, self.rank, self.size, gather)
            extra = [] if self._elastic is None else [_ElasticProgress(self)]
            try:
                return self.model.fit(
                    mine.x,
                    mine.y,
                    callbacks=[*mine.callbacks, *self.callbacks, *callbacks, *extra],
                    **mine.kwargs,
                )
            except Exception as error:
                if self._elastic is None or not self._elastic.recover_from(error, translate):
                    raise
                kwargs["initial_epoch"] = self.epoch

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
    """The six steps in one call (:mod:`hvdkit.core`'s numbering and order): (1) init Horovod,
    (2) pin one GPU per process, (3) wrap the optimizer, (6) scale the LR by world size with
    warmup, (5) resume from ``checkpoint`` on rank 0 and (4) broadcast to every rank.
    Returns a :class:`Session` that unpacks as the optimizer to compile with and the callbacks
    to give ``fit``: a progress bar on rank 0 only, metric averaging, the warmup (float LRs; a
    schedule is ramped inside the step) and, with ``checkpoint``, a rank-0 atomic checkpoint
    every epoch that ``fit`` resumes from.

    Give the optimizer the single-process LR. ``options`` are
    :class:`hvdkit.core.SetupConfig` fields: ``lr_scaling``, ``warmup_epochs`` (with
    ``steps_per_epoch``) or ``warmup_steps``, ``op`` (``average``/``sum``), ``compression``,
    ``backward_passes_per_step``, ``resume``, ``root_rank``, ``elastic``, ``commit_every``.
    With ``elastic=True`` train with :meth:`Session.fit` on the whole arrays: it survives lost
    and added workers (see there). The model must have its weights
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
    if config.shard_optimizer:
        raise ValueError(
            "shard_optimizer=True: hvdkit.keras does not shard optimizer state (Keras "
            "optimizers apply constraints, weight-decay exclusions and sparse updates per "
            "variable, which a flat shard would break; see the Keras guide). Fix: "
            "shard_optimizer=False, or hvdkit.torch.setup(..., shard_optimizer=True)"
        )
    if config.elastic and keras.config.backend() == "jax":
        raise ValueError(
            "elastic=True: the elastic session is not available on KERAS_BACKEND=jax (JAX's "
            "runtime cannot change its processes, so a reset restarts each worker process, "
            "which a session cannot resume inside fit). Fix: Horovod's shape, which restarts "
            "and resumes: fit inside @hvd.elastic.run with hvd.elastic.KerasState and its "
            "callbacks (docs/guides/elastic.md, 'Making a script elastic')"
        )
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
    recorder = profile_recorder.get()
    if recorder is not None:
        callbacks.insert(0, ProfileCallback(recorder))  # first: the epoch's end is apart
    return Session(adapter, callbacks)
