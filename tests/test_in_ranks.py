"""The test files under tests/ranked/, run inside the ranks of one 2-rank job per group
(tests/in_ranks.py: the PyTorch files, and the Keras files once per backend): one outer test
per test function there, its outcome on every rank; a failing rank's traceback, or the test a
rank hung or died in, is the failure's message."""

from __future__ import annotations

import pytest
from in_ranks import RANKED, Job, groups, ranked_tests, run, variants

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(960)]

CASES = [(path, variant, name) for path in sorted(RANKED.glob("test_*.py"))
         for variant in variants(path) for name in ranked_tests(path)]  # fmt: skip
GROUPS = groups(sorted(RANKED.glob("test_*.py")))
_jobs: dict = {}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    def job(variant) -> Job:
        if variant not in _jobs:
            paths = GROUPS[variant]
            where = tmp_path_factory.mktemp(f"keras-{variant}" if variant else "torch")
            _jobs[variant] = run(paths, where, env=variants(paths[0])[variant])
        return _jobs[variant]

    return job


@pytest.mark.parametrize(("path", "variant", "name"), CASES,
                         ids=[f"{p.stem}-{v}::{n}" if v else f"{p.stem}::{n}"
                              for p, v, n in CASES])  # fmt: skip
def test_in_ranks(jobs, path, variant, name):
    job = jobs(variant)
    problems = job.problems(name, path)
    assert not problems, "\n".join(problems)
    why = job.skipped(name, path)
    if why:
        pytest.skip(why)


def test_the_harness_names_a_failing_rank_and_a_hung_one(tmp_path):
    """A test that fails on one rank stops the job there, with that rank's traceback; a rank
    left waiting in a collective times out with its threads' stacks; the tests after them
    are reported as not run, not passed."""
    (tmp_path / "conftest.py").write_text("from ranked.conftest import horovod  # noqa: F401\n")
    failing = tmp_path / "test_failing.py"
    failing.write_text(
        "def test_fails_on_rank_1(horovod):\n"
        "    assert horovod.rank() == 0, 'rank 1 disagrees'\n"
        "def test_after(horovod):\n"
        "    pass\n"
    )
    job = run(failing, tmp_path / "failing", per_test=20, timeout=300)
    why = "\n".join(job.problems("test_fails_on_rank_1"))
    assert "rank 1: " in why and "rank 1 disagrees" in why, why
    assert "no outcome" in "\n".join(job.problems("test_after"))

    hung = tmp_path / "test_hung.py"
    hung.write_text(
        "import torch\n"
        "def test_rank_0_waits_alone(horovod):\n"
        "    if horovod.rank() == 0:\n"
        "        horovod.allreduce(torch.ones(1), name='only_rank_0')\n"
    )
    job = run(hung, tmp_path / "hung", per_test=10, timeout=300)
    why = "\n".join(job.problems("test_rank_0_waits_alone"))
    assert "rank 0 timed out in" in why and "allreduce" in why, why
