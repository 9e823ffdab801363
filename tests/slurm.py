"""A real two-node Slurm cluster on this machine, made and removed by a test: Debian's
slurm-wlm 22.05 and munge, every file under one temporary directory.

    root namespace: bridge (SUBNET.1), munged, slurmctld, the client commands (sbatch, srun)
    node A: network namespace (SUBNET.2), its own host name and /etc/hosts, slurmd, sshd
    node B: network namespace (SUBNET.3), the same

Each node's slurmd runs under ``nsenter --net`` (``ip netns exec`` remounts /sys and slurmd
22.05 then fails to find its cgroup mount) inside its own UTS and mount namespace, where
``hostname`` is the node's name and /etc/hosts (bind-mounted) resolves both nodes, as on a
cluster. The sshd beside it lets ``hvdkit run`` start ranks on the other node, as users'
clusters allow between the nodes of a job. Only ``SLURM_CONF`` is needed by the clients:
slurm.conf names the munge socket. Nothing is written to /etc.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from netns import ensure_tools

# Tool -> the Debian package that has it (munge's tools come with munge; sshd for the nodes).
NEEDED = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
          "munged": "munge", "mungekey": "munge", "nsenter": "util-linux",
          "unshare": "util-linux", "ip": "iproute2", "sshd": "openssh-server",
          "ssh": "openssh-client", "ssh-keygen": "openssh-client"}  # fmt: skip
SUBNET = "10.78.0"
NODES = {"nodeA": f"{SUBNET}.2", "nodeB": f"{SUBNET}.3"}
CTLD_PORT, SLURMD_PORT = 16817, 16818


def ensure_installed() -> str | None:
    """Slurm, munge and sshd from Debian (as root); the reason when they cannot be had."""
    return ensure_tools(NEEDED)


def _config(directory: Path, controller: str, cpus: int) -> str:
    nodes = "".join(
        f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN\n"
        for name, addr in NODES.items()
    )
    # sched_interval/bf_interval 1: a requeued job starts again in seconds, not a minute;
    # cred_expire 10: a requeued job waits cred_expire + 1 s (default 120) before it runs.
    return f"""ClusterName=hvdkit
