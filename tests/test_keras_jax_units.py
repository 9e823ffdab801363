"""The pure parts of hvdkit.keras on JAX, and its Horovod wrapper over stand-in ops
(tests/test_keras_jax.py and tests/test_keras_collectives_grid.py run the real thing)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hvdkit import jax_world
from hvdkit.keras.backends import jax as on_jax


def test_batch_plan_of_arrays_and_of_other_inputs():
    arrays = SimpleNamespace(_num_samples=9, _batch_size=4, num_batches=3)
    assert on_jax.batch_plan(arrays) == ("rows", 9, "batch size", 4)
    assert on_jax.batch_plan(SimpleNamespace(num_batches=None)) == ("batches", None)


def test_unequal_inputs_name_each_rank_and_the_fix():
    same = ("rows", 8, "batch size", 4)
    assert on_jax.unequal_batches_message([same, same]) is None
    message = on_jax.unequal_batches_message([same, ("rows", 7, "batch size", 4)])
    assert "rank 0: rows 8 batch size 4; rank 1: rows 7 batch size 4" in message
    assert "hvd.shard(x, y)" in message and "len(x) % hvd.size()" in message


def test_async_and_in_place_ops_are_refused_with_the_op_to_use():
    ops = {name: lambda *a, **k: None for name in on_jax.TENSOR_OPS}
    hvd = on_jax.HorovodOnJax(SimpleNamespace(**ops, rank=lambda: 3))
    assert hvd.rank() == 3  # queries are Horovod's own
    for name, op in (("allreduce_async", "allreduce"), ("broadcast_", "broadcast"),
                     ("synchronize", "synchronize")):  # fmt: skip
        with pytest.raises(AttributeError, match=rf"use the result of hvd\.{op}\("):
            getattr(hvd, name)


def test_the_coordinator_comes_from_jax_coordinator_address_when_set(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.5:4321")
    assert jax_world._coordinator(SimpleNamespace()) == "10.0.0.5:4321"


def test_rank_0_picks_a_port_and_broadcasts_the_address(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    sent = {}

    def broadcast_object(obj, root_rank, name):
        sent.update(obj=obj, root=root_rank)
        return obj

    one_host = SimpleNamespace(rank=lambda: 0, size=lambda: 2, local_size=lambda: 2,
                               broadcast_object=broadcast_object)  # fmt: skip
    address = jax_world._coordinator(one_host)
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536 and sent["root"] == 0


def test_xla_threads_are_the_users_when_chosen_and_ours_again_after_a_restart():
    assert not on_jax.threads_chosen({})
    assert on_jax.threads_chosen({"PJRT_NPROC": "3"}) and on_jax.threads_chosen({"NPROC": "2"})
    inherited = {"PJRT_NPROC": "1", "HVDKIT_PJRT_NPROC": "1"}  # an elastic restart's
    assert not on_jax.threads_chosen(inherited)
    assert on_jax.threads_chosen({"PJRT_NPROC": "4", "HVDKIT_PJRT_NPROC": "1"})


def _two_equal_ranks():
    """horovod.torch's tensor ops as two ranks holding this rank's tensor would give them."""
    import torch

    def alltoall(t, splits=None, **kwargs):
        return t.clone(), torch.tensor([len(t)], dtype=torch.int32)

    return on_jax.HorovodOnJax(SimpleNamespace(
        allreduce=lambda t, **kwargs: t + t, grouped_allreduce=lambda ts, **kwargs: ts,
        allgather=lambda t, **kwargs: torch.cat([t, t]), grouped_allgather=lambda ts, **k: ts,
        broadcast=lambda t, root_rank, **kwargs: t.clone(), alltoall=alltoall,
        reducescatter=lambda t, **kwargs: (t + t)[: len(t) // 2],
        grouped_reducescatter=lambda ts, **kwargs: ts, Sum="Sum",
    ))  # fmt: skip


def test_64_bit_values_keep_their_dtype_and_value_without_x64():
    # Issue 49 (12): JAX without x64 made these int32 and float32: an int64 sum of 2**40 + 1
    # over 2 ranks came back as int32 2.
    import jax

    assert not jax.config.jax_enable_x64
    hvd = _two_equal_ranks()
    big = np.array([2**40 + 1, -(2**62)], np.int64)
    summed = hvd.allreduce(big)
    assert isinstance(summed, jax.Array) and summed.dtype == np.int64
    assert np.asarray(summed).tolist() == [2**41 + 2, -(2**63)]
    assert hvd.allgather(big).dtype == np.int64
    precise = np.array([1 + 2**-40], np.float64)
    same = hvd.broadcast(precise, 0)
    assert same.dtype == np.float64 and np.asarray(same)[0] == 1 + 2**-40
    unsigned = hvd.broadcast(np.array([2**63 + 1], np.uint64), 0)  # carried as int64
    assert unsigned.dtype == np.uint64 and int(np.asarray(unsigned)[0]) == 2**63 + 1
    received, splits = hvd.alltoall(big, splits=[1, 1])
    assert received.dtype == np.int64 and np.asarray(received).tolist() == big.tolist()


def test_host_values_keep_numpy_and_jax_dtypes_and_type_python_values_as_keras_does():
    import jax.numpy as jnp

    assert on_jax.host_value(np.float64(0.1)).dtype == np.float64
    assert on_jax.host_value(jnp.arange(3, dtype="int32")).dtype == np.int32
    assert on_jax.host_value(np.arange(3, dtype=np.int64)).dtype == np.int64
    # Python numbers and lists: as Keras types them on TensorFlow and torch.
    assert on_jax.host_value(3).dtype == np.int32 and on_jax.host_value([1, 2]).dtype == np.int32
    assert on_jax.host_value(2**40 + 1).dtype == np.int64
    assert on_jax.host_value(2**40 + 1) == 2**40 + 1
    assert on_jax.host_value(0.5).dtype == np.float32 and on_jax.host_value(True).dtype == bool


def test_a_traced_value_is_refused_with_where_to_call_instead():
    import jax

    with pytest.raises(TypeError, match="traced JAX value .* jit_compile=False"):
        jax.jit(on_jax.host_value)(np.ones(2, np.float32))
    assert not on_jax.JaxBackend().holds_global_batch(np.ones(2))  # this rank's own rows
    assert jax.jit(lambda x: on_jax.JaxBackend().holds_global_batch(x) and x)(1.0)  # traced


def test_dtypes_horovod_does_not_take_are_refused_by_name_and_bool_is_moved():
    hvd = _two_equal_ranks()
    for dtype in ("int8", "uint8", "int16", "bool"):
        refused = rf"hvd\.allreduce: Horovod does not reduce {dtype} tensors on KERAS_BACKEND=jax"
        with pytest.raises(TypeError, match=refused + ".*Fix: cast"):
            hvd.allreduce(np.zeros(2, dtype))
    import ml_dtypes

    with pytest.raises(TypeError, match="does not reduce bfloat16 tensors"):
        hvd.reducescatter(np.zeros(2, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="does not move complex64 tensors"):
        hvd.broadcast(np.zeros(2, np.complex64), 0)
    moved = hvd.broadcast(np.array([True, False]), 0)  # carried as uint8, as TF's Horovod moves it
    assert moved.dtype == bool and np.asarray(moved).tolist() == [True, False]
    gathered = hvd.allgather(np.array([1.5], ml_dtypes.bfloat16))
    assert gathered.dtype == ml_dtypes.bfloat16 and np.asarray(gathered).tolist() == [1.5, 1.5]


def test_the_sync_guard_and_metric_averages_keep_float64_on_jax():
    """Issue 49 (12): the sync guard's float64 fingerprints and the metric averages went
    through Keras's convert_to_tensor, float32 on JAX without x64. Keras's backend is chosen
    when it is imported: a process of its own with KERAS_BACKEND=jax."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = "import test_keras_jax_units as t; t.float64_on_jax()"
    out = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "KERAS_BACKEND": "jax"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def float64_on_jax() -> None:
    import keras

    from hvdkit.keras import backend, metrics

    assert keras.backend.backend() == "jax"
    hvd = _two_equal_ranks()
    backend.horovod = lambda: hvd
    precise = 1 + 2**-40
    gathered = backend.allgather_numpy(np.array([precise], np.float64), "hvdkit.sync")
    assert gathered.dtype == np.float64 and gathered.tolist() == [[precise], [precise]], gathered
    assert metrics.average_logs({"loss": precise}, 3.0)["loss"] == precise
