"""The scenario workers' loop over their cases (tests/workers/torch_scenario_worker.py,
keras_scenario_worker.py): one ``CASE`` line per case and rank, and a case that raises ends
the job (the other ranks would wait in a collective for it; the harness starts the cases after
it in another job)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_items(
    items: list[dict[str, Any]],
    workdir: Path,
    rank: int,
    run: Callable[[dict[str, Any], Path], dict[str, Any]],
) -> None:
    """``run(item, its folder)`` for each item, in order, printing its record."""
    for item in items:
        where = workdir / f"case-{item['id']}"
        where.mkdir(parents=True, exist_ok=True)
        try:
            result = run(item, where)
        except Exception:  # noqa: BLE001 - reported per case, then the job ends
            result = {"error": traceback.format_exc()[-1500:]}
        result.update(case=item["id"], rank=rank)
        print("CASE " + json.dumps(result), flush=True)
        if "error" in result:
            sys.stdout.flush()
            os._exit(3)
