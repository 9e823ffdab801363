"""hvdkit.launch.allocation on the schedulers' real formats (pure: no scheduler runs here; the
real Slurm test is tests/test_slurm.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import ROOT

from hvdkit.launch import direct
from hvdkit.launch.allocation import (
    AllocationError,
    detect,
    expand_counts,
    expand_nodelist,
)
from hvdkit.launch.hostfile import HostfileError


def files(contents: dict[str, str]):
    def read(path: str) -> str:
        if path not in contents:
            raise FileNotFoundError(2, "No such file or directory")
        return contents[path]

    return read, contents.__contains__


@pytest.mark.parametrize(
    "text, names",
    [
        ("node01", ["node01"]),
        (
            "node[01-04,07],gpu-a[1-2]",
            ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"],
        ),  # fmt: skip
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a,b,c[5]", ["a", "b", "c5"]),
        ("10.77.0.2,10.77.0.3", ["10.77.0.2", "10.77.0.3"]),
    ],
)
def test_slurm_nodelists_expand_like_scontrol_show_hostnames(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["node[01-", "node[3-1]", "node[a-b]", "a,,b", "n]1[", "a b"])
def test_a_nodelist_that_does_not_parse_names_the_variable_and_value(text):
    with pytest.raises(AllocationError, match=r"SLURM_JOB_NODELIST=.*expected the form"):
        expand_nodelist(text)


def test_tasks_per_node_repeat_counts():
    assert expand_counts("4(x2),2") == [4, 4, 2]
    assert expand_counts("1") == [1]
    with pytest.raises(AllocationError, match=r"SLURM_TASKS_PER_NODE='4\(x\)'"):
        expand_counts("4(x)")


def test_slurm_job_gives_hosts_slots_gpus_and_one_line_saying_where_from():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02],gpu-a1",
           "SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_NTASKS": "10",
           "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    alloc = detect(env, *files({}))
    assert [(h.name, h.slots) for h in alloc.hosts] == [("node01", 4), ("node02", 4), ("gpu-a1", 2)]
    assert alloc.slots == 10 and alloc.gpus_per_node == 4 and alloc.scheduler == "Slurm"
    assert alloc.describe() == (
        "hosts from the Slurm job 4242 allocation (SLURM_JOB_NODELIST=node[01-02],gpu-a1, "
        "SLURM_TASKS_PER_NODE=4(x2),2, GPUs per node 4): node01:4, node02:4, gpu-a1:2"
    )


def test_more_tasks_than_gpus_on_a_node_is_refused_under_nccl_only():
    from hvdkit.launch.allocation import gpu_problem

    env = {"SLURM_JOB_NODELIST": "g[1-2]", "SLURM_TASKS_PER_NODE": "8(x2)",
           "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    alloc = detect(env, *files({}))
    message = gpu_problem(alloc, nccl=True)
    assert message.startswith("the Slurm allocation puts 8 tasks on g1 but gives it 4 GPU(s)")
    assert "--ntasks-per-node=N with --gpus-per-node=N" in message
    assert gpu_problem(alloc, nccl=False) is None  # Gloo/MPI ranks may share a GPU
    fits = detect({**env, "SLURM_TASKS_PER_NODE": "4(x2)"}, *files({}))
    assert gpu_problem(fits, nccl=True) is None
    unknown = detect({k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"}, *files({}))
    assert gpu_problem(unknown, nccl=True) is None


def test_slurm_without_tasks_uses_cpus_per_node_over_cpus_per_task():
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
           "SLURM_CPUS_PER_TASK": "4"}  # fmt: skip
    assert [h.slots for h in detect(env, *files({})).hosts] == [2, 2]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"},
         r"SLURM_TASKS_PER_NODE='2\(x2\)' gives 2 node\(s\) but SLURM_JOB_NODELIST='n\[1-3\]' "
         r"lists 3"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "3"},
         r"adds up to 4 tasks but SLURM_NTASKS=3"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "0(x2)"},
         r"SLURM_TASKS_PER_NODE='0\(x2\)' cannot be read"),
        # Counts that are not numbers (issue 39): named, never a traceback or ignored.
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "two"},
         r"SLURM_NTASKS='two' is not a positive whole number.*Fix: unset it"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NPROCS": "-1"},
         r"SLURM_NPROCS='-1' is not a positive whole number"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)",
          "SLURM_CPUS_PER_TASK": "abc"},
         r"SLURM_CPUS_PER_TASK='abc' is not a positive whole number"),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
          "SLURM_CPUS_PER_TASK": "0"},
         r"SLURM_CPUS_PER_TASK='0' is not a positive whole number"),
    ],
)  # fmt: skip
def test_slurm_variables_that_disagree_are_named(env, message):
    with pytest.raises(AllocationError, match=message):
        detect(env, *files({}))


@pytest.mark.parametrize(
    ("env", "contents", "message"),
    [
        ({"PBS_NODEFILE": "/n"}, {"/n": "node1\n$(id)\n"},
         r"/n:2: bad host name '\$\(id\)'"),
        ({"LSB_DJOB_HOSTFILE": "/h"}, {"/h": "node1\nnode`id`\n"},
         r"/h:2: bad host name 'node`id`'"),
        ({"LSB_MCPU_HOSTS": "node1 1 node2;rm 1"}, {},
         r"LSB_MCPU_HOSTS: bad host name 'node2;rm'"),
    ],
)  # fmt: skip
def test_scheduler_host_names_with_shell_characters_are_refused_saying_where(
    env, contents, message
):
    """Issue 39: PBS and LSF host names reach horovodrun's ssh and shell strings as the
    hostfile's do, and are checked the same way (the file and line, or the variable)."""
    with pytest.raises(AllocationError, match=message):
        detect(env, *files(contents))


