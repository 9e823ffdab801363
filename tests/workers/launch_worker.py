"""Started by `hvdkit run` (or mpirun directly) in tests/test_launch.py and the netns test:
each rank reports where it runs and an allreduce result."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "report"
if mode == "sleep":  # for Ctrl-C: report the pid, then wait to be stopped
    print("PID " + json.dumps({"pid": os.getpid()}), flush=True)
    time.sleep(600)
    sys.exit(0)

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvdkit.torch  # noqa: E402, F401 - the adapter's import path must work under any launcher
from hvdkit import rank_zero  # noqa: E402


def shown(value: str | None) -> str | None:
    """A value as reported: in "slow" mode (the canary test) its digest, so that the canary
    itself appears in no log."""
    if value is None or mode != "slow":
        return value
    return hashlib.sha256(value.encode()).hexdigest()


hvd.init()
if mode == "slow":  # alive long enough for tests/test_launch_ssh.py to look at `ps`
    time.sleep(4)
if mode == "fail" and hvd.rank() == 1:
    print("rank 1 is about to fail on purpose", file=sys.stderr, flush=True)
    raise SystemExit(7)
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="launch").item()
print(
    "RESULT "
    + json.dumps(
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "local_rank": hvd.local_rank(),
            "env_rank": rank_zero.rank(),
            "sum": total,
            "netns": os.readlink("/proc/self/ns/net"),
            "host": socket.gethostname(),
            "forwarded": shown(os.environ.get("HVDKIT_TEST_VALUE")),
            "second": shown(os.environ.get("HVDKIT_TEST_SECOND")),
            "excluded": os.environ.get("HVDKIT_TEST_EXCLUDED"),
            "mpi_yield": os.environ.get("OMPI_MCA_mpi_yield_when_idle"),
        }
    ),
    flush=True,
)
