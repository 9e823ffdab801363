"""hvdkit.keras's ``Session.fit`` against generated scenarios (issue 49, deliverable 2):
tests/keras_scenarios.py's grammar, run by tests/workers/keras_scenario_worker.py as one 2-rank
job per Keras backend for all its cases (the named and the generated together), each checked
against the one-process oracle (one plain Keras process, another job of the worker) and the
ledger of samples each rank trained.

- The named cases are the variations that gave silent wrong results, kept as regression
  tests (each failed on the code before its fix).
- The generated slice draws ``HVDKIT_SCENARIOS`` cases per backend (default 15) with a seed
  taken from the commit (``HVDKIT_SCENARIO_SEED`` overrides), so each CI tries other ones;
  ``make fuzz`` runs a campaign. A failing case prints a one-line reproducer; keep it in
  ``REGRESSIONS``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS
from keras_scenarios import (
    BACKENDS,
    KINDS,
    SIZE,
    Case,
    allowed,
    cases,
    check,
    global_steps,
    pass_counts,
    train_rows,
)
from scenario_harness import commit_seed, name_lost_ranks, records, report, watched

COUNT = int(os.environ.get("HVDKIT_SCENARIOS", "15"))  # generated cases per backend
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(700 + 30 * COUNT)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")
CASE_TIMEOUT = 240  # seconds without a case ending: the job hangs (a case takes 2 to 20)
WORKER = str(WORKERS / "keras_scenario_worker.py")

REGRESSIONS = {
    # validation_split split each rank's shard: of 23 rows at f=0.25 one process trains rows
    # 0-16, and each rank's 12 rows (one padding) split 9/3 trained held-out row 17 too
    "validation_split_held_out_rows": Case(samples=23, batch=3, validation="split"),
    # PyDataset's forked workers inherited the rank's preemption handler, so the pool's
    # SIGTERM did not stop them: the resumed fit waited for them (270 s instead of 22)
    "pydataset_processes_resume": Case(kind="pydataset", samples=23, batch=4, workers=2,
                                       processes=True, resume=True),  # fmt: skip
    # make fuzz, seed 20261128 (the oracle's defect, not hvdkit's): a finite generator that
    # runs out before steps_per_epoch adds an optimizer iteration on TensorFlow, in one
    # process too; Adam's next steps differed from an oracle that did not count it
    "finite_generator_runs_out_adam": Case(kind="generator", samples=9, batch=2,
                                           length="finite", steps_per_epoch=5,
                                           optimizer="adam", validation="data"),  # fmt: skip
}


def run_cases(backend: str, scenarios: list[Case], tmp_path: Path) -> list[list[str]]:
    """Run ``scenarios`` (all of ``backend``) in its jobs, then their oracles in one process;
    each case's problems (empty: fine)."""
    items = [{"id": i, "case": asdict(c)} for i, c in enumerate(scenarios)]
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    ranks = dict(run_job(items, tmp_path / backend, env))
    wanted = []
    for i, case in enumerate(scenarios):
        records = ranks.get(i, {})
        if sorted(records) == list(range(SIZE)) and not any(
            v.get("error") for v in records.values()
        ):
            if len({len(v["steps"]) for v in records.values()}) == 1:
                steps = global_steps(case, records)
                first = records[0]
                wanted.append({"id": i, "case": asdict(case), "start": first["start"],
                               "steps": steps, "epoch_starts": first["epoch_starts"]})  # fmt: skip
    oracles = run_oracles(wanted, tmp_path / backend, env, timeout=120 + 20 * len(wanted))
    return [check(case, ranks.get(i, {}), oracles.get(i)) for i, case in enumerate(scenarios)]