@pytest.mark.parametrize("value", ["eth0;id", "eth0 eth1", "$(id)", "", "eth0,"])
def test_a_network_interface_with_shell_characters_is_refused(value):
    import argparse

    from hvdkit.commands.options import interface_names

    with pytest.raises(argparse.ArgumentTypeError, match="not interface names. Fix"):
        interface_names(value)
    assert interface_names("eth0,ib0") == "eth0,ib0" and interface_names("enp0s3.100")


def test_pbs_nodefile_has_one_line_per_slot():
    text = "cn01.cluster\ncn01.cluster\ncn02.cluster\ncn02.cluster\ncn01.cluster\n"
    env = {"PBS_NODEFILE": "/var/spool/pbs/aux/77.pbs", "PBS_JOBID": "77.pbs"}
    alloc = detect(env, *files({"/var/spool/pbs/aux/77.pbs": text}))
    assert [(h.name, h.slots) for h in alloc.hosts] == [("cn01.cluster", 3), ("cn02.cluster", 2)]
    assert alloc.describe().startswith("hosts from the PBS job 77.pbs allocation (PBS_NODEFILE=")
    with pytest.raises(AllocationError, match=r"PBS_NODEFILE=/nope: cannot read it"):
        detect({"PBS_NODEFILE": "/nope"}, *files({}))
    with pytest.raises(AllocationError, match=r"/e: no hosts in it"):
        detect({"PBS_NODEFILE": "/e"}, *files({"/e": "\n"}))


def test_lsf_hostfile_then_mcpu_hosts():
    alloc = detect({"LSB_DJOB_HOSTFILE": "/h", "LSB_JOBID": "9"}, *files({"/h": "a\na\nb\n"}))
    assert [(h.name, h.slots) for h in alloc.hosts] == [("a", 2), ("b", 1)]
    alloc = detect({"LSB_MCPU_HOSTS": "hostA 4 hostB 2"}, *files({}))
    assert [(h.name, h.slots) for h in alloc.hosts] == [("hostA", 4), ("hostB", 2)]
    with pytest.raises(AllocationError, match=r"LSB_MCPU_HOSTS='hostA 4 hostB'"):
        detect({"LSB_MCPU_HOSTS": "hostA 4 hostB"}, *files({}))


