"""GPU checks, run under ``hvdkit run`` by tests/gpu_checks.py on a machine with a GPU (on CPU
when there is none, so the checks themselves can be tried anywhere). One RESULT json line per
rank. Each check compares the distributed run with one process on the global batch."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np


def emit(rank: int, **values) -> None:
    print("RESULT " + json.dumps({"rank": rank, **values}), flush=True)


def torch_checks(args) -> None:
    """Step 2's pinning, then AMP training through the session, against one process."""
    import torch
    import torch.nn.functional as F

    import hvdkit.torch as hvd

    # fp32 compares exactly: no TF32 in cuDNN's convolutions (torch's default allows it).
    torch.backends.cudnn.allow_tf32 = False
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None}[args.dtype]

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10),
        )  # fmt: skip

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])

    lr, b, steps = 0.05, 16, 6
    model = make_model()
    session = hvd.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    device = session.device
    size, rank = hvd.size(), hvd.rank()
    kind = device.type
    pinned = {
        "device": str(device),
        "param_device": str(next(session.model.parameters()).device),
        "current_device": torch.cuda.current_device() if kind == "cuda" else None,
        "local_rank": hvd.local_rank(),
        "gpu": torch.cuda.get_device_name(device) if kind == "cuda" else None,
    }
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(steps, b * size, 3, 16, 16, generator=g)
    ys = torch.randint(0, 10, (steps, b * size), generator=g)
    mine = slice(rank * b, (rank + 1) * b)

    def scaler_for():
        # fp16 needs the loss scaler; bf16 has fp32's range and does without.
        if dtype is torch.float16:
            return torch.amp.GradScaler(kind, init_scale=2.0**12)
        return None

    scaler = scaler_for()
    scales = []
    for step in range(steps):
        x, y = xs[step][mine].to(device), ys[step][mine].to(device)
        session.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(session.model(x), y)
        if step == args.overflow_at and rank == 0:
            loss = loss * 1e30  # fp16 gradients overflow on one rank: every rank must skip
        session.backward_and_step(loss, scaler=scaler)
        scales.append(scaler.get_scale() if scaler else None)

    # One process, the global batch, the LR scaled as hvdkit scales it, its own scaler.
    ref = make_model().to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr * size, momentum=0.9)
    ref_scaler = scaler_for()
    for step in range(steps):
        x, y = xs[step].to(device), ys[step].to(device)
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = ref(x)
        parts = [F.cross_entropy(out[r * b:(r + 1) * b].float(), y[r * b:(r + 1) * b])
                 for r in range(size)]  # fmt: skip
        if step == args.overflow_at:
            parts[0] = parts[0] * 1e30
        loss = sum(parts) / size
        if ref_scaler is not None:
            ref_scaler.scale(loss).backward()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        else:
            loss.backward()
            ref_opt.step()
    mine_w, ref_w = flat(session.model), flat(ref)
    emit(
        rank,
        **pinned,
        dtype=args.dtype,
        digest=hashlib.sha256(mine_w.numpy().tobytes()).hexdigest(),
        diff=(mine_w - ref_w).abs().max().item(),
        moved=(mine_w - flat(make_model())).abs().max().item(),
        scales=scales,
        ref_scale=ref_scaler.get_scale() if ref_scaler else None,
        finite=bool(torch.isfinite(mine_w).all()),
    )


