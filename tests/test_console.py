"""What a newcomer sees: the docs' `make run` and a two-rank PyTorch job through `hvdkit
run` print whole lines, no framework start-up noise, and their accuracy line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from hvdkit.launch.console import is_noise

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]
HVDKIT = str(Path(sys.executable).parent / "hvdkit")
RAW_TAG = re.compile(r"\[\d+(,\d+)?\]<(stdout|stderr)>")


def check_console(text: str) -> list[str]:
    lines = text.splitlines()
    assert not [line for line in lines if RAW_TAG.search(line)], "a rank tag inside a line"
    assert not [line for line in lines if is_noise(re.sub(r"^\[rank \d+\] ", "", line))]
    assert not [line for line in lines if "\x1b" in line or "\b" in line], "escape codes"
    return lines


@pytest.mark.slow
def test_make_run_prints_clean_whole_lines():
    out = subprocess.run(["make", "run"], capture_output=True, text=True, cwd=ROOT, timeout=850,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # What the job printed comes after make's own lines (the setup step and the command).
    job = out.stdout.split("examples/keras_mnist.py --epochs 10\n", 1)[1]
    lines = check_console(job + out.stderr)
    assert any(re.fullmatch(r"test accuracy: 0\.\d+", line) for line in lines), job[-2000:]
    assert sum(line.startswith("Epoch ") for line in lines) == 10  # one progress report


def test_a_pytorch_job_imports_no_tensorflow_anywhere():
    # --verbose keeps every line, so TensorFlow's start-up logging would show if anything
    # (the launcher's build checks, a rank) imported it.
    out = subprocess.run(
        [HVDKIT, "run", "-np", "2", "--gloo", "--verbose", "--", sys.executable,
         "examples/pytorch_mnist.py", "--epochs", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "absl::InitializeLog" not in text and "cudart_stub" not in text
    assert re.search(r"^test accuracy: 0\.\d+$", out.stdout, re.M), out.stdout[-2000:]
    quiet = subprocess.run(
        [HVDKIT, "run", "-np", "2", "--gloo", "--", sys.executable,
         "examples/pytorch_mnist.py", "--epochs", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert quiet.returncode == 0
    lines = check_console(quiet.stdout + quiet.stderr)
    assert lines[0].startswith("data: ")  # the program's first line is the first line shown


def test_the_suites_result_reader_rejoins_a_line_mpi_cut():
    """tests/conftest.results: MPI cuts a long line into tagged pieces, the tag inline."""
    from conftest import results

    whole = '{"rank": 1, "weights": [1.5, 2.5], "ok": true}'
    text = (
        '[1,0]<stdout>:RESULT {"rank": 0}\n'
        f"[1,1]<stdout>:RESULT {whole[:25]}[1,0]<stdout>:noise\n[1,1]<stdout>:{whole[25:]}\n"
    )
    out = results(subprocess.CompletedProcess([], 0, text, ""))
    assert out == {0: {"rank": 0}, 1: {"rank": 1, "weights": [1.5, 2.5], "ok": True}}


def test_a_keras_progress_bar_leaves_one_clean_line_per_epoch_in_a_log(tmp_path):
    """Keras draws its bar with colours and backspaces whatever its output is. Into a pipe,
    `hvdkit run` writes each epoch's final bar once, without escape codes; under MPI (a tag per
    write) the bar's updates used to come out as lines of horovodrun's own."""
    script = tmp_path / "fit.py"
    script.write_text(
        "import keras, numpy as np\n"
        "import hvdkit.keras as hvd\n"
        "hvd.init()\n"
        "x = np.random.default_rng(0).normal(size=(256, 8)).astype('float32')\n"
        "model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])\n"
        "session = hvd.setup(model, keras.optimizers.SGD(0.01))\n"
        "model.compile(optimizer=session.optimizer, loss='mse')\n"
        "session.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=1)\n"
    )
    out = subprocess.run(
        [HVDKIT, "run", "-np", "2", "--mpi", "--", sys.executable, str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "KERAS_BACKEND": "torch"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = check_console(out.stdout)
    bars = [line for line in lines if re.match(r"^\s*\d+/16 ", line)]
    assert lines.count("Epoch 1/2") == 1 and len(bars) == 2, out.stdout
    assert all(line.startswith("16/16 ") for line in bars), bars
