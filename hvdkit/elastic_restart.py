"""Elastic recovery by restarting the worker process in place, for a runtime that cannot change
its processes while they run (JAX's distributed runtime: Keras on JAX).

At a reset, instead of re-initialising Horovod inside the process, each surviving worker
writes its state's last commit to a private file and replaces itself with a fresh run of the
same command (``os.execv``: the same pid, so Horovod's elastic driver still sees the same
worker). Before its ``hvd.init()``, the new process asks Horovod's rendezvous for its place in
the new world, as Horovod's own re-initialisation does (``rank_and_size``, answered once every
worker of the round has asked); the state the script makes then loads the file back, its
reset callbacks run, and the first sync sends rank 0's copy to every rank, as after an
in-process reset. What the script keeps outside the state starts again from its beginning.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, NoReturn

ENV = "HVDKIT_ELASTIC_RESTART"
"""The committed state's file, in the environment of a process that restarted."""

SLOT_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")  # fmt: skip
"""Horovod's ``rank_and_size`` answer, in its order: what a worker's place is made of."""


class RemovedFromJobError(RuntimeError):
    """The rendezvous has no place for this worker in the new world (its host was removed)."""


def parse_slot(text: str, key: str) -> dict[str, str]:
    """Horovod's answer ``rank,size,local_rank,local_size,cross_rank,cross_size`` as the
    environment variables it sets; raises :class:`RemovedFromJobError` for rank -1."""
    fields = text.strip().split(",")
    if len(fields) != len(SLOT_VARIABLES) or not all(f.lstrip("-").isdigit() for f in fields):
        raise RuntimeError(f"Horovod's rendezvous answered {text.strip()!r} for {key}")
    if int(fields[0]) < 0:
        raise RemovedFromJobError(f"{key} is no longer part of the elastic job")
    return dict(zip(SLOT_VARIABLES, fields, strict=True))


def slot_url(environ: dict[str, str] | os._Environ[str]) -> tuple[str, str]:
    """Where this worker's place is asked for, and its key (``host:local_rank``)."""
    key = f"{environ.get('HOROVOD_HOSTNAME', 'localhost')}:{environ.get('HOROVOD_LOCAL_RANK', 0)}"
    addr = environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]
    port = environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    return f"http://{addr}:{port}/rank_and_size/{key}", key


def rejoin(timeout: float = 600) -> None:
    """In a restarted worker, before ``hvd.init()``: take this worker's place in the new world
    from Horovod's rendezvous (retried while the round forms). Does nothing elsewhere."""
    if not os.environ.get(ENV):
        return
    url, key = slot_url(os.environ)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(1.0, deadline - time.monotonic())) as r:
                text = r.read().decode("ascii")
            break
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"hvdkit elastic: the restarted worker {key} got no place from Horovod's "
                    f"rendezvous at {url} in {timeout:.0f} s ({exc})"
                ) from exc
            time.sleep(0.5)
    try:
        os.environ.update(parse_slot(text, key))
    except RemovedFromJobError:
        print(f"hvdkit elastic: {key} is no longer part of the job; this worker ends", flush=True)
        os._exit(0)


def restart(committed: Any) -> NoReturn:
    """Write ``committed`` (picklable) to a private file and run this process's command again
    in its place; the new process finds the file through :data:`ENV`."""
    fd, path = tempfile.mkstemp(prefix="hvdkit-elastic-", suffix=".pkl")  # mode 0600
    with os.fdopen(fd, "wb") as f:
        pickle.dump(committed, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.environ[ENV] = path
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, list(sys.orig_argv))


def take_committed() -> Any | None:
    """In a restarted worker: the state its previous run committed (its file then removed),
    or None."""
    path = os.environ.pop(ENV, None)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    finally:
        os.unlink(path)
