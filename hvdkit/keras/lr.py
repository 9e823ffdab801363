"""Learning-rate warmup for Keras 3 that works with a float LR *and* a LearningRateSchedule.

Horovod's semantics: the optimizer is built with the scaled LR (``lr * size``) and the first
``warmup_epochs`` ramp linearly from ``lr`` (a ``1 / size`` share) up to it (Goyal et al. 2017).
With a schedule the ramp multiplies the schedule's value, inside the compiled step; with a
float the callback assigns the LR before each batch.
"""

from __future__ import annotations

from typing import Any

import keras

from hvdkit.keras import backend
from hvdkit.lr import Warmup


class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``inner(step) * ramp(step)`` with ramp going linearly from ``1/size`` to 1 over
    ``warmup_steps`` optimizer steps."""

    def __init__(self, inner: Any, warmup_steps: int, size: int) -> None:
        self.inner, self.warmup_steps, self.size = inner, warmup_steps, size

    def ramp(self, step: Any) -> Any:
        progress = keras.ops.minimum(
            keras.ops.cast(step, "float32") / max(1, self.warmup_steps), 1.0
        )
        start = 1.0 / self.size
        return start + (1.0 - start) * progress

    def __call__(self, step: Any) -> Any:
        base = self.inner(step) if callable(self.inner) else self.inner
        return base * self.ramp(step)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WarmupSchedule:
        inner = keras.saving.deserialize_keras_object(config["inner"])
        return cls(inner, config["warmup_steps"], config["size"])

    def get_config(self) -> dict[str, Any]:
        return {
            "inner": keras.saving.serialize_keras_object(self.inner),
            "warmup_steps": self.warmup_steps,
            "size": self.size,
        }


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the LR from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    ``initial_lr`` is the scaled LR the optimizer was built with (Horovod's convention). When
    the optimizer's LR is a ``LearningRateSchedule``, ``initial_lr`` may be None and the
    schedule's own values are ramped instead. ``steps_per_epoch`` defaults to what ``fit``
    knows.
    """

    def __init__(
        self,
        initial_lr: float | None = None,
        warmup_epochs: float = 5,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.warmup_steps = 0
        self._schedule = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmupCallback needs steps_per_epoch: fit() does not know it for "
                "this input (e.g. an unsized generator); pass steps_per_epoch=..."
            )
        self.warmup_steps = max(1, round(self.warmup_epochs * steps))
        optimizer = self.model.optimizer
        lr = optimizer._learning_rate
        self._schedule = isinstance(lr, keras.optimizers.schedules.LearningRateSchedule)
        if self._schedule:
            if not isinstance(lr, WarmupSchedule):
                optimizer._learning_rate = WarmupSchedule(
                    lr, self.warmup_steps, backend.horovod().size()
                )
        elif self.initial_lr is None:
            raise ValueError(
                "LearningRateWarmupCallback: the optimizer has a float LR, so pass "
                "initial_lr (the scaled LR, e.g. 0.001 * hvd.size())"
            )

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._schedule:
            return
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if step <= self.warmup_steps:
            size = backend.horovod().size()
            ramp = Warmup(factor=float(size), steps=self.warmup_steps).multiplier(step) / size
            self.model.optimizer.learning_rate = self.initial_lr * ramp