def test_mpijob_hostfile_from_the_mpi_operator():
    # What MPI Operator v2 writes for 2 workers with slotsPerWorker: 2.
    text = ("job-worker-0.job.default.svc slots=2\n"
            "job-worker-1.job.default.svc slots=2\n")  # fmt: skip
    alloc = detect({}, *files({"/etc/mpi/hostfile": text}))
    assert alloc.scheduler == "Kubernetes MPIJob" and alloc.slots == 4
    with pytest.raises(HostfileError, match=r"/etc/mpi/hostfile:1: slots must be a whole"):
        detect({}, *files({"/etc/mpi/hostfile": "w0 slots=0\n"}))


def test_outside_any_allocation_nothing_is_detected():
    assert detect({"HOME": "/root", "PATH": "/bin"}, *files({})) is None


# What `srun -N1 -n1 hvdkit run` sees in a 2-node job of 4 tasks per node (Slurm's
# env_array_for_step): the step's own counts and node list beside the job's node list.
STEP_OF_ONE = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NODELIST": "node1",
               "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_TASKS_PER_NODE": "1",
               "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_ID": "0",
               "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_NUM_TASKS": "1",
               "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_PROCID": "0",
               "SLURM_JOB_CPUS_PER_NODE": "4(x2)"}  # fmt: skip


def test_inside_an_srun_step_the_jobs_nodes_and_tasks_per_node_are_planned():
    """Issue 49, item 16: the fix hvdkit prints for a bare srun start, `srun -N1 -n1 hvdkit
    run`, planned the step (1 task) against the job's node list (2 nodes) and failed."""
    env = {**STEP_OF_ONE, "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "1",
           "SLURM_GPUS_PER_NODE": "a100:4"}  # fmt: skip
    alloc = detect(env, *files({}))
    assert [(h.name, h.slots) for h in alloc.hosts] == [("node1", 4), ("node2", 4)]
    assert alloc.gpus_per_node == 4  # the job's per node, not the one GPU of the step
    assert alloc.describe() == (
        "hosts from the Slurm job 7 allocation (SLURM_JOB_NODELIST=node[1-2], "
        "SLURM_NTASKS_PER_NODE=4; the job's, not this srun step's, GPUs per node 4): "
        "node1:4, node2:4"
    )
    one_node = {**env, "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1"}
    assert [(h.name, h.slots) for h in detect(one_node, *files({})).hosts] == [("node1", 4)]


def test_inside_an_srun_step_without_the_jobs_tasks_per_node_the_fix_is_named():
    with pytest.raises(AllocationError) as raised:
        detect(STEP_OF_ONE, *files({}))
    message = str(raised.value)
    assert message.startswith(
        "hvdkit run runs inside an srun step (SLURM_STEP_NUM_TASKS=1), whose task variables "
        "describe the step, not the job on SLURM_JOB_NODELIST='node[1-2]'"
    )
    assert "Fix: run `hvdkit run` in the batch script or salloc shell itself" in message
    assert "--ntasks-per-node=N" in message and "-H node1:N,..." in message
    with pytest.raises(AllocationError, match="SLURM_NTASKS_PER_NODE='x' is not a positive"):
        detect({**STEP_OF_ONE, "SLURM_NTASKS_PER_NODE": "x"}, *files({}))
    with pytest.raises(AllocationError, match="SLURM_NTASKS_PER_NODE=5000 is more than"):
        detect({**STEP_OF_ONE, "SLURM_NTASKS_PER_NODE": "5000"}, *files({}))


SRUN_TASK = {"SLURM_JOB_ID": "5", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}  # fmt: skip


