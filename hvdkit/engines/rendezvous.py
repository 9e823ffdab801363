"""Horovod's own Gloo rendezvous server (the one ``horovodrun`` starts), run by the process
that drives an engine's job: the workers' ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT`` point at
it. Also a small client for the same key-value store, which the workers use to tell the
driver they started, or how they failed."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from hvdkit.engines import world
from hvdkit.engines.world import Slot


class Rendezvous:
    """A started server; :meth:`stop` ends it."""

    def __init__(self, slots: list[Slot] | None = None) -> None:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        self._server = RendezvousServer(verbose=0)
        self.port: int = self._server.start()
        # The plan sizes the global, local and cross scopes, so that the server forgets a
        # scope's keys once every member is done with it; without one (a world whose hosts
        # are only known inside the workers) each key goes when its writer is done with it.
        plan = [SlotInfo(hostname=s.host, rank=s.rank, local_rank=s.local_rank,
                         cross_rank=s.cross_rank, size=s.size, local_size=s.local_size,
                         cross_size=s.cross_size) for s in slots or []]  # fmt: skip
        self._server.init(plan)

    def read(self, scope: str, key: str) -> Any:
        """A value a worker stored with :func:`put` (None when there is none yet)."""
        return get(f"127.0.0.1:{self.port}", scope, key)

    def stop(self) -> None:
        self._server.stop()


def put(address: str, scope: str, key: str, value: Any, timeout: float = 10) -> None:
    """Store JSON ``value`` under ``scope``/``key`` in the server at ``address`` (host:port)."""
    body = json.dumps(value).encode()
    request = urllib.request.Request(f"http://{address}/{scope}/{key}", data=body, method="PUT")
    with urllib.request.urlopen(request, timeout=timeout):
        pass


def get(address: str, scope: str, key: str, timeout: float = 10) -> Any:
    try:
        with urllib.request.urlopen(f"http://{address}/{scope}/{key}", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def iface_holding(address: str) -> str | None:
    """This machine's network interface that holds ``address`` (an IP or a host name), for
    Gloo to bind (``HOROVOD_GLOO_IFACE``); None when none does."""
    import psutil

    interfaces = {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }
    if not any(address in addrs for addrs in interfaces.values()):
        try:
            address = socket.gethostbyname(address)
        except OSError:
            return None
    return world.iface_for(address, interfaces)
