"""hvdkit.tensorflow: Horovod's TensorFlow 2 API for custom loops on Keras 3, with real
processes (tests/workers/tf_worker.py, tf_elastic_worker.py) and the two examples."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, horovodrun, results, run_example
from test_elastic import after_kill, elastic_job

pytestmark = pytest.mark.timeout(600)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "controller", ["gloo", pytest.param("mpi", marks=pytest.mark.extra)]  # CI's time budget
)
def test_custom_loop_api_equals_one_process_on_the_global_batch(controller, monkeypatch):
    """Tape (eager and tf.function), the wrapped optimizer in a custom loop, every tape option,
    broadcasts and collectives on Keras 3 variables: each against what one process computes."""
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # add_process_set
    r = results(horovodrun("tf_worker.py", controller=controller, timeout=400))
    assert sorted(r) == [0, 1]
    for rank in (0, 1):
        failed = [name for name, ok in r[rank]["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    # Bit for bit across ranks (the same computation); the loops against each other and
    # the one-process run to a tolerance (checks above): they are different paths.
    assert r[0]["digests"] == r[1]["digests"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("state", ["keras", pytest.param("variables", marks=pytest.mark.extra)])
def test_killed_worker_resumes_from_the_last_commit(tmp_path, state):
    """Horovod's TF2 elastic example shape: kill -9 at step 17 (commit every 5); the survivor
    restores step 15, goes on alone, the host rejoins, and both end with identical weights."""
    out, killed, _ = elastic_job(
        tmp_path, "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2",
        script="tf_elastic_worker.py", worker=("--state", state),
        env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300,
    )  # fmt: skip
    survivor, rejoined, replayed = after_kill(out, killed)
    assert survivor["steps"] == rejoined["steps"] == survivor["batch"] == 80
    assert survivor["lr"] == rejoined["lr"] == pytest.approx(0.02 * 2)  # rescaled, then synced
    recovery = survivor["recovered"][0] - killed["time"]
    print(f"tensorflow ({state}) elastic recovery: {recovery:.2f} s, {replayed} step(s) replayed")


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", ["tensorflow_mnist.py", "tensorflow_mnist_custom_loop.py"])
def test_examples_train_and_end_with_identical_weights(script):
    env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = run_example(script, "--epochs", "5", env=env)
    assert "weights identical on 2 ranks: True" in out, out[-2000:]
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.9, out[-2000:]


def _import_error(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip
    assert out.returncode != 0
    return out.stderr


def test_import_without_tensorflow_names_the_package():
    err = _import_error("import sys; sys.modules['tensorflow'] = None; import hvdkit.tensorflow")
    assert "ImportError: hvdkit.tensorflow needs TensorFlow, which is not installed." in err
    assert "Fix: pip install 'hvdkit[tensorflow-cpu]'" in err


def test_import_on_the_torch_backend_points_to_hvdkit_keras():
    err = _import_error("import hvdkit.tensorflow", KERAS_BACKEND="torch")
    assert "KERAS_BACKEND=torch" in err and "import hvdkit.keras as hvd" in err
