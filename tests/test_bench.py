"""``hvdkit bench --quick`` for real: every section runs (real ranks under horovodrun with Gloo
and MPI), the JSON validates and the plots are written. No timing is asserted. The memory
section's jobs run in tests/test_zero_memory.py, which checks their figures against ZeRO's
promise through the same summary (its plan and table: tests/test_bench_units.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from hvdkit.bench import report
from hvdkit.bench.plan import STEADY_HEAP
from hvdkit.bench.worker import parse_results

HVDKIT = str(Path(sys.executable).parent / "hvdkit")


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [HVDKIT, "bench", "--no-progress", *args], capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def quick_run(tmp_path: Path, sections: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``hvdkit bench --quick --only SECTIONS`` with its JSON and plots; the run and the JSON
    (validated, complete, every job on the steady heap)."""
    out = bench("--quick", "--only", sections, "--json", str(tmp_path / "bench.json"),
                "--plots", str(tmp_path / "plots"), timeout=840)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    report.validate(doc)
    assert doc["complete"] is True
    # Every job, on every rank that reported, ran on the steady heap.
    assert doc["config"]["steady_heap"] is True
    for r in doc["records"]:
        assert r["result"]["malloc"] == STEADY_HEAP, r["label"]
    return out, doc


# The quick run in two tests (the Keras section, and the rest but memory), so that CI's time
# budget can fit each into a gap that the whole run (~205 s in a cold CI) would not.
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_quick_run_reports_every_section_but_keras_and_memory(tmp_path, capsys):
    out, doc = quick_run(tmp_path, "pipeline,profile,allreduce,training")
    summary = doc["summary"]
    names = {s["name"] for s in summary["allreduce"]["series"]}
    assert names == {"horovod gloo np=2", "horovod mpi np=2", "torch.distributed gloo np=2",
                     "mpi4py Allreduce np=2"}  # fmt: skip
    assert summary["allreduce"]["large_message"]["loopback_tcp_gbps"] > 0
    for model in ("cnn", "resnet18"):
        m = summary["training"][model]
        assert set(m["samples_per_s"]) == {"1", "2"}
        assert set(m["efficiency"]["2"]) == {"plain", "hvdkit", "horovod", "ddp"}
        assert 0 < m["bound"]["2"] < 1 and 0 < m["bound_same_run"]["2"] < 1
    assert summary["training"]["cnn"]["threads_effect"]["2"] > 0  # measured on the first model
    assert summary["pipeline"]["samples_per_s"]["workers"] > 0
    assert 0.5 < summary["profile"]["on_vs_off"] < 2  # a ratio of two real rates
    assert 0.5 < summary["hang"]["on_vs_off"] < 2  # the hang doctor's, the same way
    # 2 models x (hvdkit/horovod at np=1 and 2, DDP, bound), 1 bandwidth, --profile's and the
    # hang doctor's costs; and the adapter against the plain loop on a GPU
    assert len(summary["targets"]) == 11 + doc["config"]["gpu"]
    for heading in ("Allreduce bus bandwidth", "Training resnet18", "Input pipeline",
                    "hvdkit run --profile: throughput", "the hang doctor: throughput",
                    "Targets"):  # fmt: skip
        assert heading in out.stdout
    for png in ("allreduce_busbw.png", "throughput_vs_ranks.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 10_000
    with capsys.disabled():  # the numbers go into the CI log
        print("\n[hvdkit bench --quick]\n" + out.stdout)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_quick_run_reports_keras_on_every_backend(tmp_path, capsys):
    out, doc = quick_run(tmp_path, "keras")
    summary = doc["summary"]
    for backend in ("tensorflow", "torch", "jax", "tensorflow custom loop"):
        assert set(summary["keras"][backend]["samples_per_s"]) == {"1", "2"}
    assert len(summary["targets"]) == 8  # 3 Keras backends and the TF custom loop at np=1, 2
    for heading in ("Keras fit(), backend torch", "Keras fit(), backend jax",
                    "Keras custom loop, DistributedGradientTape, backend tensorflow",
                    "Targets"):  # fmt: skip
        assert heading in out.stdout
    assert (tmp_path / "plots" / "throughput_vs_ranks.png").stat().st_size > 10_000
    with capsys.disabled():
        print("\n[hvdkit bench --quick --only keras]\n" + out.stdout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--np", "0,2"), "hvdkit bench: --np 0,2: give positive rank counts"),
        (("--only", "disk"), "hvdkit bench: --only disk: unknown"),
        (("--controllers", "nccl"), "hvdkit bench: --controllers nccl: this Horovod cannot use"),
        (("--hostfile", "missing.txt"), "hvdkit bench: missing.txt"),
        (
            ("--env", "HOROVOD_CYCLE_TIME"),
            "hvdkit bench: --env 'HOROVOD_CYCLE_TIME': give NAME=VALUE",
        ),
    ],
)
def test_bad_options_stop_before_anything_runs(args, message):
    out = bench(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_gpu_checks_bf16_channels_last_path_runs_here():
    """What the bench runs on a GPU (bf16 autocast, channels_last, hvdkit against the plain
    loop, one rank), run on this CPU so the path is exercised without one."""
    argv = [sys.executable, "-m", "hvdkit.bench.training", "--spec", "cnn:8:2:2", "--amp",
            "--channels-last", "--variants", "plain,hvdkit"]  # fmt: skip

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, capture_output=True, text=True, timeout=240, cwd=ROOT,
            env={**os.environ, "HVDKIT_BENCH_THREADS": "1"}, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    out = run(argv)
    assert out.returncode == 0, out.stderr[-3000:]
    [result] = parse_results(out.stdout)
    assert result["amp"] is True and result["channels_last"] is True
    assert set(result["samples_per_s"]) == {"plain", "hvdkit"}
    assert all(r > 0 for rates in result["samples_per_s"].values() for r in rates)
    refused = run([*argv[:-1], "plain,hvdkit,horovod"])
    assert refused.returncode == 2
    assert "--channels-last: Horovod by hand refuses channels_last" in refused.stderr