@pytest.mark.parametrize("mpi_built", [False, True])
def test_srun_tasks_without_a_launcher_are_stopped_with_the_fix(mpi_built):
    message = direct.problem(SRUN_TASK, mpi_built)
    assert message.startswith("srun started this script as task 1 of 2, but not through a")
    assert "rank 0 of 1" in message and "hvdkit run -- python SCRIPT" in message
    assert ("srun --mpi=pmix" in message) is mpi_built
    # `srun -N1 -n1 hvdkit run` is offered only where hvdkit can read the job's layout in it.
    assert "srun -N1 -n1" not in message
    with_layout = direct.problem({**SRUN_TASK, "SLURM_NTASKS_PER_NODE": "1"}, mpi_built)
    assert "(or `srun -N1 -n1 hvdkit run -- python SCRIPT`)" in with_layout
    with pytest.raises(direct.DirectStartError, match="task 1 of 2"):
        direct.check(mpi_built, SRUN_TASK)


def test_what_forms_one_job_is_let_through():
    gloo = {**SRUN_TASK, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}  # horovodrun / hvdkit run
    pmix = {**SRUN_TASK, "PMIX_RANK": "1"}  # srun --mpi=pmix: MPI forms the world
    mpirun = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert direct.problem(gloo, False) is None and direct.problem(gloo, True) is None
    assert direct.problem(pmix, True) is None and direct.problem(mpirun, True) is None
    # One task, or a batch script's own shell (no SLURM_PROCID): nothing to join.
    assert (
        direct.problem({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}, False)
        is None
    )
    assert direct.problem({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}, False) is None
    assert direct.problem({}, False) is None


