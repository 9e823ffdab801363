"""Horovod's elastic API for Keras 3 (``horovod.tensorflow.keras.elastic``), on the TensorFlow,
PyTorch and JAX backends: ``run``, ``KerasState``, ``CommitStateCallback``,
``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``.

    import hvdkit.keras as hvd          # was: import horovod.tensorflow.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

What differs from Horovod's:

- It works on Keras 3. Horovod's state calls ``optimizer.variables()``, a list property in
  Keras 3, so it fails at its first commit; its ``run`` only recognises a lost peer in
  TensorFlow errors from ``HorovodAllreduce``/``HorovodAllgather``/``HorovodBroadcast`` ops,
  and Keras's gradients go through ``HorovodGroupedAllreduce``.
- The optimizer is built (its slots created) when the state is made, so a worker that joins
  before its first step has the same variables as the survivors to sync.
- After a reset the model's compiled train step is dropped and traced again, so nothing from
  the old world size stays baked into it.
- ``state.batch`` is the number of batches done in the epoch (Horovod's holds the last
  batch's index, one less, so its shortened epoch ran one batch again).
- ``UpdateBatchStateCallback`` really shortens the first epoch after a reset by the batches
  already done. Horovod's lowers ``params['steps']``, which Keras 3's loop no longer reads, so
  there the epoch ran in full. The cut ends the epoch through ``model.stop_training`` and puts
  it back at the epoch's end: list this callback before callbacks that stop training
  themselves (``EarlyStopping``), as the example does.

- On JAX a reset restarts each worker process from the last commit
  (:mod:`hvdkit.elastic_restart`): JAX's runtime cannot change its processes. What the
  script keeps outside the state starts again from the top.

The learning rate, as in Horovod, is the script's to rescale after a reset (a reset callback;
``examples/keras_elastic.py`` shows it): the state commits and syncs the optimizer's LR
variable as it is.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import keras
import numpy as np
from horovod.common.exceptions import HorovodInternalError

from hvdkit import elastic_restart
from hvdkit.elastic import ElasticState, Handler, make_run
from hvdkit.keras import backend


class VariablesHandler(Handler):
    """Keeps a model's or an optimizer's Keras variables committed: numpy copies in host
    memory, assigned back on restore, broadcast from rank 0 on sync."""

    def variables(self) -> list[keras.Variable]:
        local: set[int] = getattr(self.value, "_hvdkit_local_vars", set())
        return [v for v in self.value.variables if id(v) not in local]

    def save(self) -> None:
        self.saved = [np.array(keras.ops.convert_to_numpy(v.value)) for v in self.variables()]

    def restore(self) -> None:
        for variable, value in zip(self.variables(), self.saved, strict=True):
            variable.assign(value)

    def sync(self) -> None:
        backend.broadcast_variables(self.variables(), root_rank=0)
        self.save()


class KerasState(ElasticState):
    """Horovod's ``KerasState(model, optimizer=None, **kwargs)``: the model's and the
    optimizer's variables (weights, slots, iteration count, LR) and the plain values in
    ``kwargs`` (``epoch``, ``batch``...), committed in host memory and synced from rank 0.
    ``optimizer`` defaults to the model's compiled one. The model must be built."""

    HANDLERS: ClassVar[list[tuple[type, type[Handler]]]] = [
        (keras.Model, VariablesHandler),
        (keras.optimizers.Optimizer, VariablesHandler),
    ]

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError(
                "KerasState: the model must be built first, so that every rank has its weights "
                "to commit and sync. Fix: give it an input shape (keras.Input) or call "
                "model.build(input_shape) before making the state"
            )
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "KerasState: no optimizer. Fix: compile the model first or pass optimizer="
            )
        if not optimizer.built:
            # A joining worker must have the survivors' variables to receive them in sync.
            optimizer.build(model.trainable_variables)
        hvd = backend.horovod()
        super().__init__(
            bcast_object=backend.broadcast_object,
            get_rank=hvd.rank,
            model=model,
            optimizer=optimizer,
            **kwargs,
        )
        committed = elastic_restart.take_committed()
        self.restarted = committed is not None
        if committed is not None:  # this process restarted at a reset (Keras on JAX)
            self.load_committed(committed)

    def save(self) -> None:
        backend.write_back(self.model)
        super().save()

    def reset(self) -> None:
        drop_compiled(self.model)


def drop_compiled(model: keras.Model) -> None:
    """After a reset: the compiled train/test/predict steps may hold values of the old world;
    Keras traces them again at their next use."""
    for name in ("train_function", "test_function", "predict_function"):
        setattr(model, name, None)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch end. Unlike
    Horovod's, ``batches_per_commit`` below 1 is refused (Horovod's then silently commits at
    epoch ends only)."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit={batches_per_commit}: use 1 or more")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Counted from each (re)start of fit(), so all ranks commit at the same batches.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of batches done in this epoch (0 at its end), and
    make the first epoch after a reset run only the batches it had left."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._skip = 0
        self._cut = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._skip = int(self.state.batch)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._cut = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self._skip + batch + 1
        steps = (self.params or {}).get("steps")
        if self._skip and steps and self.state.batch >= steps:
            self.model.stop_training = self._cut = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._cut:
            self.model.stop_training = False
        self._skip = 0
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs done, counted across resets. Both ways of
    resuming ``fit`` count right: Horovod's ``epochs=total - state.epoch`` (Keras counts from
    0 again) and ``epochs=total, initial_epoch=state.epoch``."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = int(state.epoch)
        self._first: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = int(self.state.epoch)
        self._first = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        first = epoch if self._first is None else self._first
        self.state.epoch = self.initial_epoch + (epoch - first) + 1


def translate(error: BaseException) -> BaseException | None:
    """``HorovodInternalError`` for TensorFlow's error from a failed Horovod op (its own error
    type, naming the op) and for JAX's from a failed collective of the compiled step; None
    for any other error."""
    module, text = type(error).__module__, str(error)
    if module.startswith("tensorflow") and "Horovod" in text:
        return HorovodInternalError(error)
    if re.search(r"\b(Gloo|NCCL) [\w-]+ failed", text):  # JAX's (its own type, or ValueError)
        return HorovodInternalError(error)
    return None


class _Horovod:
    # make_run calls shutdown/init/rank/size at reset time: through the active backend.
    def __getattr__(self, name: str) -> Any:
        return getattr(backend.horovod(), name)


def _restarts() -> bool:
    # JAX's runtime cannot change its processes: a reset restarts each worker process.
    return keras.config.backend() == "jax"


run = make_run(_Horovod(), translate=translate, restarts=_restarts)
run.__doc__ = """``@hvdkit.keras.elastic.run`` on ``train(state, ...)``: Horovod's elastic
loop. On a lost or added worker, every rank restores ``state``'s last commit, Horovod is
re-initialised at the new size, and ``train`` runs again from the synced state."""

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
