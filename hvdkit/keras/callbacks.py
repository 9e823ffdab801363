"""Keras 3 ``fit()`` callbacks with Horovod's names."""

from __future__ import annotations

import keras

from hvdkit.keras import backend


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
