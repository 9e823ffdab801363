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
    data, compute, comm, opt, other, unsplit = rec.steps[1]
    assert unsplit == 0
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
    record = _record(0, (0, 0, 0, 0, 0, 0.02))
    record["compiled"] = True
    v = report.build([record])["verdict"]
    assert v["bound"] == "unknown" and "run_eagerly=True" in v["advice"][0]
    assert "100% of the step not split" in v["advice"][0]
    text = report.table(report.build([record]))
    assert "verdict: unknown (compiled steps: " in text and "not split 100%" in text
    assert "compute" not in text.split("verdict:")[1].split("\n")[0]  # never called compute
    # A custom loop's wait for its tf.data batches is timed outside the graph: over half the
    # step is input-bound, whatever the graph holds.
    waiting = _record(0, (0.03, 0, 0, 0, 0, 0.02))
    waiting["compiled"] = True
    assert report.build([waiting])["verdict"]["bound"] == "input"
    # The input wrapper's loading may overlap the step: input-bound only over 80% of it.
    loading = {**waiting, "loader_timed": True}
    assert report.build([loading])["verdict"]["bound"] == "unknown"
    loading = {**_record(0, (0.09, 0, 0, 0, 0, 0.01)), "compiled": True, "loader_timed": True}
    assert report.build([loading])["verdict"]["bound"] == "input"


def test_a_compiled_steps_data_is_what_the_input_wrapper_loaded_meanwhile():
    """Loads in other threads (Keras's PyDataset workers) counted once where they overlap,
    moved from the step's unsplit time to data, never more than the step; an eager step's
    data was timed as a wait already, so nothing moves."""
    clock = Clock()
    rec = Recorder(clock)
    rec.start()
    with rec.phase("unsplit"):
        rec.loading(True)
        clock.advance(0.020)
        rec.loading(True)  # a second worker, overlapping
        clock.advance(0.010)
        rec.loading(False)
        clock.advance(0.010)
        rec.loading(False)
        clock.advance(0.010)
    rec.step_done()
    assert rec.steps[0][PHASES.index("data")] == pytest.approx(0.040)
    assert rec.steps[0][PHASES.index("unsplit")] == pytest.approx(0.010)
    assert rec.loader_timed
    rec.loading(True)  # a load running across the step's end: each step its part
    with rec.phase("unsplit"):
        clock.advance(0.050)
    rec.step_done()
    assert rec.steps[1][PHASES.index("data")] == pytest.approx(0.050)
    with rec.phase("unsplit"):
        clock.advance(0.010)
    rec.loading(False)
    rec.step_done()
    assert rec.steps[2][PHASES.index("data")] == pytest.approx(0.010)
    eager = Recorder(clock)
    eager.start()
    with eager.phase("data"):
        eager.loading(True)
        clock.advance(0.030)
        eager.loading(False)
    eager.step_done()
    assert eager.steps[0][0] == pytest.approx(0.030) and sum(eager.steps[0]) == pytest.approx(0.03)


def test_time_between_training_steps_is_apart_and_in_no_step():
    """Validation, the epoch's end, a checkpoint and an elastic reset are charged apart; a
    validation loop seen only by its first no-grad batch lasts until a training batch or a
    step."""
    clock = Clock()
    rec = Recorder(clock)
    rec.start()
    clock.advance(0.010)
    rec.step_done()
    with rec.phase("validation"):
        clock.advance(2.0)
    with rec.phase("checkpoint"):
        clock.advance(1.0)
    rec.apart_until_training("validation")  # a torch validation loader's first batch
    clock.advance(3.0)
    rec.training()  # the next training batch
    with rec.phase("data"):
        clock.advance(0.004)
    clock.advance(0.006)
    rec.step_done()
    assert sum(rec.steps[1]) == pytest.approx(0.010)
    assert rec.apart["validation"] == pytest.approx(5.0) and rec.apart["checkpoint"] == 1.0
    rec.apart_until_training("validation")
    clock.advance(1.0)
    rec.step_done()  # a step ends it too (its time was the validation's)
    clock.advance(0.010)
    rec.step_done()
    assert sum(rec.steps[-1]) == pytest.approx(0.010) and rec.apart["validation"] == 6.0
    # Inside time apart, a batch fetch (Keras's validation on torch: a DataLoader's next) and
    # an input wrapper's loads are the validation's, not the next step's.
    with rec.phase("validation"):
        rec.loading(True)
        with rec.phase("data"):
            clock.advance(0.5)
        rec.loading(False)
    with rec.phase("unsplit"):
        clock.advance(0.010)
    rec.step_done()
    assert rec.apart["validation"] == 6.5 and rec.steps[-1][0] == 0
    assert sum(rec.steps[-1]) == pytest.approx(0.010)
    profile = report.build([rec.record(0, "h")])
    assert profile["ranks"][0]["apart_ms"] == {"validation": 6500.0, "checkpoint": 1000.0}
    assert "between steps, rank 0, whole run: validation 6500 ms, checkpoint 1000 ms" in (
        report.table(profile)
    )


