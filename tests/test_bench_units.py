"""hvdkit bench's pure parts: bandwidth arithmetic, the job plan, the summary, targets, the
JSON document and the plots, on made-up results (the real run is tests/test_bench.py)."""

from __future__ import annotations

import json

import pytest

from hvdkit.bench import metrics, report
from hvdkit.bench.plan import STEADY_HEAP, BenchConfig, Job, plan_jobs
from hvdkit.bench.plots import write_plots
from hvdkit.bench.worker import EXACT_HEAP, MARKER, parse_results, round_rate, timed_rounds

MIB = metrics.MIB


def test_busbw_follows_the_nccl_tests_definition():
    alg = metrics.algbw(256 * MIB, 0.5)
    assert alg == 512 * MIB
    assert metrics.busbw(alg, 2) == alg  # 2(n-1)/n = 1 at two ranks
    assert metrics.busbw(alg, 8) == pytest.approx(alg * 1.75)
    assert metrics.busbw(alg, 1) == 0.0  # one rank moves nothing
    with pytest.raises(ValueError):
        metrics.algbw(1, 0.0)


def test_sizes_efficiency_bound_and_ratios():
    sizes = metrics.message_sizes(4 * 1024, 256 * MIB)
    assert sizes[0] == 4096 and sizes[-1] == 256 * MIB and len(sizes) == 9
    assert metrics.weak_scaling_efficiency(100.0, 90.0) == 0.9
    assert metrics.no_overlap_bound(0.9, 0.1) == pytest.approx(0.9)
    # Per-round ratios: a slow phase in round 2 hits both variants and cancels out.
    assert metrics.median_ratio([100, 50, 100], [100, 50, 100]) == 1.0
    assert metrics.human_bytes(4096) == "4 KiB" and metrics.human_bytes(256 * MIB) == "256 MiB"


def test_timed_rounds_alternate_the_order():
    calls: list[str] = []
    out = timed_rounds({"a": lambda: calls.append("a") or 1.0,
                        "b": lambda: calls.append("b") or 2.0}, 3)  # fmt: skip
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert out == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_a_round_is_rated_at_its_median_step():
    # One stalled step (the VM's) does not move the round; a cost on every step does.
    assert round_rate(64, [0.05, 0.05, 0.5, 0.05, 0.05]) == pytest.approx(64 / 0.05)
    assert round_rate(64, [0.06] * 5) == pytest.approx(64 / 0.06)
    with pytest.raises(ValueError, match="at least one timed step"):
        round_rate(64, [])


def _peaks(jobs):
    """The memory section's peak jobs (not its speed rounds)."""
    return [j for j in jobs if j.section == "memory" and j.key["variant"] != "speed"]


def test_every_job_runs_on_the_steady_heap_unless_asked_not_to():
    jobs = plan_jobs(BenchConfig(nps=(1, 2), quick=True), available=("mpi",))
    timed = [job for job in jobs if job not in _peaks(jobs)]
    assert timed and all(STEADY_HEAP.items() <= job.env.items() for job in timed)
    # Peaks are measured on the exact heap: the bytes live at once, at 1, 2 and 4 ranks.
    assert all(EXACT_HEAP.items() <= job.env.items() for job in _peaks(jobs))
    assert sorted({job.np for job in _peaks(jobs)}) == [1, 2, 4]
    # A job's own settings go over it (and --env over both, in the command).
    assert all(job.env.get("HVDKIT_BENCH_THREADS") == "1" for job in jobs
               if job.section in ("training", "keras"))  # fmt: skip
    plain = plan_jobs(BenchConfig(nps=(1, 2), quick=True, steady_heap=False), ("mpi",))
    assert not any(set(STEADY_HEAP) & set(job.env) for job in plain if job not in _peaks(plain))
    assert int(STEADY_HEAP["MALLOC_MMAP_THRESHOLD_"]) == 32 * MIB  # glibc's largest on 64 bits


def test_result_lines_survive_a_tag_glued_on_by_mpirun():
    text = f'[1,0]<stdout>:{MARKER}{{"x":1}}[1,0]<stdout>:\nnoise\n[0]<stdout>:{MARKER}{{"y":2}}\n'
    assert parse_results(text) == [{"x": 1}, {"y": 2}]


