"""Single-process pieces of hvdkit.keras (no Horovod job needed)."""

from __future__ import annotations

import keras
import pytest

from hvdkit.keras.lr import WarmupSchedule


def test_warmup_schedule_ramps_and_round_trips():
    inner = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.9)
    schedule = WarmupSchedule(inner, warmup_steps=4, size=2)
    values = [float(schedule(step)) for step in range(6)]
    ramp = [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    assert values == pytest.approx([0.2 * 0.9**i * r for i, r in enumerate(ramp)], rel=1e-5)
    again = WarmupSchedule.from_config(schedule.get_config())
    assert float(again(3)) == pytest.approx(values[3])
