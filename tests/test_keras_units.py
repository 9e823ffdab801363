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


def test_from_config_keeps_the_distributed_wrapper():
    import hvdkit.keras as hvd
    from hvdkit.keras.optimizer import WRAPPED

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), op=hvd.Sum, sparse_as_dense=True)
    assert type(opt).__name__ == "Adam" and isinstance(opt, keras.optimizers.Adam)
    for rebuilt in (opt.from_config(opt.get_config()), type(opt).from_config(opt.get_config())):
        assert getattr(rebuilt, WRAPPED, False)
        assert rebuilt._hvdkit_options == opt._hvdkit_options
        assert rebuilt.get_config() == opt.get_config()
    # A saved config names the plain class: the model loads without hvdkit.
    saved = keras.saving.serialize_keras_object(opt)
    assert saved["class_name"] == "Adam"
    plain = keras.saving.deserialize_keras_object(saved)
    assert not getattr(plain, WRAPPED, False)
    assert hvd.DistributedOptimizer(opt) is opt  # wrapping twice is a no-op


def test_distributed_optimizer_takes_horovods_signature():
    import inspect

    import hvdkit.keras as hvd

    params = list(inspect.signature(hvd.DistributedOptimizer).parameters)
    assert params == [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "backward_passes_per_step",
        "average_aggregated_gradients", "num_groups", "groups", "process_set",
        "scale_local_gradients",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="only supported with op=Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2)


def test_fused_groups_follow_horovods_rules():
    from hvdkit.keras.backend import dense_groups, split_evenly

    assert split_evenly(list(range(6)), 4) == [[0, 1], [2, 3], [4], [5]]  # longer runs first
    assert split_evenly([0, 1], 3) == [[0], [1]]  # no empty group
    assert dense_groups([0, 1, 2, 3], None) == [[0, 1, 2, 3]]
    assert dense_groups([], None) == []
    # Listed together stay together; a sparse (non-dense) index is dropped; the rest alone.
    assert dense_groups([0, 1, 3, 4], [[4, 0, 2], [1, 1]]) == [[4, 0], [1], [3]]


def test_groups_are_checked_like_horovods():
    import hvdkit.keras as hvd

    v, w = keras.Variable([1.0]), keras.Variable([2.0])
    for bad in (0, -1, 1.5, "2", [v]):
        with pytest.raises(ValueError, match="groups"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=bad)
    with pytest.warns(DeprecationWarning, match="num_groups"):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=3)
    assert opt._hvdkit_options.groups == 3
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=[[v, w]], device_dense="/cpu:0")
    assert opt._hvdkit_options.groups == ((id(v), id(w)),)
    assert opt._hvdkit_options.device_dense == "/cpu:0"


def test_accumulation_refuses_loss_scaling_and_get_gradients_says_what_to_do():
    import hvdkit.keras as hvd

    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        hvd.DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), backward_passes_per_step=2
        )
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD())
    with pytest.raises(AttributeError, match="apply_gradients"):
        opt.get_gradients(None, [])
    assert opt._agg_helper is None  # Horovod's, without accumulation
