"""The compatibility matrix, run for real: ``make matrix`` (or ``python tests/matrix.py``).

Each cell is a user's environment: a fresh venv of one Python, the frameworks installed the way
a user would (``pip install torch``, PyPI's default wheel, often a CUDA build), then hvdkit from
a built wheel, ``hvdkit build-horovod``, ``hvdkit doctor``, and 2-rank runs whose ranks must
end equal (one step on 2 ranks equal to one process on the global batch; training that ends
with bit-identical weights on both ranks). It prints one table row per cell.

    python tests/matrix.py                       # every cell
    python tests/matrix.py --cells py312-torch215 py312-tf221
    python tests/matrix.py --list

Horovod wheels are cached per cell by hvdkit's own cache (the key covers Python, the framework
versions and the CUDA part), so a second run reuses them; ``--no-cache`` compiles again. The
venvs live under ``--workdir`` and are made afresh for every run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tests/ and the checkout: .ci/run starts --prepare with setup's interpreter, before the venv.
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from conftest import results  # noqa: E402

from hvdkit.horovod_build.versions import version_tuple  # noqa: E402

# One step on 2 ranks against one process on the global batch, and training to equal weights:
# the checks tests/test_*_adapter.py make on the project's own stack.
TORCH_CHECKS = (("torch_worker.py", "one_step"), ("torch_worker.py", "train", "--epochs", "2"))
KERAS_CHECKS = (("keras_worker.py", "one_step"), ("keras_worker.py", "fit"))


@dataclass(frozen=True)
class Cell:
    """One environment: a Python, what a user pip-installs, and the 2-rank checks to run."""

    name: str
    python: str
    packages: tuple[str, ...]
    checks: tuple[tuple[str, ...], ...]
    note: str
    keras_backend: str | None = None
    # pip's cap on this machine (/etc/xdg/pip) holds torch at 2.14.1; newer is a user's default.
    lift_cap: bool = False
    env: dict[str, str] = field(default_factory=dict)
    build_args: tuple[str, ...] = ()


CELLS: tuple[Cell, ...] = (
    Cell(
        "py311-pins",
        "3.11",
        ("torch==2.13.0", "tensorflow-cpu==2.21.0", "keras==3.15.1"),
        TORCH_CHECKS + KERAS_CHECKS,
        "the project's pins: CPU torch 2.13.0 + tensorflow-cpu 2.21",
    ),
    Cell(
        "py311-torch2141-nccl",
        "3.11",
        ("torch==2.14.1", "cuda-toolkit[nvcc,cccl]==13.0.3"),
        TORCH_CHECKS,
        "torch 2.14.1 (CUDA 13.0) with nvcc from the cuda-toolkit wheels torch depends on; "
        "Horovod built with NCCL for sm_90, no GPU; the CI cell",
        build_args=("--gpu-operations", "NCCL", "--cuda-arch", "90"),
    ),
    Cell(
        "py312-torch215",
        "3.12",
        ("torch",),
        TORCH_CHECKS,
        "PyPI's default torch (2.15.0+cu132, with the nvidia cu13 wheels), no GPU",
        lift_cap=True,
    ),
    Cell(
        "py312-torch2141",
        "3.12",
        ("torch==2.14.1",),
        TORCH_CHECKS,
        "torch 2.14.1 from PyPI (a CUDA 13 build), no GPU",
    ),
    Cell(
        "py312-tf221",
        "3.12",
        ("tensorflow-cpu==2.21.0",),
        KERAS_CHECKS,
        "tensorflow-cpu 2.21 + its Keras 3, no torch",
        keras_backend="tensorflow",
    ),
    Cell(
        "py312-jax-keras",
        "3.12",
        ("jax==0.10.2", "keras", "torch==2.14.1"),
        KERAS_CHECKS,
        "JAX 0.10.2 + Keras 3 on its JAX backend, no TensorFlow; Horovod built for torch, "
        "through which hvdkit forms JAX's world",
        keras_backend="jax",
    ),
    Cell(
        "py313-torch-keras",
        "3.13",
        ("torch", "keras"),
        TORCH_CHECKS + KERAS_CHECKS,
        "the newest torch + Keras 3 on its torch backend, no TensorFlow",
        keras_backend="torch",
        lift_cap=True,
    ),
)


@dataclass
class Row:
    """What one cell measured."""

    cell: str
    versions: str = ""
    install_s: float = 0.0
    build: str = "not run"
    doctor: str = "not run"
    example: str = "not run"
    ok: bool = False
    error: str = ""


def render(rows: list[Row]) -> str:
    """The Markdown table docs/guides/install.md shows."""
    lines = [
        "| cell | versions | install | Horovod build | doctor | 2-rank checks |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.cell} | {row.versions} | {row.install_s:.0f} s | {row.build} | "
            f"{row.doctor} | {row.example} |"
        )
    return "\n".join(lines)


def find_python(version: str) -> str | None:
    """``pythonX.Y`` on PATH, else pyenv's newest X.Y; one that runs (a pyenv shim on PATH
    may exist and refuse to run a version that is not selected)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    installed = [d for d in root.glob(f"{version}.*") if d.name.replace(".", "").isdigit()]
    installed.sort(key=lambda d: version_tuple(d.name), reverse=True)  # 3.11.10 after 3.11.9
    candidates = [shutil.which(f"python{version}")] + [
        str(d / "bin" / f"python{version}") for d in installed
    ]
    for exe in filter(None, candidates):
        try:
            ok = subprocess.run([exe, "--version"], capture_output=True, timeout=30).returncode
        except OSError:
            continue
        if ok == 0:
            return exe
    return None