def test_one_long_step_does_not_move_the_phases():
    record = _record(0, (0.002, 0.010, 0.001, 0.001, 0))
    record["steps"][7] = [0.002, 5.0, 0.001, 0.001, 0]  # a validation the recorder missed
    rank = report.build([record])["ranks"][0]
    assert rank["phases_ms"]["compute"] == pytest.approx(10.0)
    assert rank["step_ms"]["median"] == pytest.approx(14.0)


def test_with_two_ranks_a_rank_15_percent_slower_is_the_straggler():
    """The rank under test is not in the median it is compared with."""
    fast = (0.001, 0.020, 0.004, 0.001, 0)
    slow = (0.001, 0.0235, 0.0005, 0.001, 0)  # busy 25.5 ms against 22: 16% slower
    v = report.build([_record(0, fast), _record(1, slow)])["verdict"]
    assert v["straggler"] is not None and v["straggler"]["rank"] == 1


def test_a_report_of_1024_ranks_is_quick_small_and_readable(tmp_path):
    """Each rank's summary (a thousand steps digested) written as a rank writes it; the
    report, the table and the picture in a fresh process: under 10 s and 500 MB, a table
    of the slowest, median and fastest ranks, a picture of fixed size."""
    import random

    from hvdkit.profile.stats import digest

    rng = random.Random(0)
    for rank in range(1024):
        slow = 0.006 if rank == 777 else 0.0
        steps = [[0.002, 0.010 + slow + rng.random() * 1e-3, 0.003, 0.001, 0.0002, 0]
                 for _ in range(1000)]  # fmt: skip
        raw = {"rank": rank, "host": f"node{rank // 8}", "phases": list(PHASES), "steps": steps}
        (tmp_path / f"rank-{rank}.node.1.json").write_text(json.dumps(digest(raw)))
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from hvdkit.profile import report\n"
        "start = time.perf_counter()\n"
        "text = report.finish(Path(sys.argv[1]), 1024)\n"
        "print(text)\n"
        "print('SECONDS', time.perf_counter() - start)\n"
        # VmHWM: this process's own peak (ru_maxrss would carry pytest's across the fork)
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0]\n"
        "print('MAXRSS_MB', int(hwm.split()[1]) / 1024)\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    figures = dict(line.split() for line in out.splitlines() if line.startswith(("SECONDS",
                   "MAXRSS_MB")))  # fmt: skip
    assert float(figures["SECONDS"]) < 10 and float(figures["MAXRSS_MB"]) < 500, figures
    assert "straggler: rank 777 on node97" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(tuple("0123456789"))]
    assert len(rows) <= report.LISTED and any(r.split()[0] == "777" for r in rows)
    assert "1008 more ranks in profile.json" in out
    from PIL import Image

    with Image.open(tmp_path / "profile.png") as picture:
        assert picture.size[1] < 1500  # the same height as 16 ranks'
    assert len(json.loads((tmp_path / "profile.json").read_text())["ranks"]) == 1024


def test_a_report_that_fails_does_not_change_the_jobs_exit_status(tmp_path, capsys):
    from hvdkit.commands import run

    (tmp_path / "rank-0.h.1.json").write_text("{not json")
    run._print_profile(tmp_path, 2)  # no exception: the job's own status stands
    out = capsys.readouterr().out
    assert "the report of" in out and "JSONDecodeError" in out and "exit status is its own" in out


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


def test_on_a_gpu_each_phase_edge_waits_for_the_device():
    """Once the process uses CUDA, every edge synchronises first, so a kernel queued in the
    forward pass is compute, not the allreduce's wait after it (a fake device here: a queue
    of work the 'synchronize' runs)."""
    clock = Clock()
    queued = []

    def synchronize():
        while queued:
            clock.advance(queued.pop())

    in_use = [False]
    rec = Recorder(clock, device_sync=lambda: synchronize if in_use[0] else None)
    rec.start()
    in_use[0] = True  # CUDA initialised by the first step
    queued.append(0.030)  # the forward and backward pass, queued on the GPU
    with rec.phase("communication"):
        clock.advance(0.002)
    rec.step_done()
    data, compute, comm = rec.steps[0][:3]
    assert compute == pytest.approx(0.030) and comm == pytest.approx(0.002)
    assert rec.record(0, "h")["synchronized"]


def test_what_leads_out_of_training_is_reclaimed_from_the_next_step():
    """Keras sets its validation up between an epoch's last batch and ``on_test_begin``
    (0.5-0.8 s on TensorFlow, which had landed in the next step as compute): ``reclaim``
    moves what the step under way holds to the time apart, loads included."""
    clock = Clock()
    rec = Recorder(clock)
    rec.start()
    clock.advance(0.010)
    rec.step_done()
    rec.loading(True)
    clock.advance(0.700)  # nothing open: charged to the step under way, as compute
    rec.loading(False)
    with rec.phase("validation"):
        rec.reclaim("validation")
        clock.advance(2.0)
    with rec.phase("unsplit"):
        clock.advance(0.010)
    rec.step_done()
    assert sum(rec.steps[1]) == pytest.approx(0.010)
    assert rec.steps[1][PHASES.index("data")] == 0  # the reclaimed load is not this step's
    assert rec.apart["validation"] == pytest.approx(2.7)
