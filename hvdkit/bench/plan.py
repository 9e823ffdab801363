"""What ``hvdkit bench`` runs: a list of jobs built from its options, with no side effects
(the runner in :mod:`hvdkit.bench.execute` starts them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hvdkit import envvars
from hvdkit.bench.metrics import KIB, MIB, message_sizes
from hvdkit.bench.worker import EXACT_HEAP, STEADY_HEAP
from hvdkit.horovod_build.config import Controller
from hvdkit.launch.plan import default_controller

SECTIONS = ("allreduce", "training", "keras", "pipeline", "profile", "memory")
KERAS_BACKENDS = ("tensorflow", "torch", "jax")


@dataclass(frozen=True)
class BenchConfig:
    """``hvdkit bench``'s options."""

    nps: tuple[int, ...] = (1, 2)
    sections: tuple[str, ...] = SECTIONS
    quick: bool = False
    # For allreduce (none: every one available); training and Keras run on the first, or
    # without it on what `hvdkit run` would choose.
    controllers: tuple[Controller, ...] = ()
    models: tuple[str, ...] = ("cnn", "resnet18")
    keras_backends: tuple[str, ...] = KERAS_BACKENDS
    threads: int = 1  # per rank, at every world size
    pipeline_workers: int = 2
    gpu: bool = False  # this machine has one: add the GPU adapter check
    steady_heap: bool = True  # every job with STEADY_HEAP (False: glibc's own defaults)


@dataclass(frozen=True)
class Job:
    """One launch: ``python -m MODULE ARGS`` on ``np`` ranks with ``controller``."""

    section: str
    label: str
    module: str
    args: tuple[str, ...]
    np: int
    controller: Controller | None = None  # None: one plain process, no launcher
    env: dict[str, str] = field(default_factory=dict)
    key: dict[str, object] = field(default_factory=dict)  # what the result is filed under


# On a GPU: ResNet-50, bf16 autocast + channels_last, one rank, hvdkit against the plain loop
# (batch, steps per round, rounds; quick second). What a GPU user runs; an H100 does ~4,000
# images/s, so a round is under a second.
GPU_CHECK = ("resnet50", (256, 10, 10), (256, 5, 3))


def allreduce_sizes(quick: bool) -> list[int]:
    return message_sizes(4 * KIB, (64 if quick else 256) * MIB)


# Per model: (batch per rank, steps per round, rounds); quick in the second entry. Many short
# rounds rather than a few long ones: the median of per-round ratios needs the rounds.
TRAINING = {
    "cnn": ((32, 5, 48), (32, 4, 3)),
    "mlp": ((64, 5, 12), (64, 4, 3)),
    "resnet18": ((16, 2, 16), (8, 1, 3)),
    "resnet50": ((8, 1, 6), (4, 1, 2)),
}


