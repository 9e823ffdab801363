"""Keras 3 ``fit()`` callbacks with Horovod's names."""

from __future__ import annotations

import keras

from hvdkit.keras import backend
from hvdkit.keras.lr import LearningRateWarmupCallback
from hvdkit.keras.metrics import install_metric_averaging

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
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
