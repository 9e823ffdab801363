"""Shared helpers: launching real Horovod jobs and reading what each rank reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_ALL = "HVDKIT_TEST_ALL"


def pytest_collection_modifyitems(config, items) -> None:
    """The image tests go last: CI builds the image in the background meanwhile
    (``tests/containers.py``), so they find it built. Tests marked ``extra`` run only under
    ``make test-all``: CI has a time budget."""
    items.sort(key=lambda item: item.path.name == "test_docker_image.py")  # stable
    if os.environ.get(TEST_ALL) == "1":
        return
    import pytest

    skip = pytest.mark.skip(reason=f"marked extra: make test-all ({TEST_ALL}=1) runs it")
    variant = pytest.mark.skip(reason=f"a variant CI covers once: make test-all ({TEST_ALL}=1)")
    for item in items:
        if "extra" in item.keywords:
            item.add_marker(skip)
        elif item.nodeid.split("::", 1)[-1] in VARIANTS_LEFT_TO_TEST_ALL:
            item.add_marker(variant)


# Cases whose code path CI already runs elsewhere (another case of the same test: the other
# Keras backend, the other controller, eager against graph; or the test named beside it),
# left to `make test-all` for CI's time budget (README, "Tests and CI"). Each behaviour keeps
# at least one case per Keras backend and framework in CI.
VARIANTS_LEFT_TO_TEST_ALL = frozenset(
    {
        # test_keras_adapter.py: the [tensorflow] case stays (examples_keras[torch] resumes on
        # torch); the eager fits differ from the graph fits by one compile flag.
        "test_setup_checkpoints_on_rank0_only_and_resumes_by_broadcast[torch]",
        "test_bad_checkpoint_stops_every_rank_naming_the_file[torch]",
        "test_metric_average_is_global_on_unequal_shards_whatever_the_callback_order[torch]",
        "test_weights_identical_on_all_ranks_after_fit[torch-fit_eager]",
        "test_weights_identical_on_all_ranks_after_fit[tensorflow-fit_eager]",
        # warmup and the LR schedule: one float and one schedule case, one per backend.
        "test_warmup_reaches_full_lr_at_the_right_step[torch-schedule]",
        "test_warmup_reaches_full_lr_at_the_right_step[tensorflow-float]",
        "test_lr_schedule_callback_multiplies_from_its_start_epoch[torch-schedule]",
        "test_lr_schedule_callback_multiplies_from_its_start_epoch[tensorflow-float]",
        # test_keras_parity.py, test_keras_collectives.py: TensorFlow under MPI stays.
        "test_horovod_keras_script_shapes_end_in_sync[tensorflow-gloo]",
        "test_ranks_that_drift_apart_stop_the_job[torch]",
        "test_collectives_on_every_backend[tensorflow-gloo]",
        "test_the_sync_guard_can_be_turned_off",  # the guard's knob; the guard itself stays
        # test_allreduce_from_scratch.py: the lesson at 2 ranks stays, and its failing case.
        "test_four_ranks_on_a_two_slot_machine",
        # test_elastic.py: a kill on each backend, one with KerasState, one with the session.
        "test_keras_killed_worker_costs_one_commit_interval_and_its_host_rejoins[torch-state]",
        "test_keras_killed_worker_costs_one_commit_interval_and_its_host_rejoins"
        "[tensorflow-session]",
        # test_examples_keras.py: keras_mnist.py on TensorFlow is also `make run`'s job
        # (test_console.py); its resume is test_keras_adapter's [tensorflow] case.
        "test_keras_mnist_reaches_90_percent_on_digits_and_resumes[tensorflow]",
        # test_torch_adapter.py: Gloo stays (MPI: test_torch_api.py[mpi] and the ResNet
        # example); the corrupt checkpoint stays for the checkpoint error path.
        "test_params_identical_on_all_ranks_after_training[mpi]",
        # test_elastic.py: keras_elastic.py's loop is the killed-worker cases' [torch-session].
        "test_elastic_example_trains_on_two_hosts[keras_elastic.py --backend torch]",
        # test_tensorflow.py: tensorflow_mnist.py's optimizer is hvdkit.keras's, which
        # test_keras_adapter.py covers; the custom-loop example stays.
        "test_examples_train_and_end_with_identical_weights[tensorflow_mnist.py]",
        # test_doctor.py: the full doctor run; the image build's gate runs the same checks and
        # fails the build on any FAIL (test_docker_image.py), the ssh test runs it across hosts.
        "test_doctor_passes_with_allreduce_for_both_frameworks_and_controllers",
    }
)
WORKERS = Path(__file__).resolve().parent / "workers"
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def interruptible() -> None:
    """``preexec_fn`` for a process the test will Ctrl-C: SIGINT back to its default. A shell
    without job control starts background commands with SIGINT ignored, and that is inherited
    (a suite run in the background would start hvdkit deaf to the test's Ctrl-C); a user's
    terminal gives it the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def horovodrun(
    script: str,
    *args: str,
    np: int = 2,
    controller: str = "gloo",
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``horovodrun -np N -H localhost:N --gloo|--mpi python tests/workers/SCRIPT ARGS``."""
    argv = [
        HOROVODRUN,
        "-np",
        str(np),
        "-H",
        f"localhost:{np}",
        f"--{controller}",
        sys.executable,
        str(WORKERS / script),
        *args,
    ]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"horovodrun failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def results(out: subprocess.CompletedProcess) -> dict[int, dict]:
    """RESULT lines by rank. The output is put back into whole lines per rank first (hvdkit's
    own Demux): MPI tags each piece a rank writes, and cuts a long line into pieces."""
    from hvdkit.launch.console import Demux

    demux = Demux()
    pieces = demux.feed(out.stdout, "stdout") + demux.flush()
    by_rank = {}
    decoder = json.JSONDecoder()
    for piece in pieces:
        # Untagged output (mpirun without --tag-output) can put two ranks' records on one
        # line: print() writes the text and its newline separately, and another rank's text
        # may land in between. Every record on a line is read.
        start = piece.text.find("RESULT ")
        while start != -1:
            value, end = decoder.raw_decode(piece.text, start + len("RESULT "))
            by_rank[value["rank"]] = value
            start = piece.text.find("RESULT ", end)
    return by_rank


def run_example(script: str, *args: str, controller: str = "gloo", env: dict | None = None) -> str:
    """``horovodrun -np 2`` of ``examples/SCRIPT``; its stdout (fails with the output tail)."""
    argv = [
        HOROVODRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        f"--{controller}",
        sys.executable,
        str(ROOT / "examples" / script),
        *args,
    ]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=850,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout
