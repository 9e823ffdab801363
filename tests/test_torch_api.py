"""horovod.torch's whole public API through hvdkit.torch: names and signatures (no processes),
and the ops with real processes (tests/workers/torch_api_worker.py, 2 ranks, Gloo and MPI)."""

from __future__ import annotations

import inspect
import json

import horovod.torch
import pytest
from conftest import horovodrun, results
from test_parity import public

import hvdkit.torch

# Public name of horovod.torch -> why hvdkit.torch does not offer it as Horovod does.
ALLOWED: dict[str, str] = {}

# hvdkit's own additions to the API (not in Horovod).
EXTRAS = {"backward_and_step", "Session", "setup"}


def parameters(obj: object) -> list[tuple[str, object, object]] | None:
    """(name, kind, default) of each parameter; None where there is no Python signature."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def differences() -> list[str]:
    problems = []
    for name in sorted(public(horovod.torch)):
        if name in ALLOWED:
            continue
        if not hasattr(hvdkit.torch, name):
            problems.append(f"{name}: missing")
            continue
        theirs, ours = getattr(horovod.torch, name), getattr(hvdkit.torch, name)
        if theirs is ours:
            continue
        if callable(theirs) != callable(ours) or inspect.isclass(theirs) != inspect.isclass(ours):
            problems.append(f"{name}: a {type(ours).__name__} here, a {type(theirs).__name__} there")
            continue
        if inspect.isclass(theirs) and not issubclass(ours, theirs):
            problems.append(f"{name}: not a subclass of Horovod's class")
        a, b = parameters(theirs), parameters(ours)
        if a is None or not callable(theirs):
            continue
        if b is None:
            problems.append(f"{name}: no inspectable signature here")
            continue
        # Horovod's parameters in Horovod's order, of the same kind; defaults equal (or, where
        # hvdkit gives a default to a parameter Horovod requires, that only widens it).
        # Anything beyond Horovod's must be optional.
        for i, (pname, kind, default) in enumerate(a):
            if i >= len(b) or b[i][0] != pname or b[i][1] != kind:
                problems.append(f"{name}: parameter {i} is {b[i][:2] if i < len(b) else None}, "
                                f"Horovod has {(pname, kind)}")  # fmt: skip
                break
            if default is not inspect.Parameter.empty and b[i][2] is not default and b[i][2] != default:
                problems.append(f"{name}: {pname}={b[i][2]!r} here, {default!r} in Horovod")
        for pname, kind, default in b[len(a):]:
            if default is inspect.Parameter.empty and kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
            ):
                problems.append(f"{name}: extra required parameter {pname}")
    return problems


def test_every_public_name_of_horovod_torch_with_its_signature():
    problems = differences()
    assert not problems, "hvdkit.torch vs horovod.torch:\n  " + "\n  ".join(problems)


def test_the_allow_list_names_only_what_horovod_has():
    assert set(ALLOWED) <= set(public(horovod.torch))


def test_all_is_sorted_and_complete():
    names = hvdkit.torch.__all__
    assert names == sorted(names, key=str.lower), "keep __all__ sorted (case-insensitive)"
    assert len(set(names)) == len(names)
    assert set(names) == set(public(hvdkit.torch))
    assert set(public(horovod.torch)) - set(ALLOWED) <= set(names)
    assert set(names) - set(public(horovod.torch)) == EXTRAS
    namespace: dict = {}
    exec("from hvdkit.torch import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(names)


def test_the_rest_is_horovods_own_objects():
    """Only what hvdkit fixes is its own; everything else is Horovod's object itself."""
    own = {n for n in public(horovod.torch) if getattr(hvdkit.torch, n) is not getattr(horovod.torch, n)}
    assert own == {
        "broadcast_optimizer_state", "broadcast_parameters", "DistributedOptimizer",
        "SyncBatchNorm", "init",  # init: first stops a process no launcher started
        "Compression",  # Horovod's subclassed, with bf16 added
        # Horovod's, refusing a 0-d tensor first (hvdkit.torch.collectives says why):
        "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
        "alltoall", "alltoall_async",
    }  # fmt: skip
    assert issubclass(hvdkit.torch.Compression, horovod.torch.Compression)
    assert hvdkit.torch.Compression.fp16 is horovod.torch.Compression.fp16


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_the_api_with_real_processes(tmp_path, monkeypatch, controller):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # add/remove_process_set
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's switch for start_timeline
    timeline = tmp_path / "timeline.json"
    r = results(horovodrun("torch_api_worker.py", str(timeline), controller=controller))
    assert sorted(r) == [0, 1]
    for rank in (0, 1):
        assert r[rank]["mpi"] == (controller == "mpi")
        failed = {name: ok for name, ok in r[rank]["checks"].items() if ok is not True}
        assert not failed, f"rank {rank}: {json.dumps(failed, indent=1)}"
    assert len(r[0]["checks"]) >= 30
    # Chrome trace format: a JSON list of events, Horovod's closing "]" optional.
    text = timeline.read_text().strip()
    events = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")
    assert any("timed.op" in json.dumps(e) for e in events), text[:500]
