"""Single-process pieces of hvdkit.keras (no Horovod job needed)."""

from __future__ import annotations

import keras
import numpy as np
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


def _fit_counting(callbacks, epochs=3, rows=40, batch_size=8, **fit_kwargs):
    """fit() a tiny model; returns the batches run in each epoch."""
    import numpy as np

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    counts: list[int] = []
    count = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: counts.append(0),
        on_train_batch_end=lambda batch, logs: counts.__setitem__(-1, counts[-1] + 1),
    )
    x = np.zeros((rows, 2), "float32")
    model.fit(x, x[:, :1], batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[count, *callbacks], **fit_kwargs)  # fmt: skip
    return counts


def test_elastic_batch_state_cuts_only_the_first_epoch_after_a_reset():
    from types import SimpleNamespace

    from hvdkit.keras.elastic import UpdateBatchStateCallback, UpdateEpochStateCallback

    state = SimpleNamespace(batch=3, epoch=1)  # a commit at batch 3 of epoch 1 (5 per epoch)
    callbacks = [UpdateBatchStateCallback(state), UpdateEpochStateCallback(state)]
    # Horovod's way of resuming: epochs=total - state.epoch (Keras counts from 0 again).
    assert _fit_counting(callbacks, epochs=3 - state.epoch) == [2, 5]
    assert state.batch == 0 and state.epoch == 3
    state.batch, state.epoch = 4, 1  # and the other way: initial_epoch=state.epoch
    assert _fit_counting(callbacks, epochs=3, initial_epoch=state.epoch) == [1, 5]
    assert state.epoch == 3
    state.batch, state.epoch = 0, 0  # no reset: nothing cut
    assert _fit_counting(callbacks, epochs=2) == [5, 5] and state.epoch == 2


def test_elastic_batch_cut_leaves_early_stopping_listed_after_it_alone():
    from types import SimpleNamespace

    from hvdkit.keras.elastic import UpdateBatchStateCallback

    state = SimpleNamespace(batch=2, epoch=0)
    stop = keras.callbacks.LambdaCallback()
    stop.on_epoch_end = lambda epoch, logs=None: setattr(stop.model, "stop_training", True)
    assert _fit_counting([UpdateBatchStateCallback(state), stop], epochs=3) == [3]


def test_elastic_commit_callback_commits_every_n_batches_and_each_epoch_end():
    from types import SimpleNamespace

    from hvdkit.keras.elastic import CommitStateCallback

    commits: list[int] = []
    state = SimpleNamespace(commit=lambda: commits.append(1))
    _fit_counting([CommitStateCallback(state, batches_per_commit=2)], epochs=2)
    # Counted across epochs, as Horovod's: 10 batches give 5, plus 1 per epoch end.
    assert len(commits) == 10 // 2 + 2
    with pytest.raises(ValueError, match="batches_per_commit=0"):
        CommitStateCallback(state, batches_per_commit=0)


def test_sharded_optimizer_state_is_refused_with_the_reason_and_the_fix():
    import hvdkit.keras as hvd

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"per variable.*Fix: shard_optimizer=False"):
        hvd.setup(model, keras.optimizers.Adam(0.01), shard_optimizer=True)


def _built(layers: int) -> list:
    model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(3) for _ in range(layers)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    return [*model.variables, *optimizer.variables]


def test_a_model_built_again_in_the_same_process_matches_its_checkpoint_by_position():
    """A notebook's second run: Keras numbers the new layers' names on (``dense_2`` for
    ``dense``), so the saved paths are not found as they are; the same list with the numbers
    taken off pairs them by position. A model with another layer is still refused."""
    from hvdkit.checkpoint import CheckpointError
    from hvdkit.keras.adapter import KerasAdapter

    saved = _built(2)
    meta = {"counts": {"all": len(saved)}, "paths": {"all": [v.path for v in saved]}}
    arrays = {f"all.{i}": np.zeros(tuple(v.shape)) for i, v in enumerate(saved)}
    again = _built(2)
    assert [v.path for v in again] != meta["paths"]["all"]
    pairs = KerasAdapter._match("all", meta, again, arrays, "ckpt.npz")
    assert [key for _, key in pairs] == [f"all.{i}" for i in range(len(saved))]
    with pytest.raises(CheckpointError, match="variables differ"):
        KerasAdapter._match("all", meta, _built(3), arrays, "ckpt.npz")


def test_numbered_blocks_shifted_by_one_are_refused_not_loaded_by_position():
    """Blocks the user numbered (block_1..3): dropping block_1 and adding block_4 gives the
    same list with the numbers taken off, but block_2's weights must not go to another
    block."""
    from types import SimpleNamespace

    from hvdkit.checkpoint import CheckpointError
    from hvdkit.keras.adapter import KerasAdapter

    def blocks(numbers):
        return [SimpleNamespace(path=f"model/block_{n}/kernel", shape=(3, 3)) for n in numbers]

    saved = blocks([1, 2, 3])
    meta = {"counts": {"model": 3}, "paths": {"model": [v.path for v in saved]}}
    arrays = {f"model.{i}": np.zeros((3, 3)) for i in range(3)}
    with pytest.raises(CheckpointError, match="variables differ"):
        KerasAdapter._match("model", meta, blocks([2, 3, 4]), arrays, "ckpt.npz")
