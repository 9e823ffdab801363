"""``hvdkit run``'s side of preemption (:mod:`hvdkit.preempt`): pass a SIGTERM or SIGUSR1 on
to this host's ranks, and requeue a preempted Slurm job (``--requeue``).

The ranks here are found as the rank guards (:mod:`hvdkit.launch.guard`) among horovodrun's
descendants; ranks on other hosts learn of the signal from the ranks here, at the next step
(the sessions agree on it through an allreduce).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

GUARD = "hvdkit.launch.guard"


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """Every process below ``root`` in a pid -> parent pid table."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _process_table(proc: Path = Path("/proc")) -> tuple[dict[int, int], dict[int, list[str]]]:
    parents, commands = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        # The command name (2nd field) may hold spaces and ')': the ppid follows the last ')'.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        commands[int(entry.name)] = cmdline.decode(errors="replace").split("\0")
    return parents, commands


def relay(root: int, signum: int) -> int:
    """Send ``signum`` to the rank guards below ``root`` (they pass it to their rank); how
    many there were."""
    parents, commands = _process_table()
    sent = 0
    for pid in descendants(parents, root):
        # The guard itself, not a shell whose command line mentions it.
        if commands.get(pid, [])[1:3] == ["-m", GUARD]:
            try:
                os.kill(pid, signum)
                sent += 1
            except ProcessLookupError:
                pass
    return sent


def requeue_problem(env: Mapping[str, str]) -> str | None:
    """Why ``--requeue`` cannot work here, or None (checked before the job starts)."""
    if not env.get("SLURM_JOB_ID"):
        return (
            "--requeue requeues a Slurm job, and SLURM_JOB_ID is not set: run hvdkit run "
            "inside an sbatch script (with #SBATCH --requeue), or leave --requeue out"
        )
    return None


def requeue(env: Mapping[str, str]) -> str:
    """``scontrol requeue $SLURM_JOB_ID``; what happened, in one line."""
    argv = ["scontrol", "requeue", env["SLURM_JOB_ID"]]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{' '.join(argv)}` could not run ({exc}); requeue the job by hand"
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no message"]
        return (
            f"`{' '.join(argv)}` failed: {why[0]} (the job needs #SBATCH --requeue, and the "
            "cluster JobRequeue=1)"
        )
    return f"requeued Slurm job {env['SLURM_JOB_ID']} (`{' '.join(argv)}`)"
