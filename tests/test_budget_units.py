"""CI's time budget (tests/budget.py): budgeted tests run after the core, and under a
deadline only when they fit."""

from __future__ import annotations

from budget import BUDGETED, order, over_budget

BENCH = "tests/test_bench.py::test_quick_run_reports_keras_on_every_backend"


def test_order_puts_the_core_first_and_the_image_tests_last():
    core = order("tests/test_launch.py::test_run_from_the_localhost_hostfile[gloo]", False)
    assert core < order(BENCH, False) < order("tests/test_docker_image.py::test_x", True)
    first, second = (f"tests/{k}" for k in list(BUDGETED)[:2])
    assert order(first, False) < order(second, False)


def test_a_budgeted_test_starts_only_when_it_fits():
    assert over_budget(BENCH, None) is None  # no deadline: make test runs everything
    assert over_budget(BENCH, deadline=1000.0, now=1000.0 - BUDGETED[BENCH[6:]]) is None
    why = over_budget(BENCH, deadline=1000.0, now=900.0)
    takes = BUDGETED[BENCH[6:]]
    assert why == (f"CI time budget: takes ~{takes:.0f} s, 100 s left (tests/budget.py; "
                   "`make test` runs it)")  # fmt: skip
    assert over_budget("tests/test_launch.py::test_core", deadline=0.0, now=1e9) is None


def test_the_budgeted_order_rotates_with_the_seed_so_no_test_is_always_last(monkeypatch):
    from budget import rotation

    names = [f"tests/{k}" for k in BUDGETED]
    lasts = set()
    for seed in range(len(BUDGETED)):
        monkeypatch.setenv("HVDKIT_BUDGET_SEED", str(seed))
        offset = rotation()
        ranked = sorted(names, key=lambda n: order(n, False, offset))
        assert ranked[0] == names[seed] and sorted(ranked) == sorted(names)
        lasts.add(ranked[-1])
    assert len(lasts) == len(BUDGETED)  # every test is first (and last) for some commit
    core = order("tests/test_launch.py::test_x", False, 5)
    assert core < order(names[0], False, 5) < order("tests/test_docker_image.py::t", True, 5)


def test_ci_summary_line_counts_each_part_and_the_tests_skipped_for_time():
    from budget import summary

    tests = {
        "tests/test_launch.py::a": {"part": "core", "seconds": 600.0, "outcome": "passed"},
        "tests/test_launch.py::b": {"part": "core", "seconds": 6.0, "outcome": "failed"},
        "tests/" + list(BUDGETED)[0]: {"part": "budgeted", "seconds": 120.0, "outcome": "passed"},
        "tests/" + list(BUDGETED)[1]: {
            "part": "budgeted",
            "seconds": 0.0,
            "outcome": "skipped",
            "budget": True,
        },
        "tests/test_docker_image.py::c": {"part": "image", "seconds": 300.0, "outcome": "passed"},
    }
    assert summary(tests, setup_s=420, total_s=2700) == (
        "CI summary: setup 7.0 min, core tests 10.1 min, budgeted tests 2.0 min (1 run / 1 "
        "skipped for time), image tests 5.0 min, total 45.0 min; 1 failed"
    )


def test_every_budgeted_test_still_exists():
    """A test moved or renamed leaves its entry behind, and its time then counts for nothing."""
    import ast
    from pathlib import Path

    stale = []
    for key in BUDGETED:
        name, _, rest = key.partition("::")
        tree = ast.parse((Path(__file__).parent / name).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if rest.split("[")[0] not in functions:
            stale.append(key)
    assert not stale, f"tests/budget.py names tests that are gone: {stale}"
