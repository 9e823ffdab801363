"""A training process started N times by a scheduler (``srun -n 4 python train.py``) or by a
bare ``mpirun`` rather than by a Horovod launcher: will Horovod see one job of size N?

Horovod forms its world from horovodrun's Gloo rendezvous (``HOROVOD_GLOO_RENDEZVOUS_ADDR``)
or from MPI. Without either, each process initialises alone as rank 0 of size 1: N copies
train on their own and the job "succeeds". :func:`problem` says when that is about to happen;
``hvdkit.torch.init`` and ``hvdkit.keras.init`` stop with its message before Horovod starts.
Pure: the environment and whether Horovod has MPI are its arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Set by MPI launchers for the processes they start: Open MPI's mpirun, PMIx (srun --mpi=pmix,
# prterun), and PMI-1/2 (MPICH's hydra, srun --mpi=pmi2).
MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


class DirectStartError(RuntimeError):
    """N processes started without a launcher, each about to train alone."""


def _declared_size(env: Mapping[str, str]) -> tuple[int, str] | None:
    """The number of processes the starter says it started, and the variable that says so."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name.startswith("SLURM") and "SLURM_PROCID" not in env:
            continue  # a batch script's own shell, not one of srun's tasks
        value = env.get(name, "")
        if value.isdigit():
            return int(value), name
    return None


def problem(env: Mapping[str, str], mpi_built: bool) -> str | None:
    """Why this process would train alone in a job meant to be bigger, with the fix; None
    when Horovod will form the whole job (or the job is one process)."""
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return None  # horovodrun's (or hvdkit's) Gloo rendezvous
    marker = next((name for name in MPI_MARKERS if name in env), None)
    if marker and mpi_built:
        return None  # MPI forms the world from its launcher
    declared = _declared_size(env)
    if declared is None or declared[0] <= 1:
        return None
    size, variable = declared
    if variable.startswith("SLURM"):
        started = f"srun started this script as task {env.get('SLURM_PROCID')} of {size}"
        fix = (
            "start it once through hvdkit's launcher, which reads the allocation: "
            "`hvdkit run -- python SCRIPT` in the sbatch script or salloc shell"
        )
        if env.get("SLURM_NTASKS_PER_NODE"):
            # Inside a step hvdkit run reads the job's layout from this variable alone.
            fix += " (or `srun -N1 -n1 hvdkit run -- python SCRIPT`)"
        if mpi_built:
            fix += "; or let MPI start it: srun --mpi=pmix -n N python SCRIPT"
    else:
        started = f"an MPI launcher started {size} processes ({variable}={size})"
        fix = (
            "this Horovod has no MPI, so it cannot join them: start the job with "
            "`hvdkit run -np N -- python SCRIPT` (Gloo), or build Horovod with MPI "
            "(hvdkit build-horovod --controllers gloo,mpi)"
        )
    return (
        f"{started}, but not through a Horovod launcher: each process would initialise "
        f"Horovod alone as rank 0 of 1 and train its own copy. Fix: {fix}"
    )


def check(mpi_built: bool, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`DirectStartError` when :func:`problem` finds one."""
    message = problem(os.environ if env is None else env, mpi_built)
    if message:
        raise DirectStartError(message)
