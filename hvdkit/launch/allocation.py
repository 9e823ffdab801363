"""The hosts a cluster scheduler gave this job, read from its variables and files: Slurm, PBS
or Torque, LSF, and Kubeflow's MPI Operator (MPIJob v2). Pure but for reading the files the
variables name, so every format is unit-tested on its real text.

    Slurm   SLURM_JOB_NODELIST=node[01-02],gpu-a1  SLURM_TASKS_PER_NODE=4(x2),2
    PBS     PBS_NODEFILE: one line per slot (a host appears once per process)
    LSF     LSB_DJOB_HOSTFILE (one line per slot), else LSB_MCPU_HOSTS ("h1 4 h2 4")
    MPIJob  /etc/mpi/hostfile (or OMPI_MCA_orte_default_hostfile): "host slots=N" lines

``hvdkit run`` uses :func:`detect` only when no ``--hostfile``/``-H`` is given: flags win.
Every mistake names the variable (or file and line) and its value.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdkit.launch.hostfile import (
    MAX_SLOTS,
    Host,
    HostfileError,
    check_name,
    parse_hostfile_text,
)
from hvdkit.launch.names import whole_number

MPIJOB_HOSTFILE = "/etc/mpi/hostfile"
MAX_HOSTS = 65536
"""The most hosts an allocation lists (the largest machines have about 10,000 nodes): a
longer one is a typo such as ``node[0-99999999999]``, refused before it is listed."""


class AllocationError(HostfileError):
    """A scheduler variable or file that cannot be read as hosts and slots."""


@dataclass(frozen=True)
class Allocation:
    """Hosts and slots from a scheduler; ``origin`` says which variables or file they came
    from, as the one line ``hvdkit run`` prints."""

    scheduler: str
    hosts: tuple[Host, ...]
    origin: str
    job_id: str | None = None
    gpus_per_node: int | None = None

    @property
    def slots(self) -> int:
        return sum(host.slots for host in self.hosts)

    def describe(self) -> str:
        job = f" job {self.job_id}" if self.job_id else ""
        listed = ", ".join(f"{h.name}:{h.slots}" for h in self.hosts)
        return f"hosts from the {self.scheduler}{job} allocation ({self.origin}): {listed}"


def gpu_problem(allocation: Allocation, nccl: bool) -> str | None:
    """More tasks on a node than the GPUs the scheduler gave it, under NCCL (which refuses two
    ranks on one GPU, once the job runs); None otherwise or when the GPUs are not known."""
    gpus = allocation.gpus_per_node
    crowded = [h for h in allocation.hosts if gpus and h.slots > gpus]
    if not nccl or not crowded:
        return None
    return (
        f"the {allocation.scheduler} allocation puts {crowded[0].slots} tasks on "
        f"{crowded[0].name} but gives it {gpus} GPU(s) ({allocation.origin}), and this "
        "Horovod reduces GPU tensors with NCCL, which refuses two ranks on one GPU. Fix: ask "
        "for as many tasks per node as GPUs per node (#SBATCH --ntasks-per-node=N with "
        "--gpus-per-node=N)"
    )


def expand_nodelist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list (``node[01-04,07],gpu-a[1-2]``, ``r[1-2]-n[1-2]``) as
    names, zero padding kept."""
    names: list[str] = []
    for item in _split_top(text.strip(), variable):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_ranges(part[1:-1], variable, text))
            elif "[" in part or "]" in part or not re.fullmatch(r"[\w.-]*", part):
                raise AllocationError(_bad(variable, text, "host[01-04,07],other"))
            else:
                choices.append([part])
        if len(names) + math.prod(len(choice) for choice in choices) > MAX_HOSTS:
            raise AllocationError(_too_many(variable, text, "hosts"))
        names += ["".join(combo) for combo in itertools.product(*choices)]
    return [_host_name(name, variable, text) for name in names]


