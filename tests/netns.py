"""Two "hosts" on this machine for real ssh launches: network namespaces joined by a bridge,
each running its own sshd with keys made in a temporary directory.

    launcher ns (bridge hvd0, 10.77.0.1) --veth-- host ns A (hvd0, 10.77.0.2, sshd)
                                         --veth-- host ns B (hvd0, 10.77.0.3, sshd)

Everything lives inside the three namespaces (the root namespace gets no interface, address or
route), the addresses exist only there, and :meth:`TwoHosts.down` removes all of it. Every
interface is called ``hvd0`` so Horovod finds one common interface on all three.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import interruptible

SUBNET = "10.77.0"
NEEDED = {"ip": "iproute2", "sshd": "openssh-server", "ssh": "openssh-client",
          "ssh-keygen": "openssh-client"}  # fmt: skip


def missing_tools(needed: dict[str, str] = NEEDED) -> list[str]:
    """The Debian packages of ``needed`` (tool -> package) whose tool is not installed."""
    paths = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return sorted({pkg for tool, pkg in needed.items() if shutil.which(tool, path=paths) is None})


def ensure_tools(needed: dict[str, str] = NEEDED) -> str | None:
    """Install the Debian packages that are missing (as root); the reason when impossible."""
    missing = missing_tools(needed)
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"needs {' '.join(missing)} (apt-get install -y {' '.join(missing)} as root)"
    out = subprocess.run(
        ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600",
         "--no-install-recommends", *missing],
        capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )  # fmt: skip
    if out.returncode != 0 or missing_tools(needed):
        return f"apt-get install {' '.join(missing)} failed: {out.stderr.strip()[-300:]}"
    return None


class TwoHosts:
    """Create with :meth:`up`, always remove with :meth:`down`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tag = str(os.getpid() % 100000)
        self.launcher = f"hvdL{tag}"
        self.hosts = {f"hvdA{tag}": f"{SUBNET}.2", f"hvdB{tag}": f"{SUBNET}.3"}
        self.created: list[str] = []
        self.sshd_pids: dict[str, int] = {}
        self.etc_dirs: list[Path] = []

    @staticmethod
    def _run(*argv: str) -> str:
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def up(self) -> None:
        run = self._run
        for ns in (self.launcher, *self.hosts):
            run("ip", "netns", "add", ns)
            self.created.append(ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", self.launcher, "link", "add", "hvd0", "type", "bridge")
        run("ip", "-n", self.launcher, "addr", "add", f"{SUBNET}.1/24", "dev", "hvd0")
        run("ip", "-n", self.launcher, "link", "set", "hvd0", "up")
        for i, (ns, addr) in enumerate(self.hosts.items()):
            port = f"port{i}"
            run("ip", "-n", self.launcher, "link", "add", port, "type", "veth",
                "peer", "name", "hvd0", "netns", ns)  # fmt: skip
            run("ip", "-n", self.launcher, "link", "set", port, "master", "hvd0")
            run("ip", "-n", self.launcher, "link", "set", port, "up")
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "hvd0")
            run("ip", "-n", ns, "link", "set", "hvd0", "up")
        self._keys()
        for ns, addr in self.hosts.items():
            self._hosts_file(ns, addr)
            self.start_sshd(ns)

    def _hosts_file(self, ns: str, addr: str) -> None:
        """`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: there this machine's
        name resolves to the namespace's own address, as a cluster node's name resolves to
        its cluster address (Horovod's Gloo binds part of its traffic to that address)."""
        if not Path("/etc/netns").exists():
            Path("/etc/netns").mkdir()
            self.etc_dirs.append(Path("/etc/netns"))
        directory = Path("/etc/netns") / ns
        directory.mkdir()
        self.etc_dirs.append(directory)
        (directory / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")

    def _keys(self) -> None:
        for name in ("host_key", "id"):
            self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / name))
        (self.tmp / "authorized_keys").write_text((self.tmp / "id.pub").read_text())
        (self.tmp / "ssh_config").write_text(
            f"Host *\n  UserKnownHostsFile {self.tmp}/known_hosts\n  IdentityFile {self.tmp}/id\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
        )
        # ssh reads ~/.ssh from the passwd home, not $HOME: a wrapper first on PATH points it
        # at this directory's config, so the user's known_hosts is never touched.
        bindir = self.tmp / "bin"
        bindir.mkdir()
        wrapper = bindir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {self.tmp}/ssh_config "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    def start_sshd(self, ns: str) -> None:
        config = self.tmp / f"sshd_{ns}.conf"
        config.write_text(
            f"ListenAddress {self.hosts[ns]}\nPort 22\nHostKey {self.tmp}/host_key\n"
            f"PidFile {self.tmp}/sshd_{ns}.pid\nAuthorizedKeysFile {self.tmp}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        )
        sshd = shutil.which("sshd", path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
        log = str(self.tmp / f"sshd_{ns}.log")
        self._run("ip", "netns", "exec", ns, sshd, "-f", str(config), "-E", log)
        pidfile = self.tmp / f"sshd_{ns}.pid"
        # The daemon writes its pid file after it forks, and creating the file and writing the
        # number are two steps: an empty file was read once (CI), so wait for a whole line.
        deadline = time.time() + 15
        text = ""
        while time.time() < deadline:
            text = pidfile.read_text() if pidfile.exists() else ""
            if text.endswith("\n") and text.strip().isdigit():
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"sshd in {ns} did not start: {Path(log).read_text()[-500:]}")
        self.sshd_pids[ns] = int(text)

    def stop_sshd(self, ns: str) -> None:
        pid = self.sshd_pids.pop(ns, None)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def hostfile(self) -> Path:
        path = self.tmp / "hostfile"
        path.write_text(
            "# two network namespaces on this machine, one sshd each\n"
            + "".join(f"{addr} slots=1\n" for addr in self.hosts.values())
        )
        return path

    def netns_id(self, ns: str) -> str:
        return self._run("ip", "netns", "exec", ns, "readlink", "/proc/self/ns/net").strip()

    def _env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.tmp}/bin{os.pathsep}{os.environ.get('PATH', '')}"}

    def run_in_launcher(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.launcher, *argv], capture_output=True, text=True,
            timeout=timeout, env=self._env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def start_in_launcher(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """``argv`` in the launcher's namespace; ``env`` added to its environment (not to its
        command line)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.launcher, *argv], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**self._env(), **(env or {})},
            stdin=subprocess.DEVNULL,
            preexec_fn=interruptible,
        )  # fmt: skip

    def down(self) -> None:
        for ns in list(self.sshd_pids):
            self.stop_sshd(ns)
        for ns in self.created:  # deleting a namespace deletes its interfaces and addresses
            for pid in self._pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
        for directory in reversed(self.etc_dirs):
            shutil.rmtree(directory, ignore_errors=True)
        self.etc_dirs.clear()

    @staticmethod
    def _pids(ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]
