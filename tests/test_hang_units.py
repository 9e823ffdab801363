"""The hang doctor's pure parts (hvdkit.launch.stall): Horovod's stall warning read line by
line, a real ``faulthandler`` dump read and classified, and the diagnosis for each fault."""

from __future__ import annotations

import faulthandler
import tempfile
import threading
import time

import pytest

from hvdkit.launch import stall
from hvdkit.launch.hang_doctor import HangConfig

# Horovod 0.28.1's stall inspector, as rank 0 writes it (stall_inspector.cc), one line each.
HOROVOD = [
    "[2026-11-28 20:56:27.752351: W /tmp/b/horovod/common/stall_inspector.cc:107] One or more "
    "tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are "
    "waiting for remainder of ranks for more than 2 seconds. This may indicate that different "
    "ranks are trying to submit different tensors or that only subset of ranks is submitting "
    "tensors, which will cause deadlock. ",
    "Missing ranks:",
    "1: [allreduce.fc.bias, allreduce.fc.weight]",
    "3!: [a, b, c, d, e, f ...]",
]


def test_horovods_warning_is_read_line_by_line_and_held_back():
    reader = stall.WarningReader()
    assert not reader.feed("an ordinary line")
    assert all(reader.feed(line) for line in HOROVOD)
    assert not reader.feed("the script's next line")  # ends the warning, is printed
    found = reader.latest
    assert found is not None and found.missing == {
        1: ["allreduce.fc.bias", "allreduce.fc.weight"],
        3: ["a", "b", "c", "d", "e", "f"],
    }
    assert found.more == {3}
    # A warning still being read is complete enough to report.
    again = stall.WarningReader()
    for line in HOROVOD[:3]:
        again.feed(line)
    assert again.complete().missing == {1: ["allreduce.fc.bias", "allreduce.fc.weight"]}


class Dataset:
    def __getitem__(self, i):
        time.sleep(30)


def _dump_while(target) -> str:
    """A real ``faulthandler`` dump of every thread while ``target`` blocks in one."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    time.sleep(0.3)
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        return out.read()


def test_a_real_dump_is_read_and_where_a_thread_waits_is_named():
    text = _dump_while(lambda: Dataset()[3])
    threads = stall.parse_stacks(text)
    assert any(current for current, _ in threads)  # the dumping thread is marked
    loading = [f for _, frames in threads for f in frames if f.function == "__getitem__"]
    assert loading and loading[0].path.endswith("test_hang_units.py")
    blocked = next(frames for current, frames in threads if not current and
                   any(f.function == "__getitem__" for f in frames))  # fmt: skip
    place = stall.where(blocked)
    assert place.kind == "data" and "__getitem__" in place.describe()

    lock = threading.Lock()
    lock.acquire()

    def wait_on_lock():
        lock.acquire()  # never released

    text = _dump_while(wait_on_lock)
    blocked = next(frames for current, frames in stall.parse_stacks(text) if not current and
                   frames[0].function == "wait_on_lock")  # fmt: skip
    assert stall.where(blocked).kind == "lock"


def _frames(*spec):
    return [stall.Frame(path, line, fn) for path, line, fn in spec]


SYNC = ("/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py", 900, "synchronize")
STEP = ("/w/hvdkit/torch/optimizer.py", 120, "step")


def test_the_diagnosis_names_the_rank_and_the_cause():
    one = stall.Stall(missing={1: ["allreduce.fc.weight"]})
    waiting = stall.where(_frames(SYNC, STEP, ("/w/train.py", 40, "<module>")))
    assert waiting.kind == "collective" and waiting.stepping
    data = stall.where(_frames(("/w/train.py", 12, "__getitem__"),
                               ("/venv/lib/python3.11/site-packages/torch/utils/data/_utils/"
                                "fetch.py", 52, "fetch"), ("/w/train.py", 30, "<module>")))  # fmt: skip
    line = stall.diagnose(one, {0: waiting, 1: data}, 2)
    assert "rank 1 is loading data at /w/train.py:12 in __getitem__" in line
    assert "rank 0 waits for it in allreduce.fc.weight" in line

    # (a) one batch fewer: rank 1 averages its last loss while rank 0 is in its last step.
    both = stall.Stall(missing={0: ["metric"], 1: ["allreduce.fc.weight"]})
    metric = stall.where(_frames(SYNC, ("/venv/lib/python3.11/site-packages/horovod/torch/"
                                        "mpi_ops.py", 300, "allreduce"),
                                 ("/w/train.py", 60, "<module>")))  # fmt: skip
    assert metric.kind == "collective" and not metric.stepping
    line = stall.diagnose(both, {0: waiting, 1: metric}, 2)
    assert line.startswith("rank 1 left the training loop") and "different numbers of batches" in (
        line
    )

    # (d) different names: neither rank is in a step.
    other = stall.where(_frames(SYNC, ("/w/train.py", 61, "<module>")))
    line = stall.diagnose(both, {0: metric, 1: other}, 2)
    assert "submitted different collectives" in line and "same names" in line

    # No stack: said, with the likely reasons.
    assert "sent no stack" in stall.diagnose(one, {0: waiting, 1: None}, 2)


def test_the_doctors_settings():
    config = HangConfig(timeout=60)
    assert config.warn_every == 15  # the report comes at most 30 s after the timeout
    assert HangConfig(timeout=2).warn_every == 1
    env = config.env(tempfile.gettempdir())
    assert "HOROVOD_STALL_CHECK_TIME_SECONDS=15" in env and any("HVDKIT_HANG_DIR=" in e for e in env)
    assert HangConfig(timeout=0).env(tempfile.gettempdir()) == []


def test_the_launcher_reports_once_from_the_ranks_notes(tmp_path, monkeypatch):
    """The launcher's side on notes written as a rank writes them: rank 0 has waited in
    allreduce.x past the timeout, rank 1 has no note (in no collective) and sends no stack.
    One report, naming both; the next poll of the same stall says nothing more."""
    import json
    import os

    from hvdkit.launch import hang_doctor

    monkeypatch.setattr(hang_doctor, "STACK_WAIT_S", 0.3)
    said: list[str] = []
    doctor = hang_doctor.Doctor(HangConfig(timeout=2), tmp_path, {0: "a", 1: "b"},
                                say=said.append)  # fmt: skip
    (tmp_path / "rank-0.a.1.state").write_text(
        json.dumps({"rank": 0, "waiting": [["allreduce.x", 2.5]]}))
    assert doctor.notes() == {0: [("allreduce.x", pytest.approx(2.5, abs=0.5))]}
    stale = tmp_path / "rank-1.b.2.state"  # a note not rewritten for 3 s: that wait ended
    stale.write_text(json.dumps({"rank": 1, "waiting": [["allreduce.y", 9.0]]}))
    os.utime(stale, (0, 0))
    assert set(doctor.notes()) == {0}
    doctor.start()
    time.sleep(2.0)
    doctor.close()
    assert len(said) == 1, said
    report = said[0]
    assert "rank 0 (a) waits in: allreduce.x" in report
    assert "rank 1 (b) has not submitted: allreduce.x" in report
    assert "rank 1 sent no stack" in report and "still waiting" in report
    assert (tmp_path / "request").exists()  # the ranks were asked for their stacks
