"""make test's two lanes (tests/lanes.py): the split, the one exit status, lane 2's report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from lanes import IMAGE_TESTS_S, SECOND_LANE, lane, lane2_report, lane_env, merge_summaries, status

TESTS = Path(__file__).resolve().parent
# What starts something that must not run twice at once on one machine: the Slurm cluster
# (a bridge and daemons on fixed addresses), Ray (ray start's address is found by every later
# ray.init()), Spark.
STARTS = re.compile(r"from slurm import|import slurm\b|ray\.init\(|\"start\", \"--head\"|"
                    r"local_ray|local_spark|getOrCreate\(")  # fmt: skip


def test_every_file_that_starts_slurm_ray_or_spark_is_in_the_second_lane():
    starters = {p.name for p in TESTS.glob("test_*.py")
                if p.name != Path(__file__).name and STARTS.search(p.read_text())}  # fmt: skip
    assert {"test_slurm.py", "test_ray.py", "test_spark.py"} <= starters  # the pattern works
    assert starters <= SECOND_LANE, starters - SECOND_LANE
    # The docs' examples (run by test_docs.py) start Ray and Spark too.
    docs = TESTS.parent / "docs"
    assert any("RayExecutor" in p.read_text() for p in docs.rglob("*.md"))
    assert lane("tests/test_docs.py::test_the_docs_code_runs[ray-executor]") == 2


def test_the_second_lane_names_existing_files_and_the_rest_is_lane_1():
    assert all((TESTS / name).exists() for name in SECOND_LANE), SECOND_LANE
    assert lane("tests/test_hang.py::test_x[a::b]") == 2
    assert lane("tests/test_launch.py::test_x") == 1
    assert lane("tests/ranked/test_keras_fit.py::test_y") == 1


def test_one_exit_status_for_both_lanes():
    assert status([0, 0]) == 0
    assert status([0, 5]) == 0 and status([5, 0]) == 0  # a lane with nothing selected
    assert status([1, 0]) == 1 and status([0, 2]) == 2
    assert status([5, 5]) == 5


def test_each_lane_has_its_summary_file_and_lane_2_the_image_tests_time():
    ci = {"HVDKIT_CI_SUMMARY": "/w/s.json", "HVDKIT_CI_DEADLINE": "1000", "PATH": "/bin"}
    one, two = lane_env(1, ci), lane_env(2, ci)
    assert one == {**ci, "HVDKIT_CI_SUMMARY": "/w/s.json.lane1"}
    assert two["HVDKIT_CI_SUMMARY"] == "/w/s.json.lane2" and two["PATH"] == "/bin"
    assert float(two["HVDKIT_CI_DEADLINE"]) == 1000 + IMAGE_TESTS_S
    assert lane_env(2, {"PATH": "/bin"}) == {"PATH": "/bin"}  # make test: no deadline, no file


def test_lane_2s_report_starts_at_its_failures_or_summary():
    log = "collected 3\n...F\n==== FAILURES ====\n_ test_a _\nboom\n==== short test summary ====\n"
    assert lane2_report(log).startswith("==== FAILURES ====") and "boom" in lane2_report(log)
    quiet = "collected 3\n...\n==== slowest 40 durations ====\n3.0s call x\n= 3 passed =\n"
    assert lane2_report(quiet).startswith("==== slowest 40 durations")
    assert lane2_report("a\nb") == "a\nb"  # killed before any section: the tail as it is


def test_the_lanes_summaries_merge_into_ci_s_file(tmp_path):
    parts = [tmp_path / "s.lane1", tmp_path / "s.lane2"]
    parts[0].write_text(json.dumps({"a": {"part": "core"}}))
    parts[1].write_text(json.dumps({"b": {"part": "budgeted"}}))
    merge_summaries(tmp_path / "s", parts)
    assert json.loads((tmp_path / "s").read_text()) == {"a": {"part": "core"},
                                                        "b": {"part": "budgeted"}}  # fmt: skip
    assert not any(p.exists() for p in parts)


def test_two_real_pytest_runs_split_the_selection(tmp_path):
    """The runner itself, on pytest's collection only: each lane collects its files."""
    log = tmp_path / "lane2.log"
    argv = [sys.executable, str(TESTS / "lanes.py"), "--log", str(log), "--", "--co", "-q",
            "-p", "no:cacheprovider", str(TESTS / "test_budget_units.py"),
            str(TESTS / "test_hang.py")]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lane1 = out.stdout.split("= lane 2")[0]
    assert "test_budget_units.py::" in lane1 and "test_hang.py::" not in lane1
    assert "test_hang.py::" in log.read_text() and "test_budget_units.py::" not in log.read_text()
    assert re.search(r"lanes: 1 took \d+ s \(exit 0\), 2 took \d+ s \(exit 0\)", out.stdout)
    argv[argv.index("-q")] = "-k=no_test_has_this_name"
    assert subprocess.run(argv, capture_output=True, timeout=120).returncode == 5


def test_the_collection_hooks_import_nothing_named_conftest():
    """Inside a job's ranks (tests/in_ranks.py), ``conftest`` is tests/ranked/conftest.py, and
    tests/conftest.py's hooks still run there: what they import must not ask for ``conftest``
    (a read-through did once, and every in-ranks test failed in CI)."""
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import conftest; "
            "assert conftest.__file__.endswith('ranked/conftest.py'), conftest.__file__; "
            "import lanes, budget")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(TESTS / "ranked"), str(TESTS)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
