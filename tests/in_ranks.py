"""One launch, many tests (as Horovod's own suite runs ``horovodrun -np 2 pytest``): the test
files under tests/ranked/ run inside the ranks of one ``hvdkit run -np 2`` job per group (the
PyTorch files together, and the Keras files together once per Keras backend they list), each
rank a pytest with tests/ranks_plugin.py, and every test's outcome comes back per rank.

A test there runs on every rank in the same order, so its collectives meet; it checks its
ranks against each other (an allgather) and against one process where it can, as every
multi-rank test here does. The ranks stop at the first failure (tests/ranks_plugin.py).
Each test has its own timeout inside the ranks (a hung rank's threads are dumped), the job
has one too, and a test that started on a rank and never ended is named as where the job hung
or died."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RANKED = TESTS / "ranked"
HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def ranked_tests(path: Path) -> list[str]:
    """The test functions of a ranked file, read without importing it (the outer pytest has
    no Horovod job): one outer test each."""
    tree = ast.parse(path.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")]  # fmt: skip


def variants(path: Path) -> dict[str, dict[str, str]]:
    """The jobs a ranked file runs in, by name, with their environment: one per Keras backend
    where the file lists ``KERAS_BACKENDS`` (its tests then get hvdkit.keras), else one."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "KERAS_BACKENDS" for t in node.targets
        ):
            return {b: {"HVDKIT_IN_RANKS_API": "keras", "KERAS_BACKEND": b}
                    for b in ast.literal_eval(node.value)}  # fmt: skip
    return {"": {}}


def groups(paths: list[Path]) -> dict[str, list[Path]]:
    """The ranked files each job runs, by variant name (:func:`variants`): the files that list
    a Keras backend share that backend's job; the others share one job."""
    out: dict[str, list[Path]] = {}
    for path in sorted(paths):
        for variant in variants(path):
            out.setdefault(variant, []).append(path)
    return out


@dataclass
class Job:
    """What one job's ranks reported, per rank: its outcome lines, in order."""

    paths: list[Path]
    np: int
    returncode: int
    output: str
    lines: dict[int, list[dict]] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)  # per rank, if a test timed out

    def outcomes(self, name: str, path: Path | None = None) -> dict[int, list[dict]]:
        """Each rank's outcome lines for test function ``name`` (all its parameters) of file
        ``path`` (None: the job's only file)."""
        assert path is not None or len(self.paths) == 1, "name the file: the job ran several"
        mine = {}
        for rank in range(self.np):
            mine[rank] = [
                ln for ln in self.lines.get(rank, [])
                if ln["event"] not in ("start", "stop") and _function(ln["test"]) == name
                and (path is None or _file(ln["test"]) == path.name)
            ]  # fmt: skip
        return mine

    def unfinished(self) -> dict[int, str]:
        """Per rank, the test it started and never finished (where it hung or died)."""
        out = {}
        for rank in range(self.np):
            started = [ln["test"] for ln in self.lines.get(rank, []) if ln["event"] == "start"]
            ended = {ln["test"] for ln in self.lines.get(rank, []) if ln["event"] == "teardown"
                     or ln["event"] == "call"}  # fmt: skip
            if started and started[-1] not in ended:
                out[rank] = started[-1]
        return out

    def problems(self, name: str, path: Path | None = None) -> list[str]:
        """Why test function ``name`` (of file ``path``) did not pass on every rank (empty: it
        did)."""
        why = []
        for rank, lines in self.outcomes(name, path).items():
            if not lines:
                stuck = self.unfinished().get(rank)
                stop = [ln["why"] for ln in self.lines.get(rank, []) if ln["event"] == "stop"]
                where = (f"hung or died in {stuck}" if stuck else
                         f"stopped first: {stop[0]}" if stop else "ended first")  # fmt: skip
                why.append(f"rank {rank}: no outcome (the job {where})")
                if (stuck and _function(stuck) == name
                        and (path is None or _file(stuck) == path.name)
                        and "Thread 0x" in self.stacks.get(rank, "")):  # fmt: skip
                    dump = self.stacks[rank].split(f"--- {stuck}")[-1][:3000]
                    why.append(f"rank {rank} timed out in {stuck}; its threads:{dump}")
            for ln in lines:
                if ln["outcome"] == "failed":
                    why.append(f"rank {rank}: {ln['test']} failed in {ln['event']}:\n"
                               f"{ln.get('longrepr', '')}")  # fmt: skip
        if why and self.returncode:
            why.append(f"job exit {self.returncode}; its output ends:\n{self.output[-3000:]}")
        return why

    def skipped(self, name: str, path: Path | None = None) -> str | None:
        outcomes = [ln for lines in self.outcomes(name, path).values() for ln in lines]
        if outcomes and all(ln["outcome"] == "skipped" for ln in outcomes):
            why = outcomes[0].get("longrepr", "skipped")
            try:  # pytest's (file, line, reason)
                return str(ast.literal_eval(why)[2])
            except (ValueError, SyntaxError, IndexError, TypeError):
                return why
        return None


def _function(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def _file(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).name


def run(paths: Path | list[Path], where: Path, np: int = 2, per_test: int = 120,
        timeout: int = 900, controller: str = "gloo", env: dict | None = None) -> Job:  # fmt: skip
    """Run the ranked test files ``paths`` in one ``hvdkit run -np NP`` job (one pytest
    session per rank: Horovod starts once for all of them)."""
    paths = [paths] if isinstance(paths, Path) else list(paths)
    where.mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("HVDKIT_CI_SUMMARY", "PYTEST_ADDOPTS")}  # fmt: skip
    environ.update({
        "HVDKIT_IN_RANKS": "1", "HVDKIT_IN_RANKS_DIR": str(where),
        "HVDKIT_IN_RANKS_TIMEOUT": str(per_test),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), str(TESTS / "workers"),
                                                   environ.get("PYTHONPATH")])),
        **(env or {}),
    })  # fmt: skip
    argv = [HVDKIT, "run", "-np", str(np), f"--{controller}", "--", sys.executable, "-m",
            "pytest", "-q", "-p", "ranks_plugin", "-p", "no:cacheprovider",
            "--rootdir", str(TESTS.parent), *map(str, paths)]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              cwd=TESTS.parent, env=environ, stdin=subprocess.DEVNULL)  # fmt: skip
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"") + (exc.stderr or b"")
        code = 124
        output = (text.decode(errors="replace") if isinstance(text, bytes) else text) + (
            f"\nthe job passed its {timeout} s timeout"
        )
    lines, stacks = {}, {}
    for rank in range(np):
        f = where / f"rank-{rank}.stacks"
        stacks[rank] = f.read_text() if f.exists() else ""
        f = where / f"rank-{rank}.jsonl"
        lines[rank] = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
    return Job(paths, np, code, output, lines, stacks)