SlurmctldHost={controller}({SUBNET}.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/munge/munge.sock,cred_expire=10
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/run/slurmctld.pid
SlurmdPidFile={directory}/run/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
PlugStackConfig={directory}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
EnforcePartLimits=ALL
InactiveLimit=0
KillWait=10
MinJobAge=300
{nodes}PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Create with :meth:`up`, always remove with :meth:`down`. ``env`` is what a client
    command needs (``SLURM_CONF``, and PATH with an ssh that uses the test's keys)."""

    def __init__(self, directory: Path, cpus: int = 2) -> None:
        # Short: unix socket paths (munge's, slurmd's) are limited to 108 bytes.
        self.dir = directory
        self.cpus = cpus
        tag = str(os.getpid() % 10000)
        self.bridge = f"hvsbr{tag}"
        self.namespaces = {name: f"hvs{name[-1]}{tag}" for name in NODES}
        self.pids: list[int] = []
        self.links: list[str] = []
        self.env = dict(os.environ)

    def _run(self, *argv: str) -> str:
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def _daemon(self, argv: list[str], log: str) -> None:
        with open(self.dir / "log" / log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.pids.append(proc.pid)

    def up(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "log", "run", *(f"spool/{n}" for n in NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for path in (d, d / "munge"):  # munged wants every folder above its socket a+x
            path.chmod(0o755)
        self._run("mungekey", "--create", f"--keyfile={d}/munge/munge.key", "--bits=1024")
        self._daemon(["munged", "--foreground", "--force", f"--socket={d}/munge/munge.sock",
                      f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                      f"--seed-file={d}/munge/munged.seed", f"--log-file={d}/log/munged.log"],
                     "munged.out")  # fmt: skip
        self._network()
        controller = socket.gethostname().split(".")[0]  # must be this host's short name
        (d / "slurm.conf").write_text(_config(d, controller, self.cpus))
        (d / "plugstack.conf").write_text("")
        (d / "hosts").write_text(
            f"127.0.0.1 localhost\n{SUBNET}.1 {controller}\n"
            + "".join(f"{addr} {name}\n" for name, addr in NODES.items())
        )
        self._ssh()
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf"),
                    "PATH": f"{d}/bin{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
        _wait(lambda: (d / "munge" / "munge.sock").exists(), 10, "munged", d / "log")
        self._daemon(["slurmctld", "-D", "-f", str(d / "slurm.conf")], "slurmctld.out")
        sshd = shutil.which("sshd", path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
        for name, ns in self.namespaces.items():
            # One shell per node: its sshd and slurmd share the node's name and hosts file.
            script = (
                'hostname "$1" && mount --bind "$2" /etc/hosts && '
                '"$3" -f "$4" -E "$5" && exec slurmd -D -N "$1" -f "$6"'
            )
            self._daemon(
                ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", script, "_", name, str(d / "hosts"),
                 str(sshd), str(d / f"sshd-{name}.conf"), str(d / "log" / f"sshd-{name}.log"),
                 str(d / "slurm.conf")],
                f"slurmd-{name}.out",
            )  # fmt: skip
        _wait(self._idle, 60, "both nodes idle in sinfo", d / "log")

    def _network(self) -> None:
        run = self._run
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, (name, ns) in enumerate(self.namespaces.items()):
            run("ip", "netns", "add", ns)
            port = f"{self.bridge}p{i}"
            self.links.append(port)
            run("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "link", "set", port, "master", self.bridge, "up")
            run("ip", "-n", ns, "addr", "add", f"{NODES[name]}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")

    def _ssh(self) -> None:
        d = self.dir
        for name in ("host_key", "id"):
            self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name))
        (d / "authorized_keys").write_text((d / "id.pub").read_text())
        (d / "ssh_config").write_text(
            f"Host *\n  UserKnownHostsFile {d}/known_hosts\n  IdentityFile {d}/id\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
        )
        (d / "bin").mkdir()
        wrapper = d / "bin" / "ssh"  # first on the jobs' PATH (sbatch exports it)
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)
        for name, addr in NODES.items():
            (d / f"sshd-{name}.conf").write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {d}/host_key\nPidFile none\n"
                f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                "StrictModes no\n"
            )

    def _idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                             text=True, env=self.env)  # fmt: skip
        return sorted(out.stdout.split("\n")[:-1]) == [f"{n} idle" for n in NODES]

    def run(self, *argv: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """A client command (``sbatch``, ``srun``, ``scontrol``) from the root namespace."""
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=self.env, stdin=subprocess.DEVNULL, **kwargs)  # fmt: skip

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended for good; its final fields."""
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        _wait(lambda: self.job(job_id).get("JobState") in done, timeout,
              f"job {job_id} to end", self.dir / "log")  # fmt: skip
        return self.job(job_id)

    def down(self) -> None:
        if self.pids:
            subprocess.run(["scancel", "--full", "--quiet", "--user=root"], env=self.env,
                           capture_output=True, timeout=10)  # fmt: skip
        in_nodes = [p for ns in self.namespaces.values() for p in _netns_pids(ns)]
        for pid in self.pids + in_nodes:
            _kill(pid, signal.SIGTERM)
        deadline = time.time() + 3
        while time.time() < deadline and any(_alive(p) for p in self.pids + in_nodes):
            time.sleep(0.1)
        for _ in range(3):  # slurmd/slurmstepd may ignore SIGTERM; stragglers fork meanwhile
            for pid in self.pids + [p for ns in self.namespaces.values() for p in _netns_pids(ns)]:
                _kill(pid, signal.SIGKILL)
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.pids.clear()
        self.links.clear()


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait(ready, timeout: float, what: str, logs: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        time.sleep(0.2)
    tails = "".join(
        f"\n--- {p.name}\n" + p.read_text(errors="replace")[-1500:]
        for p in sorted(logs.glob("*")) if p.is_file()
    )  # fmt: skip
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")
