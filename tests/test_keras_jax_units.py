"""The pure parts of hvdkit.keras on JAX (tests/test_keras_jax.py runs the real thing)."""

from __future__ import annotations

from types import SimpleNamespace

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
