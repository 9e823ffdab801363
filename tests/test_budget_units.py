"""CI's time budget (tests/budget.py): budgeted tests run after the core, and under a
deadline only when they fit."""

from __future__ import annotations

from budget import BUDGETED, order, over_budget

BENCH = "tests/test_bench.py::test_quick_run_reports_every_section"


def test_order_puts_the_core_first_and_the_image_tests_last():
    core = order("tests/test_launch.py::test_run_from_the_localhost_hostfile[gloo]", False)
    assert core < order(BENCH, False) < order("tests/test_docker_image.py::test_x", True)
    first, second = (f"tests/{k}" for k in list(BUDGETED)[:2])
    assert order(first, False) < order(second, False)


def test_a_budgeted_test_starts_only_when_it_fits():
    assert over_budget(BENCH, None) is None  # no deadline: make test runs everything
    assert over_budget(BENCH, deadline=1000.0, now=1000.0 - BUDGETED[BENCH[6:]]) is None
    why = over_budget(BENCH, deadline=1000.0, now=900.0)
    assert why == "CI time budget: takes ~240 s, 100 s left (tests/budget.py; `make test` runs it)"
    assert over_budget("tests/test_launch.py::test_core", deadline=0.0, now=1e9) is None
