"""Single-process pieces of hvdkit.keras (no Horovod job needed)."""

from __future__ import annotations

import keras
import pytest

from hvdkit.keras.lr import MultipliedSchedule, WarmupSchedule


def test_warmup_schedule_ramps_scales_and_round_trips():
    inner = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.9)
    schedule = WarmupSchedule(inner, warmup_steps=4, start=0.5)
    values = [float(schedule(step)) for step in range(6)]
    ramp = [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    assert values == pytest.approx([0.2 * 0.9**i * r for i, r in enumerate(ramp)], rel=1e-5)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert float(again(3)) == pytest.approx(values[3])
    scaled = WarmupSchedule(0.1, warmup_steps=0, start=1.0, scale=4.0)  # float inner
    assert float(scaled(0)) == pytest.approx(0.4)
    assert float(WarmupSchedule.from_config(scaled.get_config())(7)) == pytest.approx(0.4)


def test_multiplied_schedule_follows_its_variable():
    schedule = MultipliedSchedule(keras.optimizers.schedules.PolynomialDecay(1.0, 10, 0.0))
    schedule.multiplier.assign(0.5)
    assert float(schedule(5)) == pytest.approx(0.25)
    assert float(MultipliedSchedule.from_config(schedule.get_config())(5)) == pytest.approx(0.25)


def test_keras2_optimizer_gets_a_clear_error():
    tf_keras = pytest.importorskip("tf_keras")
    from hvdkit.keras import DistributedOptimizer

    with pytest.raises(TypeError, match="TF_USE_LEGACY_KERAS"):
        DistributedOptimizer(tf_keras.optimizers.SGD(0.1))


def test_xla_is_refused_and_auto_turned_off(monkeypatch):
    from hvdkit.keras.adapter import forbid_xla

    if keras.config.backend() != "tensorflow":
        pytest.skip("XLA concerns the TensorFlow backend")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    forbid_xla(model)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.compile(optimizer="sgd", loss="mse")
    assert model.jit_compile is False
