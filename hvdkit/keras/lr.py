"""Learning-rate callbacks for Keras 3 that work with a float LR *and* a LearningRateSchedule.

Horovod's semantics: the optimizer is built with the scaled LR (``lr * size``) and the first
``warmup_epochs`` ramp linearly from ``lr`` (a ``1 / size`` share) up to it (Goyal et al. 2017);
``LearningRateScheduleCallback`` sets ``initial_lr * multiplier(epoch)`` within its epochs.
With a float LR the callbacks assign the LR before each batch; with a schedule they wrap it
in a schedule computed inside the compiled step (a float cannot be assigned there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras.optimizers.schedules import LearningRateSchedule as Schedule

from hvdkit import rank_zero
from hvdkit.keras import backend
from hvdkit.lr import ramp


def _value(inner: Any, step: Any) -> Any:
    return inner(step) if callable(inner) else inner


def find_schedule(lr: Any, kind: type) -> Any:
    """The ``kind`` wrapper in a chain of hvdkit schedules around ``lr`` (None if absent), so a
    second ``fit`` does not wrap twice."""
    while isinstance(lr, Schedule):
        if isinstance(lr, kind):
            return lr
        lr = getattr(lr, "inner", None)
    return None


@keras.saving.register_keras_serializable(package="hvdkit")
class WarmupSchedule(Schedule):
    """``inner(step) * scale * ramp(step)``: the ramp goes linearly from ``start`` to 1 over
    ``warmup_steps`` optimizer steps, reaching ``start + (1 - start) * offset / warmup_steps``
    at step 0 (``offset=1`` is Horovod's warmup: full LR on the last warmup step). ``inner`` is
    a schedule or a float."""

    def __init__(
        self, inner: Any, warmup_steps: int, start: float, scale: float = 1.0, offset: int = 0
    ) -> None:
        self.inner, self.warmup_steps = inner, warmup_steps
        self.start, self.scale, self.offset = start, scale, offset

    def __call__(self, step: Any) -> Any:
        share = ramp(
            keras.ops.cast(step, "float32"), self.warmup_steps, self.start, self.offset,
            minimum=keras.ops.minimum,
        )  # fmt: skip
        return _value(self.inner, step) * (self.scale * share)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WarmupSchedule:
        config = dict(config)
        inner = config.pop("inner")
        if isinstance(inner, dict):
            inner = keras.saving.deserialize_keras_object(inner)
        return cls(inner, **config)

    def get_config(self) -> dict[str, Any]:
        inner = self.inner
        return {
            "inner": keras.saving.serialize_keras_object(inner)
            if isinstance(inner, Schedule)
            else float(inner),
            "warmup_steps": self.warmup_steps,
            "start": self.start,
            "scale": self.scale,
            "offset": self.offset,
        }


@keras.saving.register_keras_serializable(package="hvdkit")
class MultipliedSchedule(Schedule):
    """``inner(step) * multiplier``, the multiplier a variable the schedule callbacks assign."""

    def __init__(self, inner: Any, multiplier: float = 1.0) -> None:
        self.inner = inner
        self.multiplier = keras.Variable(
            multiplier, dtype="float32", trainable=False, name="hvdkit_lr_multiplier"
        )

    def __call__(self, step: Any) -> Any:
        return _value(self.inner, step) * self.multiplier

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MultipliedSchedule:
        return cls(keras.saving.deserialize_keras_object(config["inner"]), config["multiplier"])

    def get_config(self) -> dict[str, Any]:
        return {
            "inner": keras.saving.serialize_keras_object(self.inner),
            "multiplier": float(keras.ops.convert_to_numpy(self.multiplier)),
        }


def _steps_per_epoch(callback: keras.callbacks.Callback, given: int | None) -> int:
    steps = given or (callback.params or {}).get("steps")
    if not steps:
        raise ValueError(
            f"{type(callback).__name__} needs steps_per_epoch: fit() does not know it for this "
            "input (e.g. an unsized generator); pass steps_per_epoch=..."
        )
    return int(steps)


def lr_holder(optimizer: keras.optimizers.Optimizer) -> Any:
    """What holds ``optimizer``'s LR: its schedule, or the variable a float LR lives in.

    The one read of Keras's private ``_learning_rate``: Keras 3's public ``learning_rate``
    gives a schedule's current value, not the schedule, and there is no other way to find out
    whether an LR is scheduled (hvdkit scales a schedule by wrapping it, a float by setting it).
    """
    return optimizer._learning_rate


def _current_lr(optimizer: keras.optimizers.Optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's warmup: ramp the LR linearly from ``initial_lr / size`` to ``initial_lr`` over
    the first ``warmup_epochs``, batch by batch, reaching ``initial_lr`` on the last warmup
    batch (Goyal et al. 2017).

    As Horovod's, the ramp is keyed on the epoch and batch of ``fit`` (not on optimizer
    updates, so ``backward_passes_per_step`` does not slow it). ``initial_lr`` is the scaled LR
    the optimizer was built with; None (an hvdkit extra) means the optimizer's LR when training
    starts. With a ``LearningRateSchedule`` the schedule's own values are ramped, inside the
    compiled step. ``steps_per_epoch`` defaults to what ``fit`` knows. hvdkit extras:
    ``warmup_steps`` replaces ``warmup_epochs``; ``start`` (default ``1 / size``) is the share of
    the LR the ramp starts from; ``offset=0`` ramps from ``start`` itself at the first batch
    (the full LR one batch after the warmup; :func:`hvdkit.keras.setup` uses it so the ramp
    matches hvdkit.torch's). ``momentum_correction`` is accepted; Keras 3 compiles the
    momentum into the step, so it is not adjusted (see :class:`LearningRateScheduleCallback`).
    """

    def __init__(
        self,
        initial_lr: float | None = None,
        warmup_epochs: float = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
        *,
        warmup_steps: int | None = None,
        start: float | None = None,
        offset: int = 1,
    ) -> None:
        super().__init__()
        self.offset = offset
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.warmup_steps = warmup_steps or 0
        self._fixed_steps = warmup_steps is not None
        self.start = start
        self._schedule = False
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = _steps_per_epoch(self, self.steps_per_epoch)
        if not self._fixed_steps:
            self.warmup_steps = max(1, round(self.warmup_epochs * self.steps_per_epoch))
        if self.start is None:
            self.start = 1.0 / backend.horovod().size()
        optimizer = self.model.optimizer
        lr = lr_holder(optimizer)
        self._schedule = isinstance(lr, Schedule)
        if self._schedule:
            if find_schedule(lr, WarmupSchedule) is None:
                optimizer.learning_rate = WarmupSchedule(
                    lr, self.warmup_steps, self.start, offset=self.offset
                )
        elif self.initial_lr is None:
            self.initial_lr = _current_lr(optimizer)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._schedule:
            return
        assert self.steps_per_epoch is not None and self.initial_lr is not None  # train begin
        assert self.start is not None
        step = self._epoch * self.steps_per_epoch + batch
        if step + self.offset <= self.warmup_steps:  # the last one sets the full LR
            self.model.optimizer.learning_rate = self.initial_lr * ramp(
                step, self.warmup_steps, self.start, self.offset
            )
            if self.verbose and step + self.offset == self.warmup_steps:
                rank_zero.print0(
                    f"\nEpoch {self._epoch + 1}: finished gradual learning rate warmup to "
                    f"{self.initial_lr:g}."
                )


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the LR to ``initial_lr * multiplier(epoch)`` for ``start_epoch <= epoch < end_epoch``
    (Horovod's callback; several of them make a piecewise schedule).

    ``multiplier`` is a function of the epoch, or a number ``m`` meaning ``m ** (epoch -
    start_epoch)`` (Horovod's exponential decay); with ``staircase=False`` it is called every
    batch with a fractional epoch. ``initial_lr`` None means the optimizer's LR
    when training starts. With a ``LearningRateSchedule`` the schedule's values are multiplied
    instead. ``momentum_correction`` is accepted for compatibility only: Keras 3 compiles the
    momentum into the step, so it cannot be adjusted for the one step after a change.
    """

    def __init__(
        self,
        initial_lr: float | None,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            # Horovod: a constant multiplier is an exponential decay from start_epoch.
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._scaled: MultipliedSchedule | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = self.model.optimizer
        lr = lr_holder(optimizer)
        if isinstance(lr, Schedule):
            self._scaled = find_schedule(lr, MultipliedSchedule)
            if self._scaled is None:
                self._scaled = MultipliedSchedule(lr)
                optimizer.learning_rate = self._scaled
        elif self.initial_lr is None:
            self.initial_lr = _current_lr(optimizer)
        if not self.staircase:
            self.steps_per_epoch = _steps_per_epoch(self, self.steps_per_epoch)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._epoch < self.start_epoch or (
            self.end_epoch is not None and self._epoch >= self.end_epoch
        ):
            return
        if self.staircase:
            if batch == 0:
                self._set(self.multiplier(self._epoch))
        else:
            assert self.steps_per_epoch is not None  # set at train begin
            self._set(self.multiplier(self._epoch + batch / self.steps_per_epoch))

    def _set(self, multiplier: float) -> None:
        if self._scaled is not None:
            self._scaled.multiplier.assign(float(multiplier))
        else:
            assert self.initial_lr is not None  # set at train begin
            self.model.optimizer.learning_rate = self.initial_lr * multiplier

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _current_lr(self.model.optimizer)
