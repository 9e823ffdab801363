"""The GPU checks (``make gpu-check``), for a machine with an NVIDIA GPU and a CUDA torch.

Builds Horovod with NCCL for the visible GPUs, runs ``hvdkit doctor``, then on the GPU: step 2's
pinning, float32 and AMP (bf16; fp16 with the loss scaler, one rank's gradients overflowing)
through the PyTorch session, Keras 3 on the torch backend under float32 and both mixed
policies and on JAX (with JAX's CUDA wheels) under float32 and mixed_bfloat16, Horovod
allreduce of GPU tensors, ``hvdkit bench``'s ResNet-50 bf16 channels_last
adapter-against-plain ratio, and ``hvdkit run`` refusing two ranks on one GPU under NCCL. Each
training check compares with one process on the global batch. With fewer than two GPUs it
then builds Horovod without NCCL (GPU tensors through Gloo) and runs the checks on 2 ranks
that share GPU 0: ranks must end identical. ``--only memory``: ``torch.cuda.max_memory_allocated``
of plain, ZeRO-1 and ZeRO-2 at np=2 (sharing GPU 0) against the ideal (:func:`memory_checks`).

Writes ``report.md``, ``report.json`` and ``checks.log`` into ``--out``. Exit 1 if a check
fails. Not part of ``make test``: CI has no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import results

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "workers" / "gpu_worker.py")
TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3,
       "mixed_bfloat16": 3e-2, "mixed_float16": 3e-2}  # fmt: skip


class Checks:
    def __init__(self, out: Path, python: str) -> None:
        self.out, self.python = out, python
        self.rows: list[dict] = []
        self.machine: dict = {}
        self.controller = ""  # hvdkit run's choice
        self.log = open(out / "checks.log", "w")

    def sh(self, argv: list[str], timeout: float, env: dict | None = None):
        start = time.monotonic()
        self.log.write(f"\n$ {' '.join(argv)}\n")
        self.log.flush()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})}, cwd=ROOT)  # fmt: skip
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except FileNotFoundError as exc:
            text, rc = str(exc), 127
        except subprocess.TimeoutExpired as exc:
            text = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout} s"
            text, rc = text if isinstance(text, str) else str(text), 124
        self.log.write(text)
        self.log.flush()
        return rc, text, time.monotonic() - start

    def record(self, name: str, ok: bool, detail: str, seconds: float) -> None:
        row = {"check": name, "ok": ok, "detail": detail, "seconds": round(seconds, 1)}
        self.rows.append(row)
        print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.0f} s): {detail}", flush=True)
        self.write()

    def write(self) -> None:
        """The report so far: a run cut short still leaves what it measured."""
        report = {"machine": self.machine, "checks": self.rows}
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        lines = [f"machine: {self.machine}", "",
                 "| check | result | seconds | detail |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['check']} | {'PASS' if r['ok'] else 'FAIL'} | {r['seconds']} | "
                  f"{r['detail'].replace('|', '/')} |" for r in self.rows]  # fmt: skip
        (self.out / "report.md").write_text("\n".join(lines) + "\n")

    def hvdkit(self, *args: str, timeout: float = 900, env: dict | None = None):
        return self.sh([self.python, "-m", "hvdkit", *args], timeout, env)

    def build(self, label: str, flags: list[str]) -> bool:
        rc, text, s = self.hvdkit("build-horovod", "--frameworks", "torch", "--system-deps",
                                  "check", *flags, timeout=1500)  # fmt: skip
        lines = [ln for ln in text.splitlines() if re.search(r"compil|cached|CUDA|NCCL", ln)]
        self.record(label, rc == 0, "; ".join(lines[-4:])[-400:] or text[-400:], s)
        return rc == 0

    def workers(self, np: int, check: list[str], env: dict | None = None) -> dict[int, dict]:
        how = [f"--{self.controller}"] if self.controller else []
        rc, text, s = self.hvdkit("run", "-np", str(np), *how, "--", self.python, WORKER, *check,
                                  timeout=600, env=env)  # fmt: skip
        # The tests' reader: whole lines per rank first (MPI tags and cuts long lines).
        by_rank = results(subprocess.CompletedProcess([], rc, stdout=text))
        if rc != 0 or sorted(by_rank) != list(range(np)):
            raise RuntimeError(f"exit {rc}, results from ranks {sorted(by_rank)}: {text[-600:]}")
        return by_rank | {-1: {"seconds": s}}

    def training(self, np: int, gpus: int, label: str, check: list[str],
                 env: dict | None = None) -> None:  # fmt: skip
        try:
            res = self.workers(np, check, env)
        except RuntimeError as exc:
            self.record(label, False, str(exc)[-500:], 0)
            return
        s = res.pop(-1)["seconds"]
        why = []
        if len({r["digest"] for r in res.values()}) != 1:
            why.append("ranks ended with different weights")
        for rank, r in res.items():
            want = f"cuda:{r.get('local_rank', rank) % gpus}" if gpus else "cpu"
            device = r.get("param_device", r["device"])
            if gpus and device != want and not device.startswith(want):
                why.append(f"rank {rank} computes on {device}, want {want}")
            if not (r["diff"] <= TOL[r.get("dtype", r.get("policy"))] and r["moved"] > 1e-3):
                why.append(f"rank {rank}: diff {r['diff']:.2e} from one process, "
                           f"moved {r['moved']:.2e}")  # fmt: skip
            if gpus and any(not d.startswith("cuda") for d in r.get("step_devices", ())):
                why.append(f"rank {rank}: {r['flag']} step count on {r['step_devices']}")
            if r.get("resume_diff", 0) > TOL["float32"]:
                why.append(f"rank {rank}: the resumed run is {r['resume_diff']:.2e} from the "
                           "uninterrupted one")  # fmt: skip
            if r.get("scales") and r["scales"][0] is not None:
                if r["scales"][-1] != r["ref_scale"] or r["scales"] != res[0]["scales"]:
                    why.append(f"rank {rank}: loss scales {r['scales']}, one process ends at "
                               f"{r['ref_scale']}")  # fmt: skip
        r0 = res[0]
        detail = (
            f"{r0.get('param_device', r0['device'])} {r0.get('gpu') or ''}, max diff "
            f"{max(r['diff'] for r in res.values()):.1e} from one process, ranks "
            f"{'identical' if len({r['digest'] for r in res.values()}) == 1 else 'DIFFER'}"
        )
        if r0.get("scales") and r0["scales"][0] is not None:
            detail += f", loss scale {r0['scales']}"
        if "step_devices" in r0:
            detail += (f", resumed {r0['flag']} step on {r0['step_devices']}, resume diff "
                       f"{r0['resume_diff']:.1e}")  # fmt: skip
        if "optimizer" in r0:
            detail += f", {r0['compute_dtype']} compute, {r0['optimizer']}"
        self.record(label, not why, "; ".join(why) or detail, s)

    def jax_on_gpu(self) -> bool:
        """Whether JAX computes on the GPU here (its CUDA plugin installed): a row either way."""
        rc, text, s = self.sh([self.python, "-c", "import jax; print(jax.__version__, "
                               "jax.default_backend(), jax.devices())"], 120)  # fmt: skip
        ok = rc == 0 and " gpu " in text
        detail = text.strip().splitlines()[-1][:300] if text.strip() else f"exit {rc}"
        if not ok:
            detail += ("; fix: pip install the CUDA wheels of this JAX, e.g. "
                       "'jax[cuda13]==<its version>' (jax-cuda13-plugin, jax-cuda13-pjrt)")  # fmt: skip
        self.record("JAX's CUDA backend (Keras on JAX)", ok, detail, s)
        return ok

    def bandwidth(self, np: int, label: str) -> None:
        try:
            res = self.workers(np, ["allreduce"])
        except RuntimeError as exc:
            self.record(label, False, str(exc)[-500:], 0)
            return
        s = res.pop(-1)["seconds"]
        rows = res[0]["rows"]
        ok = all(row["ok"] for r in res.values() for row in r["rows"])
        detail = ", ".join(
            f"{row['MiB']} MiB {row['allreduce_ms']:.2f} ms ({row['algbw_GBps']:.0f} GB/s alg"
            + (f", {row['busbw_GBps']:.0f} bus" if row["busbw_GBps"] else "")
            + f"; copy {row['copy_GBps']:.0f})"
            for row in rows
        )
        self.record(label, ok, ("" if ok else "WRONG SUMS; ") + detail, s)


def resume_checks(c: Checks, np: int, gpus: int, how: str) -> None:
    """Issue 49 item 7: a resumed AdamW(capturable/fused), plain, ZeRO-1 and ZeRO-2."""
    for flag in ("capturable", "fused"):
        for shard in ((), ("--shard",), ("--shard", "gradients")):
            kind = {0: "plain", 1: "ZeRO-1", 2: "ZeRO-2"}[len(shard)]
            c.training(np, gpus, f"resume AdamW({flag}=True) {kind} np={np} {how}",
                       ["resume", "--flag", flag, *shard])  # fmt: skip


MEMORY_VARIANTS = {"plain": "plain", "sharded": "ZeRO-1", "gradients": "ZeRO-2"}


def _memory_job(c: Checks, np: int, variant: str) -> dict:
    """``hvdkit bench``'s memory job (an MLP of 16.8 M parameters, Adam) for one variant."""
    from hvdkit.bench.worker import parse_results

    how = [f"--{c.controller}"] if c.controller else []
    rc, text, s = c.hvdkit("run", "-np", str(np), *how, "--", c.python, "-m",
                           "hvdkit.bench.memory", "--variant", variant, "--steps", "3",
                           "--rounds", "1", timeout=600)  # fmt: skip
    found = parse_results(text)
    if rc != 0 or not found or found[-1].get("cuda_peak_bytes") is None:
        raise RuntimeError(f"exit {rc}, {len(found)} result(s), no CUDA peak: {text[-500:]}")
    return found[-1] | {"seconds": s}