def check_result(check: tuple[str, ...], by_rank: dict[int, dict]) -> str | None:
    """Why a 2-rank check's results are wrong, or None when both ranks agree as they must."""
    if sorted(by_rank) != [0, 1]:
        return f"results from ranks {sorted(by_rank)}, want [0, 1]"
    if check[1] == "one_step":
        tol = 1e-6 if check[0].startswith("torch") else 1e-5
        for rank, r in by_rank.items():
            if not (r["diff"] < tol and r["moved"] > 1e-3):
                return f"rank {rank}: diff {r['diff']:.2e} from one process (tol {tol}), moved {r['moved']:.2e}"
        return None
    key = "params" if check[0].startswith("torch") else "weights"
    if by_rank[0][key] != by_rank[1][key]:
        return f"ranks ended with different weights: {by_rank[0][key]} vs {by_rank[1][key]}"
    return None


@contextlib.contextmanager
def installing(cell: str) -> Iterator[None]:
    """Held while a cell's venv is installed and its Horovod built. CI prepares the CI cell
    in the background at the lowest priority (``--prepare``, from ``.ci/run``), filling the
    cores the other tests leave idle; the test then waits for it and finds pip's downloads
    and the Horovod wheel cached, rather than compiling the same wheel beside it."""
    path = Path(tempfile.gettempdir()) / f"hvdkit-matrix-{cell}.lock"
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the test's own timeout bounds the wait
        yield


