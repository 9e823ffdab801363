"""Keras 3 ``fit()`` callbacks with Horovod's names, plus rank-0 checkpointing, resume and
a progress bar printed once."""

from __future__ import annotations

from pathlib import Path

import keras

from hvdkit import rank_zero
from hvdkit.checkpoint import atomic_path
from hvdkit.core import SetupConfig
from hvdkit.keras import backend
from hvdkit.keras.adapter import KerasAdapter
from hvdkit.keras.lr import LearningRateScheduleCallback, LearningRateWarmupCallback
from hvdkit.keras.metrics import install_metric_averaging

__all__ = [
    "BackupAndRestore",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "ModelCheckpoint",
    "ProgbarLogger",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables (and the optimizer's, once built) from ``root_rank``
    when training starts, so every rank begins from the same weights."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs: dict | None = None) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        backend.broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average epoch metrics (train and validation) over all ranks, weighted by each rank's
    sample count. Unlike Horovod's, it need not come first in the list: it hooks the model
    when training begins, so every callback (ReduceLROnPlateau, EarlyStopping, TensorBoard,
    checkpoints) sees the global values."""

    def on_train_begin(self, logs: dict | None = None) -> None:
        install_metric_averaging(self.model)


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, shown by rank 0 only: in the callback list, it replaces the one
    ``fit(verbose=1)`` would add on every rank."""

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if backend.horovod().rank() != 0:
            self.verbose = 0


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` (same arguments) saved by rank 0 only, atomically:
    a crash mid-save leaves the previous file whole. With ``save_best_only`` put it after
    :class:`MetricAverageCallback` or use :func:`hvdkit.keras.setup`'s callbacks, so the
    monitored value is the global one."""

    def _save_model(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        if backend.horovod().rank() != 0:
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


class BackupAndRestore(keras.callbacks.Callback):
    """Resume an interrupted ``fit`` where it stopped, on any number of ranks.

    After every epoch rank 0 writes the model's and optimizer's variables and the epoch to
    ``filepath``, atomically. When training starts, rank 0 reads that file if it exists and
    every rank gets its state by broadcast (no shared filesystem needed); ``fit`` then goes on
    from the next epoch. A bad or mismatched file stops every rank with a message naming it.
    """

    def __init__(self, filepath: str | Path, root_rank: int = 0) -> None:
        super().__init__()
        self.filepath, self.root_rank = Path(filepath), root_rank
        self._adapter: KerasAdapter | None = None

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
            self._adapter.resume()
        if self._adapter.epoch:
            self.model._initial_epoch = self._adapter.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert self._adapter is not None
        self._adapter.epoch = epoch + 1
        self._adapter.save_checkpoint(next_epoch=epoch + 1)

    def on_train_end(self, logs: dict | None = None) -> None:
        # The next fit() in this process trains its own epochs from the start.
        self.model._initial_epoch = None
        if self._adapter is not None:
            self._adapter.epoch = 0
