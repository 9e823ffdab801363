"""Every environment variable hvdkit reads, in one place."""

CACHE_DIR = "HVDKIT_CACHE_DIR"
"""Root of hvdkit's caches (default ``$XDG_CACHE_HOME/hvdkit`` or ``~/.cache/hvdkit``)."""

BUILD_JOBS = "HVDKIT_BUILD_JOBS"
"""Parallel compile jobs for the Horovod build (default: from cores and memory)."""

XDG_CACHE_HOME = "XDG_CACHE_HOME"
CXX = "CXX"
CUDA_HOME = "CUDA_HOME"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

DATA_DIR = "HVDKIT_DATA_DIR"
"""Where the examples look for a local MNIST / Fashion-MNIST copy first."""

PROGRESS = "HVDKIT_PROGRESS"
"""``1`` shows rank 0's progress bars even when its output is not a terminal."""

SYNC_CHECK = "HVDKIT_SYNC_CHECK"
"""``0`` (or ``false``/``off``/``no``) turns the sync guard off (:mod:`hvdkit.sync`)."""

ELASTIC_STALL_TIMEOUT = "HVDKIT_ELASTIC_STALL_TIMEOUT"
"""Seconds the elastic driver waits for a worker that stopped answering (set by ``hvdkit run
--stall-timeout``; read in horovodrun's process)."""

BENCH_THREADS = "HVDKIT_BENCH_THREADS"
"""Threads per rank in every ``hvdkit bench`` job (set by the bench for its workers)."""

BENCH_MASTER = "HVDKIT_BENCH_MASTER"
"""``host:port`` of the bench's torch.distributed rendezvous (set by the bench per job)."""

RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
"""Where a launcher puts this process's rank, read before Horovod is initialised (rank-0
output only; Horovod's own rank wins once known)."""

KERAS_BACKEND = "KERAS_BACKEND"
KERAS_HOME = "KERAS_HOME"
"""Keras's own: its backend (``hvdkit doctor`` reports it, the bench sets it per job), and the
folder of its ``keras.json``."""

SAVE_TIMEOUT = "HVDKIT_SAVE_TIMEOUT"
"""Seconds a rank waits in ``session.save()`` for the other ranks to enter it too (default 120)
before it fails saying save() is collective: a save under ``if rank == 0`` would hang."""

ENV_EXCLUDE = "HVDKIT_ENV_EXCLUDE"
"""Names (comma- or space-separated) ``hvdkit run`` keeps from the ranks under Gloo; every
other exportable variable of the launching shell reaches each rank on its stdin
(:mod:`hvdkit.launch.private_env`)."""

PROFILE_DIR = "HVDKIT_PROFILE_DIR"
"""Set by ``hvdkit run --profile DIR`` for every rank: each records where its steps' time goes
and writes its summary to ``DIR/rank-N.HOST.PID.json`` at exit (:mod:`hvdkit.profile`)."""

HANG_DIR = "HVDKIT_HANG_DIR"
"""Set by ``hvdkit run`` (its hang doctor, ``--stall-timeout``) for every rank: the folder where
a rank writes its Python stacks when the launcher asks (:mod:`hvdkit.hang`)."""

LAUNCHER_PID = "HVDKIT_LAUNCHER_PID"
"""Set by hvdkit's launcher for horovodrun (:mod:`hvdkit.launch.horovodrun`): the process
whose death stops the job (``hvdkit run``, or the notebook kernel that called hvdkit.run)."""