class Runner:
    """Runs cells: one venv each under ``workdir``, commands logged to ``<cell>.log``."""

    def __init__(self, workdir: Path, wheel: Path, use_cache: bool, say: Callable[[str], None]):
        self.workdir, self.wheel, self.use_cache, self.say = workdir, wheel, use_cache, say

    def _run(self, cell: Cell, argv: list[str], env: dict[str, str], timeout: float):
        log = self.workdir / f"{cell.name}.log"
        with log.open("a") as fh:
            fh.write(f"\n$ {' '.join(argv)}\n")
        try:
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{argv[0]} {argv[1:3]} timed out after {timeout:.0f} s") from exc
        with log.open("a") as fh:
            fh.write(out.stdout + out.stderr + f"\n(exit {out.returncode})\n")
        return out

    def run(self, cell: Cell, prepare_only: bool = False, installed: bool = False) -> Row:
        """The cell's row; ``prepare_only``: install and build, no checks; ``installed``:
        checks only, in the venv a ``--prepare`` run left under ``workdir``."""
        row = Row(cell.name)
        try:
            if installed:
                env = self._env(cell)
            else:
                with installing(cell.name):
                    env = self._install(cell, row)
            if not prepare_only:
                self._check(cell, row, env)
        except RuntimeError as exc:
            row.error = str(exc)
        row.ok = row.ok or (prepare_only and not row.error)
        return row

    def _env(self, cell: Cell) -> dict[str, str]:
        """The environment the cell's commands run in (its venv first on PATH)."""
        venv = self.workdir / cell.name
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(cell.env, PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        if cell.keras_backend:
            env["KERAS_BACKEND"] = cell.keras_backend
        if cell.lift_cap:
            empty = self.workdir / "no-constraints.txt"
            empty.write_text("")
            env["PIP_CONSTRAINT"] = str(empty)
        return env

    def _install(self, cell: Cell, row: Row) -> dict[str, str]:
        """The venv, the packages, hvdkit's wheel and the Horovod build; the environment the
        cell's commands run in."""
        python = find_python(cell.python)
        if python is None:
            raise RuntimeError(f"no python{cell.python} (install it, e.g. pyenv install)")
        venv = self.workdir / cell.name
        shutil.rmtree(venv, ignore_errors=True)
        (self.workdir / f"{cell.name}.log").unlink(missing_ok=True)
        (self.workdir / f"{cell.name}.prepared").unlink(missing_ok=True)
        env = self._env(cell)
        bin_ = venv / "bin"
        start = time.monotonic()
        self._ok(cell, [python, "-m", "venv", str(venv)], env, 120, "venv")
        pip = [str(bin_ / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        self._ok(cell, [*pip, *cell.packages], env, 1800, "pip install " + " ".join(cell.packages))
        self._ok(cell, [*pip, f"{self.wheel}[examples]"], env, 600, "pip install hvdkit")
        row.install_s = time.monotonic() - start
        row.versions = self._versions(cell, bin_, env)
        self.say(f"[{cell.name}] installed in {row.install_s:.0f} s: {row.versions}")

        start = time.monotonic()
        build = [str(bin_ / "hvdkit"), "build-horovod", *cell.build_args]
        build += [] if self.use_cache else ["--no-cache"]
        out = self._run(cell, build, env, 3600)
        took = time.monotonic() - start
        if out.returncode != 0:
            row.build = f"FAIL ({took:.0f} s)"
            raise RuntimeError("build failed:\n" + (out.stdout + out.stderr)[-2500:])
        how = "cached" if "Reusing cached wheel" in out.stdout else "compiled"
        row.build = f"{how}, {took:.0f} s"
        self.say(f"[{cell.name}] Horovod {row.build}")
        return env

    def _check(self, cell: Cell, row: Row, env: dict[str, str]) -> None:
        """``hvdkit doctor`` and the 2-rank checks in the installed cell."""
        bin_ = self.workdir / cell.name / "bin"
        out = self._run(cell, [str(bin_ / "hvdkit"), "doctor"], env, 900)
        summary = (out.stdout.strip().splitlines() or ["(no output)"])[-1]
        skips = sum(1 for line in out.stdout.splitlines() if line.startswith("SKIP"))
        row.doctor = summary.replace(" checks passed", " PASS").replace(" failed", " FAIL")
        row.doctor += f", {skips} SKIP" if skips else ""
        self.say(f"[{cell.name}] doctor: {row.doctor}")
        if out.returncode != 0:
            raise RuntimeError("doctor failed:\n" + out.stdout[-2500:])

        passed = []
        for check in cell.checks:
            argv = [str(bin_ / "hvdkit"), "run", "-np", "2", "--", str(bin_ / "python"),
                    f"tests/workers/{check[0]}", *check[1:]]  # fmt: skip
            out = self._run(cell, argv, env, 600)
            wrong = (
                f"exit {out.returncode}: {(out.stdout + out.stderr)[-1500:]}"
                if out.returncode != 0
                else check_result(check, results(out))
            )
            name = f"{check[0].split('_')[0]} {check[1]}"
            if wrong:
                row.example = f"FAIL {name}"
                raise RuntimeError(f"{name}: {wrong}")
            passed.append(name)
        row.example = f"{len(passed)}/{len(cell.checks)} equal ranks ({', '.join(passed)})"
        row.ok = True

    def _ok(self, cell: Cell, argv: list[str], env: dict[str, str], timeout: float, what: str):
        out = self._run(cell, argv, env, timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{(out.stdout + out.stderr)[-2500:]}")
        return out

    def _versions(self, cell: Cell, bin_: Path, env: dict[str, str]) -> str:
        code = (
            "import importlib.metadata as m, platform\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try: return m.version(n)\n"
            "        except m.PackageNotFoundError: pass\n"
            "print(', '.join(x for x in [f'Python {platform.python_version()}',"
            " 'torch ' + v('torch') if v('torch') else '',"
            " 'TF ' + v('tensorflow', 'tensorflow-cpu') if v('tensorflow', 'tensorflow-cpu') else '',"
            " 'Keras ' + v('keras') if v('keras') else '',"
            " 'JAX ' + v('jax') if v('jax') else ''] if x))"
        )
        out = self._ok(cell, [str(bin_ / "python"), "-c", code], env, 60, "versions")
        return out.stdout.strip()


def build_wheel(outdir: Path) -> Path:
    """hvdkit's own wheel, as a user would install it."""
    outdir.mkdir(parents=True, exist_ok=True)
    for old in outdir.glob("hvdkit-*.whl"):
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(outdir), str(ROOT)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return next(outdir.glob("hvdkit-*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="*", help="cell names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cells and stop")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hvdkit-matrix"))
    parser.add_argument("--no-cache", dest="use_cache", action="store_false")
    parser.add_argument(
        "--prepare", action="store_true",
        help="install and build only, marking each venv ready (CELL.prepared): .ci/run does "
        "this in the background for the CI cell, whose test then runs its checks there",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.list:
        for cell in CELLS:
            print(f"{cell.name:20} Python {cell.python}: {cell.note}")
        return 0
    by_name = {c.name: c for c in CELLS}
    unknown = [n for n in args.cells or () if n not in by_name]
    if unknown:
        parser.error(f"unknown cell(s) {', '.join(unknown)}; --list shows them")
    cells = [by_name[n] for n in args.cells] if args.cells else list(CELLS)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.workdir, build_wheel(args.workdir / "dist"), args.use_cache, print)
    rows = []
    for cell in cells:
        start = time.monotonic()
        rows.append(runner.run(cell, prepare_only=args.prepare))
        mark = "ok" if rows[-1].ok else f"FAILED: {rows[-1].error[:2000]}"
        print(f"[{cell.name}] {time.monotonic() - start:.0f} s in all, {mark}", flush=True)
        if args.prepare and rows[-1].ok:
            (args.workdir / f"{cell.name}.prepared").touch()  # what the test looks for
    if args.prepare:
        return 0 if all(r.ok for r in rows) else 1
    table = render(rows)
    stamp = time.strftime("%Y-%m-%d")
    (args.workdir / "matrix.md").write_text(f"Measured {stamp}:\n\n{table}\n")
    (args.workdir / "matrix.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print(f"\n{table}\n\n(also in {args.workdir / 'matrix.md'})")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