def run_job(items: list[dict], where: Path, env: dict) -> list:
    """``items`` in ``hvdkit run -np SIZE`` jobs: ``(id, {rank: record})`` for each. A case
    that raises or hangs ends its job: the items after it run in another."""
    where.mkdir(parents=True, exist_ok=True)
    out_items: list = []
    while len(out_items) < len(items):
        rest = items[len(out_items) :]
        spec = where / f"cases-{rest[0]['id']}.json"
        spec.write_text(json.dumps(rest))
        argv = [HVDKIT, "run", "-np", str(SIZE), "--gloo", "--", sys.executable, WORKER,
                str(spec), str(where)]  # fmt: skip
        stdout, stderr, hung = watched(argv, env, CASE_TIMEOUT)
        by_id = records(stdout, "CASE ")
        done = [item for item in rest[: len(by_id)] if item["id"] in by_id]
        for item in done:
            name_lost_ranks(by_id[item["id"]], SIZE, stderr)
        out_items += [(item["id"], by_id[item["id"]]) for item in done]
        if len(done) < len(rest) and rest[len(done)]["id"] not in by_id:
            why = f"no result within {CASE_TIMEOUT} s (hung)" if hung else "no result"
            tail = f"{stdout[-1500:]}{stderr[-1500:]}"
            error = {r: {"error": f"{why}: {tail}"} for r in range(SIZE)}
            out_items.append((rest[len(done)]["id"], error))
    return out_items


def run_oracles(wanted: list[dict], where: Path, env: dict, timeout: float) -> dict[int, dict]:
    """The oracle of each case, in one plain process of the same backend: ``{id: result}``."""
    if not wanted:
        return {}
    spec = where / "oracles.json"
    spec.write_text(json.dumps(wanted))
    out = subprocess.run([sys.executable, WORKER, "--oracle", str(spec)], cwd=ROOT, text=True,
                         capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                         env=env)  # fmt: skip
    found = {i: next(iter(v.values())) for i, v in records(out.stdout, "ORACLE ").items()}
    tail = f"oracle exit {out.returncode}: {out.stdout[-800:]}{out.stderr[-800:]}"
    return {item["id"]: found.get(item["id"], {"error": tail}) for item in wanted}


def test_the_grammar_draws_every_kind_reproducibly_and_the_shares_cover_each_sample():
    """The pure part, in this process: a seed draws the same cases, a slice of 15 holds every
    input kind, and each drawn case's shares hold every training sample once an epoch with
    fewer than SIZE padding samples (a PyDataset's: batches)."""
    drawn = cases(7, 15, "torch")
    assert drawn == cases(7, 15, "torch") and {c.kind for c in drawn} == set(KINDS)
    assert all(allowed(c) for c in drawn)
    for case in cases(7, 40, "tensorflow"):
        counts = pass_counts(case)
        if counts is not None:
            assert set(counts) == set(range(train_rows(case))), case
            unit = case.batch if case.kind == "pydataset" else 1
            assert sum(counts.values()) - train_rows(case) < SIZE * unit, case


_runs: dict[str, list[list[str]]] = {}


@pytest.fixture(scope="module")
def backend_run(tmp_path_factory):
    """The named cases and the generated slice of a backend, run together (one job and one
    oracle process for both): each case's problems, the named ones first."""

    def problems(backend: str) -> list[list[str]]:
        if backend not in _runs:
            scenarios = named(backend) + cases(commit_seed(), COUNT, backend)
            _runs[backend] = run_cases(backend, scenarios, tmp_path_factory.mktemp(backend))
        return _runs[backend]

    return problems


def named(backend: str) -> list[Case]:
    return [replace(case, backend=backend) for case in REGRESSIONS.values()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_variations_found_train_like_one_process(backend, backend_run):
    scenarios = named(backend)
    problems = backend_run(backend)[: len(scenarios)]
    assert not any(problems), report(scenarios, problems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generated_scenarios_train_like_one_process(backend, backend_run):
    seed, count = commit_seed(), COUNT
    scenarios = cases(seed, count, backend)
    print(f"scenario seed {seed}, {backend}: {len(scenarios)} cases")
    assert len(scenarios) == count
    problems = backend_run(backend)[len(named(backend)) :]
    failed = sum(1 for p in problems if p)
    print(f"{len(scenarios) - failed} of {len(scenarios)} cases like the oracle")
    assert not failed, report(scenarios, problems, seed)


@pytest.mark.skipif("HVDKIT_SCENARIO" not in os.environ, reason="a reproducer's case")
def test_one_case(tmp_path):
    """``HVDKIT_SCENARIO='{...}'``: one case, as a failure's reproducer line gives it."""
    case = Case(**json.loads(os.environ["HVDKIT_SCENARIO"]))
    problems = run_cases(case.backend, [case], tmp_path)
    assert not problems[0], report([case], problems)
