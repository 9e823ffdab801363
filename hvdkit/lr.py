"""Learning-rate scaling by world size, with linear warmup (Goyal et al. 2017). Pure.

With N workers the effective batch is N times larger, so the learning rate is scaled by N
(``size``); Adasum adapts to the batch itself and only needs the local GPU count
(``local_size``). The jump is made gradually: the multiplier ramps linearly from 1 (the
single-process LR) to the full factor over the warmup, then stays there. The multiplier is
applied on top of whatever LR the user's own scheduler sets, so both compose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

LrScaling = Literal["size", "local_size", "none"]
LR_POLICIES: tuple[str, ...] = get_args(LrScaling)


def ramp(
    step: Any,
    steps: int,
    start: float,
    offset: int = 0,
    minimum: Callable[[Any, float], Any] = min,
) -> Any:
    """The warmup ramp, one formula for every LR path (torch's step multiplier, the Keras
    schedule and the Keras warmup callback): ``start + (1 - start) * progress``, where progress
    is ``(step + offset) / steps`` capped at 1, and 1 from the start when ``steps`` is 0.
    ``offset=1`` is Horovod's warmup, which reaches the full value on the last warmup step.
    ``step`` may be a framework tensor (pass the framework's ``minimum``), so the Keras
    schedule computes it inside the compiled step.

    Example: ``ramp(2, steps=4, start=0.5) == 0.75``."""
    progress = 1.0 if steps == 0 else minimum((step + offset) / steps, 1.0)
    return start + (1.0 - start) * progress


def scale_factor(policy: LrScaling, size: int, local_size: int) -> float:
    """The LR multiplier after warmup for ``policy`` (``size``, ``local_size`` or ``none``)."""
    if policy == "size":
        return float(size)
    if policy == "local_size":
        return float(local_size)
    if policy == "none":
        return 1.0
    raise ValueError(f"lr_scaling={policy!r}: use one of {', '.join(LR_POLICIES)}")


@dataclass(frozen=True, kw_only=True)
class Warmup:
    """Linear warmup of the LR multiplier from 1 to ``factor`` over ``steps`` optimizer steps.

    Example: 4 workers, 100 warmup steps::

        w = Warmup(factor=4.0, steps=100)
        w.multiplier(0) == 1.0; w.multiplier(50) == 2.5; w.multiplier(100) == 4.0
    """

    factor: float
    steps: int = 0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"LR scale factor must be > 0, got {self.factor}")
        if self.steps < 0:
            raise ValueError(f"warmup steps must be >= 0, got {self.steps}")

    def multiplier(self, step: int) -> float:
        """The multiplier in force for optimizer step ``step`` (0-based)."""
        return self.factor * ramp(step, self.steps, start=1.0 / self.factor)


def warmup_steps(*, epochs: float = 0.0, steps: int = 0, steps_per_epoch: int | None = None) -> int:
    """Warmup length in optimizer steps, from either ``epochs`` (needs ``steps_per_epoch``) or
    ``steps``, not both."""
    if epochs and steps:
        raise ValueError("give warmup_epochs or warmup_steps, not both")
    if epochs < 0 or steps < 0:
        raise ValueError("warmup_epochs and warmup_steps must be >= 0")
    if epochs:
        if not steps_per_epoch:
            raise ValueError(
                "warmup_epochs needs the number of steps per epoch: pass steps_per_epoch, or "
                "use warmup_steps"
            )
        return max(1, round(epochs * steps_per_epoch))
    return steps