def test_mpirun_without_mpi_in_horovod_is_stopped():
    message = direct.problem({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, False)
    assert "an MPI launcher started 2 processes (OMPI_COMM_WORLD_SIZE=2)" in message
    assert "this Horovod has no MPI" in message and "hvdkit run -np N" in message


def test_ranks_space_their_exchanges_alike_and_stop_at_the_same_step():
    """Two ranks' Preemption objects over a fake max-allreduce, with clocks that differ (rank 1
    is slower, 0.1 s a step against 0.05 s): they exchange at the same steps, the gap follows
    the slower rank (0.5 s / 0.1 s = 5 steps), and a signal to rank 1 alone stops both at the
    step after the next exchange started."""
    from hvdkit import preempt

    exchanges: list[list[tuple[int, float]]] = []
    started_at: dict[int, list[int]] = {0: [], 1: []}
    now = [0.0, 0.0]

    def rank(r: int) -> preempt.Preemption:
        def start(flag: int, seconds: float) -> int:
            if not exchanges or len(exchanges[-1]) == 2:
                exchanges.append([])
            exchanges[-1].append((flag, seconds))
            started_at[r].append(step)
            return len(exchanges) - 1

        def finish(h: int) -> tuple[float, float]:
            return max(f for f, _ in exchanges[h]), max(t for _, t in exchanges[h])

        return preempt.Preemption(start, finish, clock=lambda: now[r])

    ranks = [rank(0), rank(1)]
    for step in range(1, 40):
        now[0] += 0.05
        now[1] += 0.1
        answers = [p.step_done() for p in ranks]
        assert answers[0] == answers[1]
        if answers[0]:
            break
        if step == 20:
            ranks[1].received = signal.SIGUSR1
    assert started_at[0] == started_at[1]
    assert started_at[0][:4] == [1, 2, 7, 12]  # every step until a step time is known, then 5
    assert step == started_at[0][-1] + 1 and step > 20
    assert ranks[0].describe() == "SIGUSR1"


def test_after_the_checkpoint_horovodruns_stop_of_the_other_ranks_is_expected():
    """The first rank out after a preemption checkpoint makes horovodrun stop the rest (SIGTERM,
    then SIGKILL after its grace period): its account of that is not reported as a failure,
    and a rank that uninstalled the handlers dies of that SIGTERM instead of ignoring it."""
    from hvdkit import preempt

    for code in (75, 137, 143):
        assert preempt.AFTERMATH.match(f"Process 1 exit with status code {code}.")
    assert preempt.AFTERMATH.match("Terminating remaining workers after failure of Process 0.")
    assert not preempt.AFTERMATH.match("Process 1 exit with status code 1.")
    child = (
        "import os, signal, time\n"
        "from hvdkit import preempt\n"
        "p = preempt.Preemption(preempt.alone, preempt.agreed)\n"
        "assert p.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "assert p.received == signal.SIGTERM\n"
        "p.uninstall()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
    )
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr


# A forked child that sleeps, stopped by SIGTERM as a pool stops its workers (its exit code
# after a 10 s wait: -15 if SIGTERM ended it, None if it survived).
FORK_AND_STOP = ("mp.get_context('fork').Process(target=time.sleep, args=(60,)); w.start(); "
                 "time.sleep(0.5); w.terminate(); w.join(10)")  # fmt: skip


def forked_child(code: str) -> list[str]:
    """Run ``code`` in a fresh Python; the words it printed."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_forked_worker_dies_of_sigterm_while_the_rank_keeps_its_flag():
    """Keras PyDataset and torch DataLoader workers are forked from a rank whose preemption
    handler is installed: they must not inherit it, or the pool's SIGTERM only sets a flag in
    the worker and the rank waits for it at exit (a 2-rank Keras fit with a multiprocessing
    PyDataset and a resume took 270 s instead of 22). Forked from the main thread and from
    another thread (Keras forks from its enqueuer's thread)."""
    child = (
        "import multiprocessing as mp, os, signal, threading, time\n"
        "from hvdkit import preempt\n"
        "p = preempt.Preemption(preempt.alone, preempt.agreed)\n"
        "assert p.install()\n"
        "codes = []\n"
        "def fork_and_stop():\n"
        f"    w = {FORK_AND_STOP}\n"
        "    codes.append(w.exitcode)\n"
        "fork_and_stop()\n"
        "t = threading.Thread(target=fork_and_stop); t.start(); t.join()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "print(codes, p.received)\n"
    )
    assert forked_child(child) == [f"[{-signal.SIGTERM},", f"{-signal.SIGTERM}]",
                                   str(int(signal.SIGTERM))]  # fmt: skip


def test_a_forked_worker_dies_of_sigterm_under_a_handler_installed_below_python():
    """XLA's preemption notifier (Keras on JAX) installs a SIGTERM handler in C, which
    Python's table does not show: a forked PyDataset worker inherited it, survived its pool's
    SIGTERM, and lived on after the job (2 orphans after each 2-rank JAX run, and a 270 s
    wait). Here a C-level handler is put in with libc's signal()."""
    child = (
        "import ctypes, multiprocessing as mp, signal, time\n"
        "from hvdkit import preempt\n"
        "libc = ctypes.CDLL(None)\n"
        "handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda s: None)\n"
        "libc.signal(signal.SIGTERM, handler)\n"
        f"w = {FORK_AND_STOP}\n"
        "print(w.exitcode)\n"
        "if w.exitcode is None: w.kill()\n"
    )
    assert forked_child(child) == [str(-signal.SIGTERM)]


def test_relay_finds_the_guards_below_horovodrun():
    from hvdkit.launch.preemption import descendants

    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(parents, 10) == {11, 12, 13}
    assert descendants(parents, 12) == set()


def test_a_slurm_node_list_name_is_checked_as_every_host_name_is():
    """Slurm's own grammar allows more than a shell-safe name (a leading '-', non-ASCII word
    characters); each expanded name goes through the one check."""
    for nodelist in ("-oProxyCommand[1-2]", "nœud[1-2]"):
        with pytest.raises(AllocationError, match="SLURM_JOB_NODELIST: bad host name"):
            detect({"SLURM_JOB_NODELIST": nodelist})
