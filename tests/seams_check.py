"""The seam matrix's check: what a job's ranks reported (tests/workers/seams_worker.py's
result) against tests/seams.py's oracle, and the ledger of the samples each epoch trained.
It imports no ``conftest``, so that tests inside the ranks of a job (tests/ranked/) use it
too."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import seams
from workers.seams_worker import Indexed, make_model
from workers.tolerance import max_difference, paths_close


def logged(log: Path) -> dict[int, Counter]:
    """Every sample index trained in each epoch, over every rank and run that logged there."""
    trained: dict[int, Counter] = {}
    for path in sorted(log.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            trained.setdefault(entry["epoch"], Counter()).update(entry["indices"])
    return trained


def check_like_the_oracle(
    ranks: dict[int, dict], log: Path | None, oracle: seams.Job, context: str = ""
) -> None:
    """Ranks equal bit for bit; weights (to the path tolerance), steps, LR in force and the
    scheduler's LR equal the oracle's; with ``log``, every epoch trained the oracle's samples.
    ``context`` (the job's output) is shown when the ranks did not all report."""
    sizes = {r["size"] for r in ranks.values()}
    assert sorted(ranks) == list(range(sizes.pop())), context
    assert len({json.dumps(r["weights"]) for r in ranks.values()}) == 1  # ranks: bit for bit
    mine = ranks[0]
    expected = seams.run(oracle, Indexed(), make_model())
    assert mine["steps"] == expected["steps"]
    difference = max_difference(mine["weights"], expected["weights"])
    print(f"max difference from the oracle: {difference:.3g} after {mine['steps']} steps")
    assert paths_close(mine["weights"], expected["weights"], steps=expected["steps"]), difference
    assert mine["lr_in_force"] == pytest.approx(expected["lr_in_force"], rel=1e-12)
    if mine["scheduler_lr"] is not None:
        assert mine["scheduler_lr"] == pytest.approx(oracle.lr * 0.5**oracle.epochs, rel=1e-12)
    if log is None:
        return
    trained = logged(log)
    assert sorted(trained) == list(range(oracle.epochs)), (sorted(trained), sorted(log.iterdir()))
    for epoch, counts in trained.items():
        assert counts == Counter(expected["trained"][epoch]), epoch
        assert set(counts) == set(range(len(Indexed())))  # every sample, every epoch
