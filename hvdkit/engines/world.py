"""The Horovod world of processes an engine has placed (pure).

Ray and Spark start the processes and say which host each is on; Horovod needs, for each, its
rank, its local rank and size on that host, and its cross rank and size (its position among
the processes with the same local rank). Ranks follow the engine's own order of its workers;
local ranks number each host's workers in that order, as Horovod's Ray integration does, so
rank ``i``'s result is the engine's ``i``-th.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdkit.launch.names import check_host


@dataclass(frozen=True)
class Slot:
    """One process's place in the world."""

    rank: int
    size: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def env(self, rendezvous_addr: str, rendezvous_port: int, iface: str | None) -> dict[str, str]:
        """What Horovod's Gloo controller reads at ``init()`` to join this world."""
        env = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_HOSTNAME": self.host,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }
        if iface:
            env["HOROVOD_GLOO_IFACE"] = iface
        return env


def plan(hosts: list[str], engine: str = "the engine") -> list[Slot]:
    """The slots of workers ``0..n-1``, worker ``i`` being on ``hosts[i]`` (as ``engine``
    reported it: each name is checked as every host name is, :mod:`hvdkit.launch.names`)."""
    if not hosts:
        raise ValueError("no workers to place")
    per_host: dict[str, list[int]] = {}
    for worker, host in enumerate(hosts):
        check_host(host, f"{engine}'s worker {worker}")
        per_host.setdefault(host, []).append(worker)
    local = {w: (i, len(ws)) for ws in per_host.values() for i, w in enumerate(ws)}
    cross_size: dict[int, int] = {}
    cross_rank: dict[int, int] = {}
    for workers in per_host.values():  # hosts in the order their first worker appears
        for local_rank, worker in enumerate(workers):
            cross_rank[worker] = cross_size.get(local_rank, 0)
            cross_size[local_rank] = cross_rank[worker] + 1
    return [
        Slot(
            rank=w,
            size=len(hosts),
            host=host,
            local_rank=local[w][0],
            local_size=local[w][1],
            cross_rank=cross_rank[w],
            cross_size=cross_size[local[w][0]],
        )
        for w, host in enumerate(hosts)
    ]


def iface_for(address: str, interfaces: dict[str, list[str]]) -> str | None:
    """The network interface that holds ``address`` (``interfaces``: name to its IPv4
    addresses, as psutil reports them), for Gloo to bind; None when none holds it."""
    for name, addresses in interfaces.items():
        if address in addresses:
            return name
    return None
