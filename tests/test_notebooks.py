"""hvdkit.run from a real Jupyter kernel (nbclient, through tests/nbrun.py): the example
notebooks (ResNet-18 on Fashion-MNIST-shaped data, Keras fit on each backend) train on 2
ranks to identical weights equal to one process over the same global batches; a rank's
exception shows in its cell, naming the rank; an interrupt stops every rank and leaves no
process; the kernel's next call works; and the ResNet notebook runs unchanged across two ssh
hosts (tests/netns.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT
from nbformat.v4 import new_code_cell, new_notebook
from test_func_run import leftover_ranks
from test_launch_ssh import two_hosts  # noqa: F401 - the fixture

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]
NBRUN = str(ROOT / "tests" / "nbrun.py")
EXAMPLES = ROOT / "examples"


def execute(tmp_path, notebook: Path, *options: str, env=None, prefix=(), timeout=600):
    """The notebook's code cells as tests/nbrun.py reports them."""
    out_json = tmp_path / f"{notebook.stem}.out.json"
    done = subprocess.run([*prefix, sys.executable, NBRUN, str(notebook), str(out_json),
                           "--cwd", str(tmp_path), *options], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out_json.read_text())


def text(cell: dict, stream: str = "stdout") -> str:
    outputs = cell["outputs"]
    return "".join(o["text"] for o in outputs if o["type"] == "stream" and o["name"] == stream)


def errors(cells: list[dict]) -> list[dict]:
    return [o for c in cells for o in c["outputs"] if o["type"] == "error"]


def test_the_resnet_notebook_trains_like_one_process(tmp_path):
    """Seed 000's shape in a notebook: ResNet-18, Fashion-MNIST-shaped images, 2 ranks, in
    float64 so that the one-process oracle holds to rounding's precision (float32 rounding
    is amplified by batch norm: the notebook says so)."""
    cells = execute(tmp_path, EXAMPLES / "notebook_pytorch_resnet.ipynb",
                    "--set", "STEPS=2", "--set", 'DTYPE="float64"')  # fmt: skip
    assert not errors(cells), errors(cells)
    runs = text(cells[2])
    # Rank 0's lines arrive in the cell (2 ranks, then 1 process); rank 1's are not shown.
    assert runs.count("rank 0: step 2/2, loss") == 2 and "rank 1:" not in runs
    assert "2 ranks identical: True; largest difference from one process:" in text(cells[3])


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_the_keras_notebook_fits_on_each_backend(tmp_path, backend):
    cells = execute(tmp_path, EXAMPLES / "notebook_keras_fit.ipynb",
                    env={"KERAS_BACKEND": backend})  # fmt: skip
    assert not errors(cells), errors(cells)
    fit = text(cells[2])
    # Rank 0's progress bar redraws in place ("\r"), once per run, and ends each epoch.
    assert fit.count("Epoch 2/2") == 2 and "\r1/8 " in fit and "8/8 " in fit
    assert "\x1b[" not in fit  # no terminal codes in a cell
    assert f"backend {backend}: 2 ranks identical: True" in text(cells[3])


def notebook(tmp_path, *sources: str) -> Path:
    path = tmp_path / "case.ipynb"
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}  # fmt: skip
    nbformat.write(nb, path)
    return path


def test_an_exception_on_rank_1_shows_in_the_cell_and_the_next_call_works(tmp_path):
    path = notebook(tmp_path, "import hvdkit", """\
def check_shapes(expected):
    import hvdkit.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(f"rank {hvd.rank()} got 3 columns, expected {expected}")
    return hvd.rank()""", "hvdkit.run(check_shapes, args=(4,), num_proc=2)",
                    "hvdkit.run(lambda: 'again', num_proc=2)")  # fmt: skip
    cells = execute(tmp_path, path)
    (error,) = errors(cells)
    assert error["ename"] == "RankError"
    assert error["evalue"].startswith("rank 1 (host localhost) raised ValueError: rank 1 got 3 "
                                      "columns, expected 4")  # fmt: skip
    assert "in check_shapes" in error["evalue"]  # rank 1's traceback, in the cell
    assert "ValueError: rank 1 got 3 columns" in error["traceback"]  # the cause, shown first
    assert cells[3]["outputs"][0]["text"] == "['again', 'again']"
    assert not leftover_ranks()


def test_an_interrupt_stops_every_rank_and_the_kernel_goes_on(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = notebook(tmp_path, "import hvdkit", f"""\
def wait_forever():
    import os, time
    from hvdkit import rank_zero
    open(os.path.join({str(marks)!r}, str(rank_zero.rank())), "w").close()
    time.sleep(600)""", "hvdkit.run(wait_forever, num_proc=2)",
                    "hvdkit.run(lambda: 7, num_proc=2)")  # fmt: skip
    cells = execute(tmp_path, path, "--interrupt", "2", "--when", f"{marks}/*", "--count", "2")
    (error,) = errors(cells)
    assert error["ename"] == "KeyboardInterrupt" and "every rank was stopped" in error["evalue"]
    assert cells[2]["after_interrupt_s"] < 30  # stopped in seconds, not at the sleep's end
    assert not leftover_ranks()  # checked after the cell: nothing left
    assert cells[3]["outputs"][0]["text"] == "[7, 7]"


@pytest.mark.slow
def test_the_resnet_notebook_runs_across_two_ssh_hosts(tmp_path, two_hosts):  # noqa: F811
    hosts = ",".join(f"{addr}:1" for addr in two_hosts.hosts.values())
    out_json = tmp_path / "ssh.out.json"
    done = two_hosts.run_in_launcher(
        [sys.executable, NBRUN, str(EXAMPLES / "notebook_pytorch_resnet.ipynb"), str(out_json),
         "--cwd", str(tmp_path), "--set", f"HOSTS={hosts!r}", "--set", 'NICS=["hvd0"]',
         "--set", "STEPS=2", "--set", 'DTYPE="float64"'], timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cells = json.loads(out_json.read_text())
    assert not errors(cells), errors(cells)
    assert "2 ranks identical: True" in text(cells[3])
