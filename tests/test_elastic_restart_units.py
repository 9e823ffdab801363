"""The pure parts of hvdkit.elastic_restart (the kill test on Keras on JAX in
tests/test_elastic.py runs the real thing): Horovod's rendezvous answer, the place asked for,
a state's commit through a restart, and the JAX errors that mean a lost worker."""

from __future__ import annotations

import os

import pytest

from hvdkit import elastic_restart
from hvdkit.elastic import ElasticState, Handler


def test_the_rendezvous_answer_becomes_horovods_variables():
    got = elastic_restart.parse_slot("1,3,0,1,1,3\n", "hostB:0")
    assert got == {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0",
                   "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1",
                   "HOROVOD_CROSS_SIZE": "3"}  # fmt: skip
    with pytest.raises(elastic_restart.RemovedFromJobError, match="hostB:0 is no longer"):
        elastic_restart.parse_slot("-1,-1,-1,-1,-1,-1", "hostB:0")
    for bad in ("", "1,2", "a,b,c,d,e,f", "<html>"):
        with pytest.raises(RuntimeError, match="Horovod's rendezvous answered"):
            elastic_restart.parse_slot(bad, "hostB:0")


def test_the_place_is_asked_for_by_host_and_local_rank():
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000",
           "HOROVOD_HOSTNAME": "hostB", "HOROVOD_LOCAL_RANK": "1"}  # fmt: skip
    assert elastic_restart.slot_url(env) == (
        "http://10.0.0.1:4000/rank_and_size/hostB:1", "hostB:1"
    )


def test_rejoin_does_nothing_in_a_process_that_did_not_restart(monkeypatch):
    monkeypatch.delenv(elastic_restart.ENV, raising=False)
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)
    elastic_restart.rejoin()  # would raise KeyError if it looked for the rendezvous


class Box:
    def __init__(self, value):
        self.value = value


class BoxHandler(Handler):
    def save(self):
        self.saved = list(self.value.value)

    def restore(self):
        self.value.value = list(self.saved)

    def sync(self):
        pass


class BoxState(ElasticState):
    HANDLERS = [(Box, BoxHandler)]


def test_a_commit_comes_back_in_the_restarted_process_and_the_file_goes(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv(elastic_restart.ENV, raising=False)  # and gone again after the test
    state = BoxState(bcast_object=lambda x: x, get_rank=lambda: 0, box=Box([1, 2]), epoch=0)
    state.box.value, state.epoch = [3, 4], 2
    state.commit = state.save  # no host-update check outside a job
    state.commit()
    state.box.value, state.epoch = [9, 9], 5  # after the commit: lost at the restart
    executed = {}
    monkeypatch.setattr(os, "execv", lambda path, argv: executed.update(argv=argv))
    elastic_restart.restart(state.committed())
    path = os.environ[elastic_restart.ENV]
    assert os.stat(path).st_mode & 0o777 == 0o600 and executed["argv"]
    fresh = BoxState(bcast_object=lambda x: x, get_rank=lambda: 0, box=Box([0, 0]), epoch=0)
    fresh.load_committed(elastic_restart.take_committed())
    assert fresh.box.value == [3, 4] and fresh.epoch == 2
    assert not os.path.exists(path) and elastic_restart.ENV not in os.environ


def test_jax_collective_failures_are_a_lost_worker_and_nothing_else_is():
    pytest.importorskip("keras")
    from horovod.common.exceptions import HorovodInternalError

    from hvdkit.keras.elastic import translate

    lost = ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error "
                      "[127.0.0.1]:3778: Connection reset by peer")  # fmt: skip
    assert isinstance(translate(lost), HorovodInternalError)
    assert isinstance(translate(RuntimeError("INTERNAL: NCCL all-gather failed")),
                      HorovodInternalError)  # fmt: skip
    assert translate(ValueError("Gloo is a library")) is None
    assert translate(ValueError("shapes (3,) and (4,) not aligned")) is None