def keras_checks(args) -> None:
    """Keras 3 (KERAS_BACKEND torch or jax) under a mixed-precision policy: fit on each rank's
    shard against fit on the global batch in one process."""
    import keras

    import hvdkit.keras as hvd

    keras.config.set_dtype_policy(args.policy)
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    b, lr = 16, 0.05

    def model_for(seed: int):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ])  # fmt: skip

    def weights(model) -> np.ndarray:
        return np.concatenate(
            [np.ravel(keras.ops.convert_to_numpy(v)).astype(np.float32) for v in model.weights]
        )

    rng = np.random.default_rng(5)
    x = rng.normal(size=(4 * b * size, 16)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    model = model_for(rank)  # differs per rank: the broadcast callback must fix it
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr * size)),
                  loss="mse", jit_compile=False)  # fmt: skip
    shard = np.concatenate([np.arange(s * b * size + rank * b, s * b * size + (rank + 1) * b)
                            for s in range(4)])  # fmt: skip
    model.fit(x[shard], y[shard], batch_size=b, epochs=2, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    start = model_for(0).get_weights()  # rank 0's start, before the oracle leaves JAX's mesh
    keras.distribution.set_distribution(None)  # on JAX, the oracle is this process's alone
    ref = model_for(0)
    ref.set_weights(start)
    ref.compile(optimizer=keras.optimizers.SGD(lr * size), loss="mse", jit_compile=False)
    ref.fit(x, y, batch_size=b * size, epochs=2, verbose=0, shuffle=False)
    mine_w = weights(model)
    kernel = model.weights[0]
    value = getattr(kernel, "value", kernel)
    emit(
        rank,
        policy=args.policy,
        backend=keras.config.backend(),
        device=str(
            value.addressable_shards[0].device  # a JAX array: this process's copy
            if hasattr(value, "addressable_shards")
            else getattr(value, "device", "?")
        ),
        compute_dtype=model.layers[0].compute_dtype,
        optimizer=type(model.optimizer).__name__,
        digest=hashlib.sha256(mine_w.tobytes()).hexdigest(),
        diff=float(np.abs(mine_w - weights(ref)).max()),
        moved=float(np.abs(mine_w - weights(model_for(0))).max()),
        finite=bool(np.isfinite(mine_w).all()),
    )


def allreduce_bandwidth(args) -> None:
    """Horovod allreduce of GPU tensors: seconds per call and the bus bandwidth (NCCL's
    definition: 2 (n-1)/n x bytes / time), against a device-to-device copy of the same bytes."""
    import torch

    import hvdkit.torch as hvd

    hvd.init()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    rows = []
    for mib in (1, 16, 128, 512):
        n = mib * 2**20 // 4
        t = torch.ones(n, device=kind) * (hvd.rank() + 1)
        out = hvd.allreduce(t, op=hvd.Sum, name=f"bw{mib}")  # warm-up and correctness
        want = hvd.size() * (hvd.size() + 1) / 2
        ok = bool((out == want).all())
        reps = 10 if mib <= 128 else 4
        if kind == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(reps):
            hvd.allreduce(t, op=hvd.Sum, name=f"bw{mib}.{i}")
        if kind == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        copy = torch.empty_like(t)
        start = time.perf_counter()
        for _ in range(reps):
            copy.copy_(t)
        if kind == "cuda":
            torch.cuda.synchronize()
        copy_s = (time.perf_counter() - start) / reps
        nbytes = n * 4
        size = hvd.size()
        bus = 2 * (size - 1) / size * nbytes / seconds / 1e9 if size > 1 else None
        rows.append({"MiB": mib, "ok": ok, "allreduce_ms": seconds * 1e3,
                     "algbw_GBps": nbytes / seconds / 1e9, "busbw_GBps": bus,
                     "copy_GBps": 2 * nbytes / copy_s / 1e9})  # fmt: skip
    emit(hvd.rank(), device=kind, rows=rows, nccl=bool(hvd.nccl_built()))


def resume_checks(args) -> None:
    """A resumed ``AdamW(capturable=True)`` or ``fused=True`` (plain or ZeRO-1): 3 steps, a
    save, 3 more (the uninterrupted run); then a fresh session resumes the save and takes the
    last 3 steps again. Both against one process on the global batch. torch's own
    ``load_state_dict`` puts such a step count on the parameter's device; a resume that left
    it on the CPU fails at the first step (capturable) or reads it wrongly."""
    import tempfile

    import torch
    import torch.nn.functional as F

    import hvdkit.torch as hvd

    flags = {args.flag: True}
    lr, b, steps, cut = 1e-2, 8, 6, 3

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4))  # fmt: skip

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])

    ckpt = os.path.join(args.dir or tempfile.mkdtemp(), "ckpt.pt")
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(4)
    xs, ys = (
        torch.randn(steps, b * size, 12, generator=g),
        torch.randn(steps, b * size, 4, generator=g),
    )
    mine = slice(rank * b, (rank + 1) * b)

    def train(session, first: int, last: int) -> None:
        for step in range(first, last):
            x, y = xs[step][mine].to(session.device), ys[step][mine].to(session.device)
            session.optimizer.zero_grad(set_to_none=True)
            session.backward_and_step(F.mse_loss(session.model(x), y))
            if step == cut - 1 and first == 0:
                session.save(end_of_epoch=False)

    def session_for():
        model = make_model()
        device = (
            torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, **flags)
        shard = {"": False, "states": True}.get(args.shard, args.shard)
        return hvd.setup(model, opt, checkpoint=ckpt, shard_optimizer=shard)

    first = session_for()
    train(first, 0, steps)
    whole = flat(first.model)
    resumed = session_for()
    train(resumed, cut, steps)
    # Under ZeRO-1 the state is the inner optimizer's (built at the first step).
    holder = getattr(resumed.optimizer, "_hvdkit_inner", None) or resumed.optimizer
    step_devices = sorted({str(s["step"].device) for s in holder.state.values()
                           if torch.is_tensor(s.get("step"))})  # fmt: skip
    again = flat(resumed.model)

    device = first.device
    ref = make_model().to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr * size, weight_decay=0.1, **flags)
    for step in range(steps):
        ref_opt.zero_grad(set_to_none=True)
        out = ref(xs[step].to(device))
        loss = sum(F.mse_loss(out[r * b:(r + 1) * b], ys[step][r * b:(r + 1) * b].to(device))
                   for r in range(size)) / size  # fmt: skip
        loss.backward()
        ref_opt.step()
    ref_w = flat(ref)
    emit(
        rank,
        dtype="float32",
        device=str(device),
        param_device=str(next(resumed.model.parameters()).device),
        local_rank=hvd.local_rank(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        flag=args.flag,
        shard=args.shard,
        step_devices=step_devices,
        digest=hashlib.sha256(again.numpy().tobytes()).hexdigest(),
        diff=max((again - ref_w).abs().max().item(), (whole - ref_w).abs().max().item()),
        resume_diff=(again - whole).abs().max().item(),
        moved=(again - flat(make_model())).abs().max().item(),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="check", required=True)
    t = sub.add_parser("torch")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    t.add_argument("--overflow-at", type=int, default=-1)
    k = sub.add_parser("keras")
    k.add_argument("--policy", default="mixed_bfloat16")
    sub.add_parser("allreduce")
    r = sub.add_parser("resume")
    r.add_argument("--flag", choices=("capturable", "fused"), default="capturable")
    r.add_argument("--shard", nargs="?", const="states", default="",
                   choices=("states", "gradients"),
                   help="ZeRO: 'states' (stage 1, the default) or 'gradients' (stage 2)")
    r.add_argument("--dir", help="where the checkpoint goes (a temporary folder: rank 0's)")
    args = parser.parse_args()
    checks = {"torch": torch_checks, "keras": keras_checks, "allreduce": allreduce_bandwidth,
              "resume": resume_checks}  # fmt: skip
    checks[args.check](args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