def memory_checks(c: Checks, how: str) -> None:
    """Issue 51 item 5: ``torch.cuda.max_memory_allocated`` of plain, ZeRO-1 and ZeRO-2 at
    np=2 against the ideal: the weights, gradients and Adam state each layout keeps (the
    plain run's bytes, divided as the stage promises) plus what the same variant holds
    beyond them at one rank (activations, the optimizer step's temporaries). A stage passes
    when its peak is below plain's by at least 0.8 of what it promises to take off."""
    runs: dict[tuple[int, str], dict] = {}
    try:
        for np, variant in ((1, "plain"), (1, "sharded"), (2, "plain"), (2, "sharded"),
                            (2, "gradients")):  # fmt: skip
            runs[np, variant] = _memory_job(c, np, variant)
    except RuntimeError as exc:
        c.record(f"CUDA peak, bench memory job, {how}", False, str(exc)[-500:], 0)
        return
    plain = runs[2, "plain"]
    w, g, st = plain["weights_bytes"], plain["grads_bytes"], plain["state_bytes"]
    ideal_counted = {"plain": w + g + st, "sharded": w + g + st / 2, "gradients": w + (g + st) / 2}
    promised = {"plain": 0.0, "sharded": st / 2, "gradients": (g + st) / 2}
    for variant, name in MEMORY_VARIANTS.items():
        one = runs[1, "plain" if variant == "plain" else "sharded"]
        fixed = one["cuda_peak_bytes"] - (one["weights_bytes"] + one["grads_bytes"]
                                          + one["state_bytes"])  # fmt: skip
        this = runs[2, variant]
        peak, ideal = this["cuda_peak_bytes"], ideal_counted[variant] + fixed
        detail = (f"peak {peak / 1e6:.1f} MB, ideal {ideal / 1e6:.1f} MB (counted "
                  f"{ideal_counted[variant] / 1e6:.1f} + {fixed / 1e6:.1f} beyond them at one "
                  f"rank), peak / ideal {peak / ideal:.2f}; held: weights "
                  f"{this['weights_bytes'] / 1e6:.1f}, grads {this['grads_bytes'] / 1e6:.1f}, "
                  f"state {this['state_bytes'] / 1e6:.1f}")  # fmt: skip
        ok = True
        if promised[variant]:
            saving = (plain["cuda_peak_bytes"] - peak) / promised[variant]
            detail += f"; saving / promised {saving:.2f}"
            ok = saving >= 0.8
        c.record(f"CUDA peak np=2 {name} ({how})", ok, detail, this["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-report")
    parser.add_argument("--sdist", help="a local horovod-0.28.1.tar.gz (no download)")
    parser.add_argument("--skip", default="", help="comma list: build,nccl,bench,shared")
    parser.add_argument("--only", default="",
                        help="comma list of check groups: training,resume,memory "
                        "(default: all)")  # fmt: skip
    parser.add_argument("--shared-controllers", default="gloo",
                        help="for the 2 ranks sharing a GPU: gloo, mpi or gloo,mpi")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(","))) or {"training", "resume", "memory"}
    if "training" not in only:
        skip |= {"doctor", "bench"}
    c = Checks(args.out, sys.executable)
    sdist = ["--sdist", args.sdist] if args.sdist else []

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rc, smi, _ = c.sh(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                       "--format=csv,noheader"], 30)  # fmt: skip
    machine = {"gpus": gpus, "nvidia_smi": smi.strip() if rc == 0 else None,
               "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "python": sys.version.split()[0]}  # fmt: skip
    print(f"machine: {machine}", flush=True)
    c.machine = machine

    if "build" not in skip and "nccl" not in skip:
        c.build(
            "build Horovod with NCCL (arch of the visible GPUs)",
            ["--controllers", "gloo", "--gpu-operations", "NCCL", *sdist],
        )
    if "nccl" not in skip and "doctor" not in skip:
        rc, text, s = c.hvdkit("doctor", timeout=300)
        counts = {k: len(re.findall(rf"^{k}\b", text, re.M)) for k in ("PASS", "FAIL", "SKIP")}
        gpu_lines = [ln for ln in text.splitlines() if re.search(r"GPU|NCCL|CUDA|JAX", ln)]
        c.record("hvdkit doctor", rc == 0 and counts["FAIL"] == 0,
                 f"{counts}; " + " | ".join(gpu_lines)[:900], s)  # fmt: skip

    if "nccl" not in skip:
        one = [1] if gpus <= 1 else [1, gpus]
        for np in one if "resume" in only else ():
            resume_checks(c, np, gpus, "NCCL")
        jax_gpu = c.jax_on_gpu() if "training" in only else False
        for np in one if "training" in only else ():
            for dtype in ("float32", "bfloat16", "float16"):
                extra = ["--overflow-at", "2"] if dtype == "float16" else []
                c.training(np, gpus, f"torch session np={np} {dtype}", ["torch", "--dtype", dtype,
                           *extra])  # fmt: skip
            for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
                c.training(
                    np,
                    gpus,
                    f"keras (torch backend) fit np={np} {policy}",
                    ["keras", "--policy", policy],
                    {"KERAS_BACKEND": "torch"},
                )
            for policy in ("float32", "mixed_bfloat16") if jax_gpu else ():
                c.training(np, gpus, f"keras (jax backend) fit np={np} {policy}",
                           ["keras", "--policy", policy], {"KERAS_BACKEND": "jax"})  # fmt: skip
            c.bandwidth(np, f"allreduce GPU tensors np={np}")
        if gpus == 1 and "training" in only:
            rc, text, s = c.hvdkit("run", "-np", "2", "--", c.python, WORKER, "allreduce",
                                   timeout=300)  # fmt: skip
            said = [ln for ln in text.splitlines() if "NCCL" in ln][:2]
            c.record("hvdkit run -np 2 on one GPU under NCCL is refused before launch",
                     rc != 0 and bool(said) and "RESULT" not in text, " | ".join(said)[:500] or
                     text[-300:], s)  # fmt: skip
    if "bench" not in skip:
        bench_json = args.out / "bench.json"
        rc, text, s = c.hvdkit(
            "bench",
            "--np",
            "1",
            "--only",
            "training",
            "--models",
            "mlp",
            "--json",
            str(bench_json),
            "--no-progress",
            timeout=900,
        )
        found = [ln for ln in text.splitlines() if "resnet50" in ln.lower()]
        c.record("hvdkit bench: ResNet-50 bf16 channels_last, hvdkit vs plain", rc == 0,
                 " | ".join(found)[:600] or text[-400:], s)  # fmt: skip
    if gpus and "shared" not in skip:
        controllers = args.shared_controllers.split(",")
        if "build" not in skip:
            c.build(f"build Horovod without NCCL (GPU tensors through {args.shared_controllers})",
                    ["--controllers", args.shared_controllers, *sdist])  # fmt: skip
        for c.controller in controllers:
            how = f"sharing GPU 0, {c.controller}"
            if "memory" in only:
                memory_checks(c, how)
            if "resume" in only:
                resume_checks(c, 2, gpus, how)
            if "training" not in only:
                continue
            for dtype in ("float32", "bfloat16", "float16"):
                extra = ["--overflow-at", "2"] if dtype == "float16" else []
                c.training(2, gpus, f"torch session np=2 {how}, {dtype}",
                           ["torch", "--dtype", dtype, *extra])  # fmt: skip
            c.training(2, gpus, f"keras (torch backend) fit np=2 {how}, mixed_bfloat16",
                       ["keras", "--policy", "mixed_bfloat16"], {"KERAS_BACKEND": "torch"})  # fmt: skip
            c.bandwidth(2, f"allreduce GPU tensors np=2 {how}")

    failed = [r["check"] for r in c.rows if not r["ok"]]
    print(f"{len(c.rows) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