def test_plan_covers_every_section_and_world_size():
    jobs = plan_jobs(BenchConfig(nps=(1, 2), quick=True), available=("gloo", "mpi"))
    labels = [j.label for j in jobs]
    assert labels[0] == "input pipeline"
    memory = [(j.args[1], j.np) for j in jobs if j.section == "memory"]
    assert memory == [("plain", 1), ("sharded", 1)] + [
        (v, n) for n in (2, 4) for v in ("plain", "sharded", "gradients")] + [
        ("speed", 1), ("speed", 2)]  # fmt: skip
    assert "allreduce np=2 gloo" in labels and "allreduce np=2 mpi" in labels
    assert "allreduce np=1 gloo" not in labels  # busbw is zero at one rank
    cost = next(j for j in jobs if j.section == "profile")  # at the largest world size
    assert cost.np == 2 and cost.module == "hvdkit.bench.profile_cost" and cost.controller
    assert {"cnn,resnet18 np=1", "cnn,resnet18 np=2"} <= set(labels)  # one launch, both models
    training = next(j for j in jobs if j.label == "cnn,resnet18 np=2")
    assert training.args == ("--spec", "cnn:32:4:3", "--spec", "resnet18:8:1:3",
                             "--threads-variant-for", "cnn")  # fmt: skip
    for backend in ("tensorflow", "torch", "jax"):
        job = next(j for j in jobs if j.label == f"keras {backend} np=2")
        assert job.env["KERAS_BACKEND"] == backend and job.env["HVDKIT_BENCH_THREADS"] == "1"
    torch_dist = [j.controller for j in jobs if "--torch-dist" in j.args]
    assert torch_dist == ["gloo"]  # torch.distributed once per world size
    assert [j.controller for j in jobs if "--mpi4py" in j.args] == ["mpi"]
    # Training and Keras run where `hvdkit run` would run them, or on the first one asked for.
    assert {j.controller for j in jobs if j.section in ("training", "keras")} == {"mpi"}
    gloo = plan_jobs(BenchConfig(controllers=("gloo", "mpi")), available=("gloo", "mpi"))
    assert {j.controller for j in gloo if j.section in ("training", "keras")} == {"gloo"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BenchConfig(nps=(0, 2)), "--np 0,2"),
        (BenchConfig(sections=("allreduce", "disk")), "--only disk"),
        (BenchConfig(controllers=("mpi",)), "--controllers mpi: this Horovod cannot use MPI"),
        (BenchConfig(models=("vgg",)), "--models vgg"),
        (BenchConfig(keras_backends=("mxnet",)), "--keras-backends mxnet"),
    ],
)
def test_bad_options_are_named(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan_jobs(config, available=("gloo",))


def _records() -> list[dict]:
    def rec(section, label, np, result, **key):
        job = Job(section, label, "m", (), np, None if np == 1 else "gloo", key=key)
        return report.record(job, result)

    sizes = [4096, 64 * MIB]
    return [
        rec("allreduce", "loopback TCP and memcpy", 1,
            {"sizes": sizes, "seconds": {"loopback TCP": [1e-4, 0.032], "memcpy": [1e-6, 0.01]}}),
        rec("allreduce", "allreduce np=2 gloo", 2,
            {"ranks": 2, "sizes": sizes,
             "seconds": {"horovod": [1e-3, 0.1], "torch.distributed": [5e-4, 0.05]}},
            controller="gloo"),
        rec("training", "cnn np=1", 1,
            {"model": "cnn", "ranks": 1, "batch_size": 32, "params": 1000, "threads": 1,
             "default_threads": 2, "grad_allreduce_s": 0.0,
             "samples_per_s": {"plain": [320.0, 320.0], "hvdkit": [310.0, 310.0],
                               "horovod": [310.0, 310.0], "ddp": [300.0, 300.0]}}, model="cnn"),
        rec("training", "cnn np=2", 2,
            {"model": "cnn", "ranks": 2, "batch_size": 32, "params": 1000, "threads": 1,
             "default_threads": 2, "grad_allreduce_s": 0.01,
             "samples_per_s": {"plain": [300.0, 300.0], "hvdkit": [288.0, 144.0],
                               "horovod": [240.0, 150.0], "ddp": [256.0, 256.0]},
             "threads_pair": {"hvdkit": [200.0, 100.0],
                              "hvdkit-default-threads": [100.0, 60.0]}}, model="cnn"),
        rec("keras", "keras torch np=2", 2,
            {"backend": "torch", "ranks": 2, "batch_size": 64, "threads": 1,
             "samples_per_s": {"hvdkit": [100.0, 90.0], "by hand": [100.0, 100.0]}},
            backend="torch"),
        rec("keras", "keras torch np=1", 1,
            {"backend": "torch", "ranks": 1, "batch_size": 64, "threads": 1,
             "samples_per_s": {"hvdkit": [99.0, 99.5], "by hand": [100.0, 100.0]}},
            backend="torch"),
        rec("pipeline", "input pipeline", 1,
            {"workers": 2, "batch_size": 64,
             "samples_per_s": {"main process": 500.0, "workers": 900.0,
                               "workers + pin_memory": None}}),
    ]  # fmt: skip


def test_summary_derives_bandwidths_efficiencies_and_targets():
    s = report.summarize(_records())
    a = s["allreduce"]
    gloo = next(x for x in a["series"] if x["name"] == "horovod gloo np=2")
    assert gloo["busbw_gbps"][1] == pytest.approx(64 * MIB / 0.1 / 1e9)
    large = a["large_message"]
    assert large["best"] == "horovod gloo np=2"  # the target is about Horovod's controllers
    assert large["ratio"] == pytest.approx(0.32)  # 0.1 s against loopback's 0.032 s
    cnn = s["training"]["cnn"]
    assert cnn["efficiency"]["2"]["ddp"] == pytest.approx(0.8)  # 256 / 320 plain at np=1
    assert cnn["efficiency"]["2"]["hvdkit"] == pytest.approx(216 / 320)  # median of rounds
    assert cnn["hvdkit_vs_horovod"]["2"] == pytest.approx((1.2 + 0.96) / 2)  # per-round
    assert cnn["hvdkit_vs_ddp"]["2"] == pytest.approx((288 / 256 + 144 / 256) / 2)
    t_compute = 32 / 320
    assert cnn["bound"]["2"] == pytest.approx(t_compute / (t_compute + 0.01))
    t_same = 32 / 300  # plain at 2 ranks, in the same rounds as the others
    assert cnn["bound_same_run"]["2"] == pytest.approx(t_same / (t_same + 0.01))
    assert cnn["vs_plain"]["2"]["hvdkit"] == pytest.approx((0.96 + 0.48) / 2)
    assert cnn["threads_effect"]["2"] == pytest.approx(0.55)  # paired rounds: 0.5 and 0.6
    assert s["keras"]["torch"]["hvdkit_vs_by_hand"]["2"] == pytest.approx(0.95)
    assert s["pipeline"]["speedup"] == {"main process": 1.0, "workers": 1.8,
                                        "workers + pin_memory": None}  # fmt: skip
    met = {t["name"]: t["met"] for t in s["targets"]}
    # hvdkit / by hand is judged at one rank too (no communication there: hvdkit's own cost)
    assert met["hvdkit.torch / hand-written Horovod, cnn np=1"] is True  # 310 / 310
    assert met["hvdkit.torch / hand-written Horovod, cnn np=2"] is True
    assert "hvdkit.torch efficiency / DDP's, cnn np=1" not in met  # efficiency: np > 1 only
    assert met["hvdkit.keras / by hand, torch np=1"] is True  # 0.9925 >= 0.99
    assert met["hvdkit.torch efficiency / DDP's, cnn np=2"] is False
    assert met["hvdkit.keras / by hand, torch np=2"] is False
    assert met["peak busbw / peak loopback TCP, messages >= 16 MiB (horovod gloo np=2)"] is False


def test_document_round_trips_through_json_and_validates(tmp_path):
    doc = report.document(BenchConfig(), {"cpus": 2}, _records(), complete=True)
    again = json.loads(json.dumps(doc))
    report.validate(again)
    again["records"][0].pop("result")
    with pytest.raises(ValueError, match="record 0 lacks result"):
        report.validate(again)
    with pytest.raises(ValueError, match="not an hvdkit bench document"):
        report.validate({"schema": "other"})


def test_table_and_plots(tmp_path):
    s = report.summarize(_records())
    text = report.table(s)
    for needle in ("Allreduce bus bandwidth", "64 MiB", "Training cnn", "256.0 (0.80)",
                   "np=2: hvdkit/horovod 1.080, hvdkit/ddp 0.844",
                   "Keras fit(), backend torch", "workers + pin_memory    n/a (no GPU)",
                   "MISS hvdkit.keras / by hand, torch np=2: 0.950"):  # fmt: skip
        assert needle in text, needle
    written = write_plots(s, tmp_path / "plots")
    assert [p.name for p in written] == ["allreduce_busbw.png", "throughput_vs_ranks.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def _memory_records() -> list[dict]:
    def rec(variant, np, **result):
        return {"section": "memory", "label": f"memory {variant} np={np}", "np": np,
                "controller": "gloo", "variant": variant,
                "result": {"ranks": np, "variant": variant, "params": 1000, **result}}  # fmt: skip

    def sizes(state, peak, steady=0):
        return {"weights_bytes": 4000, "grads_bytes": 4000, "state_bytes": state,
                "rss_growth_bytes": 1, "peak_rss_bytes": 3e8, "peak_growth_bytes": peak,
                "steady_growth_bytes": steady,
                "cuda_peak_bytes": None, "step_s": 0.01, "element_bytes": 4,
                "zero_buffers_bytes": 1000, "fusion_threshold_bytes": 2**27}  # fmt: skip

    return [
        rec("plain", 1, **sizes(8000, 20_000, 17_000)),  # 1000 kept, 3000 passing
        rec("sharded", 1, **sizes(8000, 17_000, 16_500)),  # 500 kept, 500 passing
        rec("plain", 2, **sizes(8000, 24_000)),  # the model: 16000 + 4000 fusion + 4000
        # 8000 + 4000 + 500 kept + max(1000 in flight, 500 passing)
        rec("sharded", 2, **sizes(4000, 14_850)),
        # stage 2: 4000 + 2000 grads + 4000 + 500 + max(1000 x 1.5 + 400 largest, 500)
        rec("gradients", 2, **{**sizes(4000, 12_000), "grads_bytes": 2000,
                               "largest_param_bytes": 400}),
        rec("speed", 2, step_s={"plain": 0.01, "sharded": 0.0125}, ratio=0.8, rounds=3,
            link={"alpha": 1e-4, "beta": 1e-9}),
    ]  # fmt: skip


def test_the_memory_section_judges_zero_1_and_predicts_it(tmp_path):
    """Sharded state x N / plain and the speed ratio are targets; the predictions come from
    the fitted link (ZeRO-1 equals the ring allreduce), the largest models from the bytes per
    parameter; the table and the plot show them."""
    s = report.summarize(_memory_records())
    m = s["memory"]
    assert m["by_np"]["2"]["state_vs_plain"] == pytest.approx(1.0)  # 8000 / (2 x 4000)
    met = {t["name"]: (t["value"], t["met"]) for t in s["targets"]}
    assert met["ZeRO-1 optimizer state x N / plain, np=2"] == (pytest.approx(1.0), True)
    assert met["ZeRO-1 step throughput / plain, np=2"] == (pytest.approx(0.8), False)
    row = m["predicted_ms"]["8"]
    assert row["zero-1 fp32"] == pytest.approx(row["allreduce fp32"])
    assert row["zero-1 bf16 grads"] < row["zero-1 fp32"]
    assert row["allreduce fp32"] == pytest.approx(1e3 * (14 * 1e-4 + 2 * 7 / 8 * 4000 * 1e-9))
    assert m["largest_model_b"]["80 GiB"]["fp32 plain N=8"] == pytest.approx(
        round((80 * 2**30 - 2**27) / 16 / 1e9, 2)  # Horovod's fusion buffer set aside
    )
    assert m["largest_model_b"]["80 GiB"]["fp32 zero-1 N=8"] == pytest.approx(
        round((80 * 2**30 - 1000) / 9 / 1e9, 2)
    )
    plain, sharded = m["by_np"]["2"]["plain"]["model"], m["by_np"]["2"]["sharded"]["model"]
    assert (plain["buffers"], plain["resident"], plain["transient"]) == (4000, 1000, 3000)
    assert plain["total"] == 24_000
    assert (sharded["state"], sharded["buffers"], sharded["total"]) == (4000, 1000, 13_500)
    assert m["by_np"]["2"]["peak_saving"] == pytest.approx(9150 / 4000)
    stage2 = m["by_np"]["2"]["gradients"]["model"]
    assert (stage2["grads"], stage2["buffers"], stage2["total"]) == (2000, 1900, 12_400)
    assert m["by_np"]["2"]["stage2_peak_saving"] == pytest.approx(12_000 / 6000)
    assert met["ZeRO-2 peak saving / (N-1)/N of the state and gradients, np=2"][1] is True
    assert met["ZeRO-1 peak saving / (N-1)/N of the state, np=2"] == (pytest.approx(2.2875), True)
    text = report.table(s)
    for needle in (
        "Memory, Adam on an MLP of 0.0 M params",
        "np=2 sharded",
        "optimizer     0.0",
        "throughput sharded / plain, alternating rounds: 0.800",
        "largest model with Adam",
        "MISS ZeRO-1 step throughput / plain, np=2",
        "model     0.0 (weights 0.0",
        "measured / model 1.00",
        "measured / model 1.10",
        "np=2 peak saving / (N-1)/N of plain's state: 2.29",
                   "np=2 gradients weights", "np=2 stage 2's peak saving",
    ):
        assert needle in text, needle
    written = write_plots(s, tmp_path)
    assert [p.name for p in written] == ["memory.png"] and written[0].stat().st_size > 10_000


def test_gpu_check_is_planned_and_judged_against_the_plain_loop(tmp_path):
    jobs = plan_jobs(BenchConfig(gpu=True, quick=True), available=("gloo", "mpi"))
    gpu = next(j for j in jobs if j.label == "resnet50 bf16 channels_last np=1")
    assert gpu.np == 1 and {"--amp", "--channels-last"} <= set(gpu.args)
    assert gpu.args[gpu.args.index("--variants") + 1] == "plain,hvdkit"  # Horovod by hand
    assert not any("resnet50" in j.label for j in plan_jobs(BenchConfig(), ("gloo",)))  # CPU

    result = {"model": "resnet50", "ranks": 1, "batch_size": 256, "params": 25_557_032,
              "threads": 1, "default_threads": 16, "grad_allreduce_s": 0.0, "device": "cuda",
              "amp": True, "channels_last": True,
              "samples_per_s": {"plain": [3980.0, 4000.0], "hvdkit": [3960.0, 3900.0]}}  # fmt: skip
    s = report.summarize([*_records(), report.record(gpu, result)])
    assert "resnet50 bf16 channels_last" in s["training"] and "cnn" in s["training"]
    target = next(t for t in s["targets"] if "GPU" in t["name"])
    assert (
        target["name"] == "hvdkit.torch / plain loop on the GPU, resnet50 bf16 channels_last np=1"
    )
    assert target["value"] == pytest.approx((3960 / 3980 + 3900 / 4000) / 2)
    assert target["met"] is False  # 0.985 < 0.99
    text = report.table(s)
    assert "Training resnet50 bf16 channels_last (25.56 M params, batch 256/rank, GPU)" in text
    assert "np=1: hvdkit/plain in the same rounds 0.985" in text
    assert len(write_plots(s, tmp_path)) == 2


def test_a_long_result_comes_back_whole_through_interleaved_tagged_lines(capsys):
    from hvdkit.bench.worker import PIECE, emit

    result = {"samples_per_s": {"plain": [700.123456789 + i for i in range(400)]}, "s": '"\\'}
    emit(result)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 2 and all(len(line) < PIECE + 100 for line in lines)
    # As mpirun hands them back under load: tagged, other ranks' output between and glued on.
    text = "\n".join(f"[1,0]<stdout>:{line}[1,1]<stderr>:\n[1,1]<stderr>:noise" for line in lines)
    got = parse_results(text + "\n" + f'{MARKER}{{"y":2}}')
    assert got == [{**result, "malloc": got[0]["malloc"]}, {"y": 2}]
    assert set(got[0]["malloc"]) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}


def test_a_result_split_mid_line_by_the_launcher_comes_back_whole(capsys):
    """mpirun tags each chunk it reads, and a chunk may end inside a line: a full run lost
    two results to ``[1,0]<stdout>:HVDKIT_BENCH_RESU[1,0]<stdout>:LT {...``."""
    from hvdkit.bench.worker import emit

    first = {"samples_per_s": {"hvdkit": [750.5 + i for i in range(300)]}, "model": "cnn"}
    second = {"samples_per_s": {"hvdkit": [26.5]}, "model": "resnet18"}
    emit(first)
    emit(second)
    out = capsys.readouterr().out
    for size in (17, 997, 4096):  # chunk ends anywhere: in a tag, a marker, a number
        chunks = [out[i : i + size] for i in range(0, len(out), size)]
        tagged = []
        for chunk in chunks:
            # mpirun's tag at the chunk's start and after each newline in it, then another
            # rank's line between two chunks.
            body = chunk.replace("\n", "\n[1,0]<stdout>:")
            body = body.removesuffix("[1,0]<stdout>:")
            tagged.append(f"[1,0]<stdout>:{body}[1,1]<stderr>:warning\n")
        got = parse_results("".join(tagged))
        assert [{k: v for k, v in r.items() if k != "malloc"} for r in got] == [first, second]
