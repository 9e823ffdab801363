"""Keras 3 ``fit()`` callbacks with Horovod's names, plus rank-0 checkpointing, resume and
a progress bar printed once.

One module for all of them, where Keras 3 puts one callback per module (STYLE.md): Horovod
scripts import them as ``hvd.callbacks.X``, so ``hvdkit.keras.callbacks`` must be one
namespace, and each callback is a few lines over :mod:`hvdkit.rank_zero`, :mod:`hvdkit.sync`
and :mod:`hvdkit.keras.lr`, where the logic lives.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from hvdkit import preempt, rank_zero, sync
from hvdkit.checkpoint import atomic_path
from hvdkit.core import SetupConfig
from hvdkit.keras import backend
from hvdkit.keras.adapter import KerasAdapter
from hvdkit.keras.backend import allgather_numpy
from hvdkit.keras.lr import LearningRateScheduleCallback, LearningRateWarmupCallback
from hvdkit.keras.metrics import install_metric_averaging

__all__ = [
    "BackupAndRestore",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "ModelCheckpoint",
    "ProgbarLogger",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank``, so every rank
    trains from the same weights (Horovod's signature).

    As Horovod's, it broadcasts at the end of the first batch, which covers variables that only
    come into existence then: a ``Sequential`` without an ``Input`` is built at its first batch,
    and optimizer slots at the first update. Unlike Horovod's, it also broadcasts when training
    begins if the model is built by then (so the first step starts in sync too), turns XLA off
    (Horovod's ops have none) and runs hvdkit's sync guard (:mod:`hvdkit.sync`): after the
    second batch and at each epoch end, ranks whose trainable or optimizer variables differ stop
    with an error naming the variable (``check_sync=False`` or ``HVDKIT_SYNC_CHECK=0`` turns it
    off). ``local_variables`` (and :meth:`register_local_var`) are neither broadcast nor
    checked. ``device`` is accepted for compatibility; Horovod's ops run where the variable
    lives.
    """

    def __init__(
        self,
        root_rank: int = 0,
        device: str = "",
        local_variables: list | None = None,
        *,
        check_sync: bool = True,
    ) -> None:
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.check_sync = check_sync
        self._local_ids = {id(v) for v in local_variables or []}
        self._batches = 0

    def register_local_var(self, var: keras.Variable) -> None:
        """Leave ``var`` out of the broadcast and the sync check (it differs per rank)."""
        self._local_ids.add(id(var))

    def _variables(self) -> list[keras.Variable]:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        local = self._local_ids | getattr(optimizer, "_hvdkit_local_vars", set())
        return [v for v in variables if id(v) not in local]

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._batches = 0
        turn_off_xla(self.model)
        if self.model.built and self.model.variables:
            backend.broadcast_variables(self._variables(), self.root_rank)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches == 1:
            backend.broadcast_variables(self._variables(), self.root_rank)
        elif self._batches == 2:
            self._check("after the second batch")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._check(f"at the end of epoch {epoch + 1}")

    def _check(self, where: str) -> None:
        if not (self.check_sync and sync.enabled()):
            return
        # Trainable and optimizer variables only: non-trainable ones (BatchNormalization's
        # moving statistics, dropout seeds) follow each rank's own data, as in Horovod.
        trainable = {id(v) for v in self.model.trainable_variables}
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            trainable |= {id(v) for v in optimizer.variables}
        check_sync([v for v in self._variables() if id(v) in trainable], where)


def check_sync(variables: list[keras.Variable], where: str = "") -> None:
    """Collective: raise :class:`hvdkit.sync.DivergenceError` on every rank if the ranks hold
    different values for any of ``variables`` (e.g. ``model.variables``). One small allgather.
    """
    # One variable on the host at a time (a GPU's weights are never all copied at once).
    local = np.zeros((0, 3))
    for v in variables:
        local = np.concatenate([local, sync.fingerprint([keras.ops.convert_to_numpy(v.value)])])
    gathered = backend.allgather_numpy(local, name="hvdkit.sync")
    sync.check([v.path for v in variables], gathered, where or "")