def _split_top(text: str, variable: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise AllocationError(_bad(variable, text, "host[01-04,07],other"))
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or not text or any(not item for item in items):
        raise AllocationError(_bad(variable, text, "host[01-04,07],other"))
    return items


def _ranges(inner: str, variable: str, text: str) -> list[str]:
    out: list[str] = []
    for piece in inner.split(","):
        # ASCII digits, no longer than a host name can be (and int() can read).
        match = re.fullmatch(r"([0-9]{1,253})(?:-([0-9]{1,253}))?", piece)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise AllocationError(_bad(variable, text, "host[01-04,07]"))
        low, high = match.group(1), match.group(2) or match.group(1)
        if len(out) + int(high) - int(low) + 1 > MAX_HOSTS:
            raise AllocationError(_too_many(variable, text, "hosts"))
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def expand_counts(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's per-node counts (``4(x2),2`` is 4, 4, 2)."""
    counts: list[int] = []
    for piece in text.strip().split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", piece.strip())
        count = whole_number(match.group(1), MAX_SLOTS) if match else None
        times = (match.group(2) or "1") if match else "0"
        if count is None or not times.strip("0"):
            form = f"4(x2),2 (4 on each of 2 nodes, then 2; at most {MAX_SLOTS} on a node)"
            raise AllocationError(_bad(variable, text, form))
        repeat = whole_number(times, MAX_HOSTS - len(counts))
        if repeat is None:
            raise AllocationError(_too_many(variable, text, "nodes"))
        counts += [count] * repeat
    return counts


def _positive(env: Mapping[str, str], variable: str) -> int | None:
    """A scheduler's count (``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK``...): None when unset, an
    AllocationError naming the variable when it is not a positive whole number."""
    value = env.get(variable, "").strip()
    if not value:
        return None
    number = whole_number(value, MAX_HOSTS * MAX_SLOTS)
    if number is None:
        raise AllocationError(
            f"{variable}={value!r} is not a positive whole number (at most "
            f"{MAX_HOSTS * MAX_SLOTS}), and hvdkit reads it to plan the ranks. Fix: unset it, "
            f"or give it a count as Slurm does (e.g. {variable}=4)"
        )
    return number


def _bad(variable: str, value: str, form: str) -> str:
    return f"{variable}={value!r} cannot be read; expected the form {form}"


def _too_many(variable: str, value: str, what: str) -> str:
    return (
        f"{variable}={value!r} lists more than {MAX_HOSTS} {what}; hvdkit plans at most "
        f"{MAX_HOSTS}. Fix: correct it (was it set by hand?)"
    )


def _once(hosts: tuple[Host, ...], where: str) -> tuple[Host, ...]:
    """``hosts``, each listed once: horovodrun would give a host listed twice two sets of
    local ranks, which collide on its GPUs."""
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise AllocationError(
                f"{where} lists {host.name} more than once; a scheduler lists each host once "
                "(was it set by hand?)"
            )
        seen.add(host.name)
    return hosts


STEP_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")
"""Set by ``srun`` for the tasks of a job step (never in the batch script or salloc shell),
which also get the step's own ``SLURM_NTASKS``, ``SLURM_NODELIST`` and
``SLURM_TASKS_PER_NODE`` in place of the job's."""


def slurm(env: Mapping[str, str]) -> Allocation | None:
    """A Slurm job's nodes and tasks per node (inside ``sbatch`` or ``salloc``, or in an
    ``srun`` step such as ``srun -N1 -n1 hvdkit run``)."""
    if env.get("SLURM_JOB_NODELIST") and any(env.get(v) for v in STEP_VARIABLES):
        return _slurm_job_from_step(env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    variable = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    names = expand_nodelist(nodelist, variable)
    origin = f"{variable}={nodelist}"
    per_task = _positive(env, "SLURM_CPUS_PER_TASK") or 1
    ntasks_variable = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_NPROCS"
    ntasks = _positive(env, ntasks_variable)
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = expand_counts(env["SLURM_TASKS_PER_NODE"])
        origin += f", SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']}"
        where = "SLURM_TASKS_PER_NODE"
    elif env.get("SLURM_JOB_CPUS_PER_NODE"):
        # No tasks asked for: one rank per CPU, or per --cpus-per-task CPUs.
        cpus = expand_counts(env["SLURM_JOB_CPUS_PER_NODE"], "SLURM_JOB_CPUS_PER_NODE")
        counts = [max(1, c // per_task) for c in cpus]
        origin += f", SLURM_JOB_CPUS_PER_NODE={env['SLURM_JOB_CPUS_PER_NODE']}"
        where = "SLURM_JOB_CPUS_PER_NODE"
    else:
        counts = [1] * len(names)
        where = ""
    if len(counts) != len(names):
        raise AllocationError(
            f"{where}={env[where]!r} gives {len(counts)} node(s) but {variable}={nodelist!r} "
            f"lists {len(names)}; both describe the same nodes"
        )
    if ntasks and where == "SLURM_TASKS_PER_NODE" and ntasks != sum(counts):
        raise AllocationError(
            f"SLURM_TASKS_PER_NODE={env[where]!r} adds up to {sum(counts)} tasks but "
            f"{ntasks_variable}={ntasks}; the job's variables disagree (were they set by hand?)"
        )
    source = f"Slurm ({variable})"
    hosts = tuple(Host(n, c, source=source) for n, c in zip(names, counts, strict=True))
    hosts = _once(hosts, f"{variable}={nodelist!r}")
    gpus = _slurm_gpus(env)
    if gpus is not None:
        origin += f", GPUs per node {gpus}"
    return Allocation("Slurm", hosts, origin, env.get("SLURM_JOB_ID"), gpus)


def _slurm_job_from_step(env: Mapping[str, str]) -> Allocation:
    """The job's nodes and tasks per node, read inside one of its ``srun`` steps: its task
    variables describe the step (``srun -N1 -n1``: one task on one node), so the job's
    ``SLURM_JOB_NODELIST`` goes with its ``--ntasks-per-node`` (``SLURM_NTASKS_PER_NODE``),
    the only count of the job's that a step keeps."""
    nodelist = env["SLURM_JOB_NODELIST"]
    names = expand_nodelist(nodelist)
    per_node = _positive(env, "SLURM_NTASKS_PER_NODE")
    if per_node is not None and per_node > MAX_SLOTS:
        raise AllocationError(
            f"SLURM_NTASKS_PER_NODE={per_node} is more than the {MAX_SLOTS} tasks hvdkit starts "
            "on a node. Fix: correct it (was it set by hand?)"
        )
    if per_node is None:
        raise AllocationError(_step_without_counts(env, nodelist, names[0]))
    origin = (
        f"SLURM_JOB_NODELIST={nodelist}, SLURM_NTASKS_PER_NODE={per_node}; the job's, not "
        "this srun step's"
    )
    source = "Slurm (SLURM_JOB_NODELIST)"
    hosts = _once(
        tuple(Host(name, per_node, source=source) for name in names),
        f"SLURM_JOB_NODELIST={nodelist!r}",
    )
    gpus = _slurm_gpus(env, ("SLURM_GPUS_PER_NODE",))  # the step's own GPUs may be fewer
    if gpus is not None:
        origin += f", GPUs per node {gpus}"
    return Allocation("Slurm", hosts, origin, env.get("SLURM_JOB_ID"), gpus)


def _step_without_counts(env: Mapping[str, str], nodelist: str, first: str) -> str:
    step = next(f"{v}={env[v]}" for v in STEP_VARIABLES if env.get(v))
    return (
        f"hvdkit run runs inside an srun step ({step}), whose task variables describe the "
        f"step, not the job on SLURM_JOB_NODELIST={nodelist!r}, and the step does not have the "
        "job's tasks per node. Fix: run `hvdkit run` in the batch script or salloc shell itself "
        "(not under srun); or give the job --ntasks-per-node=N (#SBATCH --ntasks-per-node=N, "
        f"which hvdkit reads as SLURM_NTASKS_PER_NODE); or list the hosts: -H {first}:N,..."
    )


def _slurm_gpus(
    env: Mapping[str, str],
    variables: tuple[str, ...] = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"),
) -> int | None:
    for variable in variables:
        value = env.get(variable, "")
        match = re.fullmatch(r"(?:[\w-]+:)?([0-9]{1,9})", value)  # "2" or "a100:2"
        if match:
            return int(match.group(1))
    return None


def _per_slot_lines(text: str, source: str, scheduler: str) -> tuple[Host, ...]:
    """One line per slot (PBS_NODEFILE, LSB_DJOB_HOSTFILE): hosts in first-seen order."""
    counts: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if name:
            name = _host_name(name, f"{source}:{lineno}", line)
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise AllocationError(f"{source}: no hosts in it; the {scheduler} job has no slots")
    crowded = [n for n, c in counts.items() if c > MAX_SLOTS]
    if crowded:
        raise AllocationError(
            f"{source}: {crowded[0]} is listed {counts[crowded[0]]} times, for as many slots; "
            f"a host takes at most {MAX_SLOTS}"
        )
    return tuple(Host(n, c, source=source) for n, c in counts.items())


def _host_name(name: str, where: str, text: str) -> str:
    """A scheduler's host name, checked as a hostfile's are (it reaches horovodrun's ssh and
    shell strings): AllocationError naming the file and line, or the variable."""
    try:
        return check_name(name, where, text)
    except HostfileError as exc:
        raise AllocationError(f"{exc}; the allocation's host list is not usable as it is") from None


def _read(path: str, variable: str, read: Callable[[str], str]) -> str:
    try:
        return read(path)
    except OSError as exc:
        raise AllocationError(f"{variable}={path}: cannot read it: {exc.strerror or exc}") from None


def pbs(env: Mapping[str, str], read: Callable[[str], str]) -> Allocation | None:
    path = env.get("PBS_NODEFILE")
    if not path:
        return None
    hosts = _per_slot_lines(_read(path, "PBS_NODEFILE", read), path, "PBS")
    return Allocation("PBS", hosts, f"PBS_NODEFILE={path}", env.get("PBS_JOBID"))


def lsf(env: Mapping[str, str], read: Callable[[str], str]) -> Allocation | None:
    job = env.get("LSB_JOBID")
    if env.get("LSB_DJOB_HOSTFILE"):
        path = env["LSB_DJOB_HOSTFILE"]
        hosts = _per_slot_lines(_read(path, "LSB_DJOB_HOSTFILE", read), path, "LSF")
        return Allocation("LSF", hosts, f"LSB_DJOB_HOSTFILE={path}", job)
    value = env.get("LSB_MCPU_HOSTS", "").split()
    if not value:
        return None
    if len(value) % 2 or not all(whole_number(n, MAX_SLOTS) for n in value[1::2]):
        raise AllocationError(
            _bad("LSB_MCPU_HOSTS", " ".join(value), f"host1 4 host2 4 (at most {MAX_SLOTS} a host)")
        )
    pairs = zip(value[::2], value[1::2], strict=True)
    text = " ".join(value)
    hosts = tuple(
        Host(_host_name(n, "LSB_MCPU_HOSTS", text), int(c), source="LSB_MCPU_HOSTS")
        for n, c in pairs
    )
    hosts = _once(hosts, f"LSB_MCPU_HOSTS={text!r}")
    return Allocation("LSF", hosts, f"LSB_MCPU_HOSTS={' '.join(value)}", job)


def mpijob(
    env: Mapping[str, str], read: Callable[[str], str], exists: Callable[[str], bool]
) -> Allocation | None:
    """Kubeflow's MPI Operator mounts the job's hostfile in the launcher pod and points Open
    MPI at it."""
    path = env.get("OMPI_MCA_orte_default_hostfile") or MPIJOB_HOSTFILE
    if not exists(path):
        return None
    text = _read(path, path, read)
    hosts = tuple(parse_hostfile_text(text, path))
    return Allocation("Kubernetes MPIJob", hosts, path)


def detect(
    env: Mapping[str, str] | None = None,
    read: Callable[[str], str] = lambda p: Path(p).read_text(),
    exists: Callable[[str], bool] = os.path.exists,
) -> Allocation | None:
    """The allocation this process runs in, or None outside any (Slurm first, then PBS, LSF
    and an MPIJob's hostfile)."""
    env = os.environ if env is None else env
    return slurm(env) or pbs(env, read) or lsf(env, read) or mpijob(env, read, exists)