def _choose(flag: str, given: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    unknown = [g for g in given if g not in allowed]
    if unknown:
        raise ValueError(f"{flag} {','.join(unknown)}: unknown; choose from {', '.join(allowed)}")


def check(config: BenchConfig, available: tuple[str, ...]) -> None:
    """Raise ValueError naming the bad option and the fix."""
    if not config.nps or any(n < 1 for n in config.nps):
        raise ValueError(f"--np {','.join(map(str, config.nps))}: give positive rank counts, "
                         "e.g. --np 1,2")  # fmt: skip
    _choose("--only", config.sections, SECTIONS)
    missing = [c for c in config.controllers if c not in available]
    if missing:
        raise ValueError(
            f"--controllers {','.join(missing)}: this Horovod cannot use "
            f"{' or '.join(m.upper() for m in missing)} here (available: "
            f"{', '.join(available) or 'none'}). Fix: leave it out, or rebuild with "
            "`hvdkit build-horovod --controllers gloo,mpi` after installing Open MPI"
        )
    _choose("--models", config.models, tuple(TRAINING))
    _choose("--keras-backends", config.keras_backends, KERAS_BACKENDS)
    if config.threads < 1:
        raise ValueError(f"--threads {config.threads}: must be >= 1")


def plan_jobs(config: BenchConfig, available: tuple[Controller, ...]) -> list[Job]:
    """Every launch of the run, in order: quick and cheap first, so a failure shows early."""
    check(config, available)
    quick = ("--quick",) if config.quick else ()
    threads = {envvars.BENCH_THREADS: str(config.threads)}
    controllers = config.controllers or available
    main_controller = config.controllers[0] if config.controllers else default_controller(available)
    jobs: list[Job] = []
    if "pipeline" in config.sections:
        batches = 12 if config.quick else 40
        jobs.append(Job("pipeline", "input pipeline", "hvdkit.bench.pipeline",
                        ("--workers", str(config.pipeline_workers), "--batches", str(batches)),
                        1))  # fmt: skip
    if "profile" in config.sections and max(config.nps) > 1:
        short = ("--rounds", "4", "--steps", "10") if config.quick else ()
        jobs.append(Job("profile", f"--profile on/off np={max(config.nps)}",
                        "hvdkit.bench.profile_cost", short, max(config.nps),
                        main_controller))  # fmt: skip
        jobs.append(Job("profile", f"hang doctor on/off np={max(config.nps)}",
                        "hvdkit.bench.profile_cost", (*short, "--what", "hang"),
                        max(config.nps), main_controller))  # fmt: skip
    if "allreduce" in config.sections:
        sizes = ",".join(map(str, allreduce_sizes(config.quick)))
        jobs.append(Job("allreduce", "loopback TCP and memcpy", "hvdkit.bench.loopback",
                        ("--sizes", sizes, *quick), 1))  # fmt: skip
        for np in (n for n in config.nps if n > 1):
            for i, controller in enumerate(controllers):
                extra: tuple[str, ...] = ("--torch-dist",) if i == 0 else ()  # once per np
                extra += ("--mpi4py",) if controller == "mpi" else ()
                jobs.append(Job("allreduce", f"allreduce np={np} {controller}",
                                "hvdkit.bench.allreduce", ("--sizes", sizes, *extra, *quick),
                                np, controller, key={"controller": controller}))  # fmt: skip
    if "training" in config.sections:
        specs = []
        for model in config.models:
            batch, steps, rounds = TRAINING[model][1 if config.quick else 0]
            specs += ["--spec", f"{model}:{batch}:{steps}:{rounds}"]
        # What pinning threads is worth is a property of the machine: one model shows it.
        args = (*specs, "--threads-variant-for", config.models[0])
        for np in config.nps:
            jobs.append(Job("training", f"{','.join(config.models)} np={np}",
                            "hvdkit.bench.training", args, np, main_controller,
                            dict(threads)))  # fmt: skip
        if config.gpu:
            model, full, quick_spec = GPU_CHECK
            batch, steps, rounds = quick_spec if config.quick else full
            jobs.append(Job("training", f"{model} bf16 channels_last np=1",
                            "hvdkit.bench.training",
                            ("--spec", f"{model}:{batch}:{steps}:{rounds}", "--amp",
                             "--channels-last", "--variants", "plain,hvdkit"),
                            1, main_controller, dict(threads)))  # fmt: skip
    if "memory" in config.sections:
        # An MLP with Adam: 4 x 2048^2 is 16.8 M parameters (the 16 M model).
        size = (
            ("--layers", "2", "--width", "512", "--steps", "4", "--rounds", "3")
            if config.quick
            else ("--layers", "4", "--width", "2048", "--steps", "5", "--rounds", "6")
        )
        # Peaks at one rank (where the model measures its temporaries), at the world sizes
        # asked, and at twice the largest (the np=4 beside np=2); each on the exact
        # heap, so that a peak is the bytes live at once. Speed at the sizes asked.
        for np in sorted({1, *config.nps, 2 * max(config.nps)}):
            # Stage 2 at one rank is stage 1 (nothing to free): from two ranks on.
            for variant in ("plain", "sharded", *(("gradients",) if np > 1 else ())):
                jobs.append(Job("memory", f"memory {variant} np={np}", "hvdkit.bench.memory",
                                ("--variant", variant, *size), np, main_controller,
                                {**threads, **EXACT_HEAP}, key={"variant": variant}))  # fmt: skip
        for np in config.nps:
            jobs.append(Job("memory", f"memory speed np={np}", "hvdkit.bench.memory",
                            ("--variant", "speed", *size), np, main_controller, dict(threads),
                            key={"variant": "speed"}))  # fmt: skip
    for backend in config.keras_backends if "keras" in config.sections else ():
        # Many short rounds, as for training: 6 rounds of 30 steps gave per-run medians from
        # 0.89 to 1.02 for the same code.
        batch, steps, rounds = (32, 6, 3) if config.quick else (64, 15, 36)
        args = ("--backend", backend, "--batch-size", str(batch), "--steps", str(steps),
                "--rounds", str(rounds))  # fmt: skip
        # On TensorFlow also the custom loop: DistributedGradientTape against the same loop
        # with the allreduce written out (hvdkit.tensorflow).
        loops = ("fit", "custom") if backend == "tensorflow" else ("fit",)
        for np in config.nps:
            for loop in loops:
                label = f"keras {backend} np={np}" if loop == "fit" else f"tf custom loop np={np}"
                jobs.append(Job("keras", label, "hvdkit.bench.keras_fit", (*args, "--loop", loop),
                                np, main_controller, {**threads, envvars.KERAS_BACKEND: backend},
                                key={"backend": backend, "loop": loop}))  # fmt: skip
    if config.steady_heap:
        jobs = [replace(job, env={**STEADY_HEAP, **job.env}) for job in jobs]
    return jobs