def turn_off_xla(model: keras.Model) -> None:
    """TensorFlow backend: if ``model`` would compile its step with XLA, rebuild the step
    without it (Horovod's ops have no XLA kernels)."""
    if not backend.current().has_xla or not getattr(model, "compiled", False):
        return
    if model.jit_compile:
        model.jit_compile = False
        model.make_train_function(force=True)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average epoch metrics (train and validation) over all ranks, weighted by each rank's
    sample count. Unlike Horovod's, it need not come first in the list: it hooks the model
    when training begins, so every callback (ReduceLROnPlateau, EarlyStopping, TensorBoard,
    checkpoints) sees the global values. ``device`` is accepted for compatibility."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_train_begin(self, logs: dict | None = None) -> None:
        install_metric_averaging(self.model)


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, shown by rank 0 only: in the callback list, it replaces the one
    ``fit(verbose=1)`` would add on every rank."""

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if not rank_zero.is_rank_zero():
            self.verbose = 0


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` (same arguments) saved by rank 0 only, atomically:
    a crash mid-save leaves the previous file whole. With ``save_best_only`` put it after
    :class:`MetricAverageCallback` or use :func:`hvdkit.keras.setup`'s callbacks, so the
    monitored value is the global one."""

    def _save_model(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        if not rank_zero.is_rank_zero():
            return
        filepath = self._get_file_path(epoch, batch, logs)
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        with atomic_path(filepath) as tmp:
            if self.save_weights_only:
                self.model.save_weights(tmp, overwrite=True)
            else:
                self.model.save(tmp, overwrite=True)
        if self.verbose > 0:
            rank_zero.print0(f"\nEpoch {epoch + 1}: saved model to {filepath}")


class BestModelCheckpoint(ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: keep the model with the best ``monitor`` value, saved
    by rank 0 only, atomically. Horovod leaves ``filepath`` to its Spark estimator; here it is a
    keyword argument (or set the ``filepath`` attribute before ``fit``)."""

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        *,
        filepath: str | Path | None = None,
    ) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=str(filepath) if filepath is not None else placeholder,
            monitor=monitor, verbose=verbose, save_best_only=True,
            save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
        )  # fmt: skip
        self._filepath_given = filepath is not None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self._filepath_given and self.filepath in ("best.keras", "best.weights.h5"):
            raise ValueError(
                "BestModelCheckpoint has no filepath: pass BestModelCheckpoint(filepath=...) "
                "(Horovod's Spark estimator set it; plain fit() must)"
            )
        super().on_train_begin(logs)


class BackupAndRestore(keras.callbacks.Callback):
    """Resume an interrupted ``fit`` where it stopped, on any number of ranks.

    After every epoch rank 0 writes the model's and optimizer's variables and the epoch to
    ``filepath``, atomically. When training starts, rank 0 reads that file if it exists and
    every rank gets its state by broadcast (no shared filesystem needed); ``fit`` then goes on
    from the next epoch. A bad or mismatched file stops every rank with a message naming it.

    On SIGTERM or SIGUSR1 (a scheduler's preemption warning, :mod:`hvdkit.preempt`) every rank
    checkpoints after the next batch and exits with status 75. Keras's ``fit`` cannot start
    mid-epoch, so the next run repeats that epoch from its first batch (the PyTorch session
    goes on with the next batch).
    """

    def __init__(self, filepath: str | Path, root_rank: int = 0) -> None:
        super().__init__()
        self.filepath, self.root_rank = Path(filepath), root_rank
        self._adapter: KerasAdapter | None = None
        self._preempt: preempt.Preemption | None = None
        self._epoch = 0

    @classmethod
    def for_adapter(cls, adapter: KerasAdapter) -> BackupAndRestore:
        """The callback for a model that :func:`hvdkit.keras.setup` has already resumed."""
        assert adapter.config.checkpoint is not None
        callback = cls(adapter.config.checkpoint, adapter.config.root_rank)
        callback._adapter = adapter
        return callback

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._adapter is None or self._adapter.model is not self.model:
            config = SetupConfig(checkpoint=self.filepath, root_rank=self.root_rank)
            self._adapter = KerasAdapter(self.model, self.model.optimizer, config)
            self._adapter.setup(resume_only=True)
        if self._adapter.epoch:
            self.model._initial_epoch = self._adapter.epoch
        if self._adapter.config.elastic:
            return  # an elastic job recovers from lost workers instead
        self._preempt = preempt.among(
            backend.horovod().size(),
            lambda flag, seconds: tuple(
                allgather_numpy(np.array([flag, seconds]), name="hvdkit.preempt").max(axis=0)
            ),
            preempt.agreed,
        )
        self._preempt.install()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._preempt is None or not self._preempt.step_done():
            return
        assert self._adapter is not None
        by = self._preempt.describe()
        position = {"batches": batch + 1, "signal": by}
        path = self._adapter.save_checkpoint({preempt.EXTRA: position}, next_epoch=self._epoch)
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        # On a line of its own: Keras's progress bar has not ended its line mid-epoch.
        rank_zero.print0("\n" + preempt.announce(by, self._epoch, batch + 1, step, path))
        self._preempt.uninstall()  # horovodrun's SIGTERM, once a rank is out, stops this one
        raise preempt.Preempted()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert self._adapter is not None
        self._adapter.epoch = epoch + 1
        self._adapter.save_checkpoint(next_epoch=epoch + 1)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._preempt is not None:
            self._preempt.uninstall()
            self._preempt = None
        # The next fit() in this process trains its own epochs from the start.
        self.model._initial_epoch = None
        if self._adapter is not None:
            self._adapter.epoch = 0
