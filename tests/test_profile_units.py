"""hvdkit.profile's pure parts: the recorder's accounting on a fake clock, and the report's
figures, verdict, straggler and advice on made-up records."""

from __future__ import annotations

import json

import pytest

from hvdkit.profile import report
from hvdkit.profile.recorder import PHASES, Recorder


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_time_goes_to_the_innermost_phase_and_the_rest_is_compute():
    clock = Clock()
    rec = Recorder(clock)
    rec.step_done()  # the first mark starts the clock; an empty step is not a step
    for _ in range(2):
        with rec.phase("data"):
            clock.advance(0.030)
        clock.advance(0.010)  # forward and backward
        with rec.phase("optimizer"):
            clock.advance(0.001)
            with rec.phase("communication"):  # step() calling synchronize()
                clock.advance(0.005)
            clock.advance(0.002)
        rec.step_done()
        with rec.phase("other"):
            clock.advance(0.004)  # after the step: charged to the next one
    assert len(rec.steps) == 2
    data, compute, comm, opt, other = rec.steps[1]
    assert (data, compute, comm, opt, other) == pytest.approx((0.030, 0.010, 0.005, 0.003, 0.004))
    assert rec.steps[0][4] == 0 and sum(rec.steps[0]) == pytest.approx(0.048)
    assert rec.ends == pytest.approx([0.048, 0.100])


def _record(rank, per_step, steps=20, host="h"):
    """A rank whose every step has these phase seconds (PHASES order), with a warm-up step."""
    return {"rank": rank, "host": host, "phases": list(PHASES), "ends": [],
            "steps": [[1.0, 1.0, 1.0, 1.0, 1.0]] + [list(per_step)] * steps}  # fmt: skip


def test_the_bound_is_the_largest_share_and_the_warmup_step_is_left_out():
    profile = report.build([_record(1, (0.03, 0.005, 0.002, 0.001, 0)),
                            _record(0, (0.03, 0.005, 0.002, 0.001, 0))])  # fmt: skip
    assert [r["rank"] for r in profile["ranks"]] == [0, 1]
    rank = profile["ranks"][0]
    assert rank["steps"] == 20 and rank["step_ms"]["median"] == pytest.approx(38.0)
    assert rank["phases_ms"]["data"] == pytest.approx(30.0)
    v = profile["verdict"]
    assert v["bound"] == "input" and v["straggler"] is None
    assert "num_workers" in v["advice"][0] and "workers=N" in v["advice"][0]
    assert report.build([_record(0, (0.001, 0.01, 0.03, 0.001, 0))])["verdict"]["bound"] == (
        "communication"
    )
    compute = report.build([_record(0, (0.001, 0.03, 0.002, 0.004, 0.001))])["verdict"]
    assert compute["bound"] == "compute" and len(compute["advice"]) == 1
    json.dumps(profile)  # what profile.json holds


def test_a_rank_that_computes_longer_in_most_steps_is_the_straggler():
    fast = (0.001, 0.010, 0.012, 0.001, 0)  # waits 12 ms in communication for the slow one
    slow = (0.001, 0.022, 0.000, 0.001, 0)
    records = [_record(0, fast, host="a"), _record(1, slow, host="b"), _record(2, fast, host="c")]
    v = report.build(records)["verdict"]
    assert v["straggler"]["rank"] == 1 and v["straggler"]["host"] == "b"
    assert v["straggler"]["slower_by"] == pytest.approx(1.0)  # busy 24 ms against 12
    assert any("rank 1 on b" in item for item in v["advice"])
    # Slower now and then is noise, not a straggler.
    mixed = _record(1, slow)
    mixed["steps"][1::2] = [list(fast)] * len(mixed["steps"][1::2])
    assert report.build([_record(0, fast), mixed])["verdict"]["straggler"] is None


def test_compiled_steps_say_so_rather_than_calling_everything_compute():
    record = _record(0, (0, 0.02, 0, 0, 0))
    record["compiled"] = True
    v = report.build([record])["verdict"]
    assert v["bound"] == "unknown" and "run_eagerly=True" in v["advice"][0]
    assert "verdict: unknown (compiled steps)" in report.table(report.build([record]))
    # A custom loop's wait for its tf.data batches is timed outside the graph: over half the
    # step is input-bound, whatever the graph holds.
    waiting = _record(0, (0.03, 0.02, 0, 0, 0))
    waiting["compiled"] = True
    assert report.build([waiting])["verdict"]["bound"] == "input"


def test_the_closing_text_and_files(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank-{rank}.json").write_text(
            json.dumps(_record(rank, (0.03, 0.005, 0.002, 0.001, 0)))
        )
    text = report.finish(tmp_path, ranks_expected=3)
    assert "1 rank(s) wrote no record here" in text and "verdict: input-bound" in text
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["verdict"]["bound"] == "input" and len(profile["ranks"]) == 2
    assert (tmp_path / "profile.png").stat().st_size > 10_000
    assert "no rank wrote a record" in report.finish(tmp_path / "empty", 2)


def test_hvdkits_own_work_above_five_percent_is_named():
    v = report.build([_record(0, (0.001, 0.03, 0.002, 0.004, 0.003))])["verdict"]
    assert v["bound"] == "compute" and "hvdkit's own per-step work" in v["advice"][1]


def test_a_long_run_keeps_an_even_sample_in_bounded_memory(monkeypatch):
    from hvdkit.profile import recorder

    monkeypatch.setattr(recorder, "MAX_STEPS", 8)
    clock = Clock()
    rec = Recorder(clock)
    rec.start()
    for step in range(1, 41):
        clock.advance(0.001 * step)  # step k takes k ms
        rec.step_done()
    assert len(rec.steps) < 8 and rec.stride == 8
    # Kept: every stride-th step of the run, in order, each with its own time.
    kept = [round(1000 * sum(s)) for s in rec.steps]
    assert kept == [8, 16, 24, 32, 40][: len(kept)] and kept == sorted(kept)
