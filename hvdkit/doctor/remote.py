"""``hvdkit doctor --hostfile F``: each host over ssh (reachable, same versions, enough GPUs),
before a real allreduce across all of them. Each failure names the host and what to do."""

from __future__ import annotations

import json
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator

from hvdkit.doctor.checks import FAIL, PASS, Check
from hvdkit.gpus import probe as probe_gpus
from hvdkit.gpus import shared_gpu_problem
from hvdkit.horovod_build.config import FRAMEWORK_NAMES
from hvdkit.horovod_build.record import nccl_built
from hvdkit.launch.hostfile import Host

MARK = "hvdkit-doctor-versions "
SAME_ENV_FIX = (
    "install the same environment at the same path on every host (`make setup` from the same "
    "checkout, or one hvdkit Docker image)"
)


def collect() -> dict:
    """This machine's versions and GPU count (run locally, and remotely over ssh)."""
    from hvdkit import __version__
    from hvdkit.horovod_build.probe import dist_version, framework_version

    versions: dict[str, str | None] = {"Python": platform.python_version(), "hvdkit": __version__}
    versions["Horovod"] = dist_version("horovod")
    for dist, name in FRAMEWORK_NAMES.items():
        versions[name] = framework_version(dist)
    versions["Keras"] = dist_version("keras")
    # Every GPU of the host, as before: a login shell's CUDA_VISIBLE_DEVICES is not the job's.
    gpus = len(probe_gpus(env={}).gpus)
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = None
    return {"versions": versions, "gpus": gpus, "hostname": name, "address": address}


def ssh_argv(host: Host, port: int | None, identity: str | None, timeout: int = 10) -> list[str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}"]
    argv += ["-o", "StrictHostKeyChecking=accept-new"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity:
        argv += ["-i", identity]
    return [*argv, host.name]


def probe(host: Host, port: int | None, identity: str | None) -> tuple[dict | None, str]:
    """(what :func:`collect` says on ``host``, or None; the error text when it failed)."""
    script = (
        "import json; from hvdkit.doctor.remote import MARK, collect; "
        "print(MARK + json.dumps(collect()))"
    )
    remote = shlex.join([sys.executable, "-c", script])
    try:
        out = subprocess.run(
            [*ssh_argv(host, port, identity), remote],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, "no answer within 60 s"
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :]), ""
    errors = [line for line in out.stderr.strip().splitlines() if line.strip()]
    return None, f"exit {out.returncode}: " + (errors[-1] if errors else "no output")


def host_checks(
    hosts: list[Host], port: int | None = None, identity: str | None = None
) -> Iterator[Check]:
    """Reachability, versions and GPUs of every host in the hostfile."""
    here = collect()
    nccl = nccl_built()
    for host in hosts:
        there, error = probe(host, port, identity)
        if there is None:
            reached = not error.startswith("exit 255")  # ssh's own failures exit 255
            yield Check(
                FAIL,
                f"host {host.name}",
                ("reached, but hvdkit could not run there: " if reached else "unreachable: ")
                + error,
                SAME_ENV_FIX
                if reached
                else f"check that sshd runs on {host.name} and that `ssh {host.name} true` works "
                "without a password (keys in ~/.ssh/authorized_keys there)",
            )
            continue
        yield Check(PASS, f"host {host.name}", "reachable over ssh")
        diffs = [
            f"{name} {there['versions'].get(name)} there, {version} here"
            for name, version in here["versions"].items()
            if there["versions"].get(name) != version
        ]
        yield (
            Check(FAIL, f"versions on {host.name}", "; ".join(diffs), SAME_ENV_FIX)
            if diffs
            else Check(PASS, f"versions on {host.name}", "same Python, hvdkit, Horovod, frameworks")
        )
        gpus = there["gpus"]
        if gpus == 0 and here["gpus"] == 0:
            yield Check(PASS, f"GPUs on {host.name}", f"none (CPU run, {host.slots} processes)")
        elif gpus == 0 or shared_gpu_problem(host.slots, gpus, nccl=nccl):
            yield Check(
                FAIL,
                f"GPUs on {host.name}",
                f"{host.slots} slots but {gpus} GPU(s)"
                + (", and NCCL refuses two ranks on one GPU" if gpus else ""),
                f"set `{host.name} slots={gpus}` in the hostfile (one process per GPU)",
            )
        elif gpus < host.slots:
            yield Check(
                PASS,
                f"GPUs on {host.name}",
                f"{host.slots} slots share {gpus} GPU(s) (no NCCL in this Horovod: Gloo/MPI "
                "stage GPU tensors through host memory)",
            )
        else:
            yield Check(PASS, f"GPUs on {host.name}", f"{gpus} for {host.slots} slots")
        if len(hosts) > 1:
            yield name_check(host, there)


def name_check(host: Host, there: dict) -> Check:
    """Horovod 0.28.1's Gloo builds its process-set context on the address of the machine's
    host name, ignoring --network-interface: a name that resolves to loopback (Debian's
    default 127.0.1.1) makes the other hosts connect to themselves and fail."""
    name, address = there["hostname"], there["address"]
    if address and not address.startswith("127."):
        return Check(PASS, f"host name on {host.name}", f"{name} resolves to {address}")
    return Check(
        FAIL,
        f"host name on {host.name}",
        f"{name} resolves to {address or 'nothing'}, not an address other hosts can reach; "
        "Horovod's Gloo would advertise it and the job would fail at its first allreduce",
        f"on {host.name}, map {name} to its cluster address in /etc/hosts (`<IP> {name}`), "
        "or use --mpi",
    )
