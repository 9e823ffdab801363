"""The launcher's side of :func:`hvdkit.run`: a small HTTP server that hands each rank the
pickled function and takes back its result (or its exception), as Horovod's ``run`` does with
its key-value store, plus the pure parts (which addresses the ranks try, what a failed rank's
record says), for unit tests.

Every request carries a random key that reaches the ranks through their private environment
(:mod:`hvdkit.launch.private_env`), never on a command line: without it the server answers
403, so another user on a host cannot fetch the function (and what its closure holds) or
forge a result. The traffic itself is plain HTTP, as Horovod's.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ADDRS = "HVDKIT_FUNC_ADDRS"
"""The ``host:port`` addresses a rank tries, in order, to reach the server (comma-separated)."""
KEY = "HVDKIT_FUNC_KEY"
"""The key every request must carry (header ``X-Hvdkit-Key``)."""
HEADER = "X-Hvdkit-Key"


@dataclass(frozen=True)
class Failure:
    """What a rank's function raised: the exception's type and message, its traceback as
    text, and the exception itself where it could be pickled (else None)."""

    rank: int
    kind: str
    message: str
    traceback: str
    exception: BaseException | None = None

    def describe(self, host: str | None = None) -> str:
        where = f"rank {self.rank}" + (f" (host {host})" if host else "")
        return f"{where} raised {self.kind}: {self.message}"


def addresses(
    remote: Iterable[str],
    port: int,
    local: bool,
    source_for: Callable[[str], str | None],
) -> list[str]:
    """The addresses the ranks try, in order: this machine's address on the route to each
    remote host (what that host can reach, ``source_for``), then loopback when some rank runs
    here."""
    out: list[str] = []
    for host in remote:
        ip = source_for(host)
        if ip and not ip.startswith("127.") and f"{ip}:{port}" not in out:
            out.append(f"{ip}:{port}")
    if local or not out:
        out.append(f"127.0.0.1:{port}")
    return out


def route_source(host: str) -> str | None:
    """This machine's IPv4 address on the route to ``host`` (a UDP socket's connect sends
    nothing), or None when the name does not resolve here."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


class FuncServer:
    """Serves ``payload`` (the pickled function) at ``GET /func`` and keeps what the ranks
    ``PUT`` at ``/result/<rank>`` and ``/error/<rank>``, each rank's last write winning (an
    elastic job's rank may be several processes over the run)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.key = secrets.token_hex(32)
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, bytes] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass  # the job's console is the user's: no request log in it

            def _allowed(self) -> bool:
                if secrets.compare_digest(self.headers.get(HEADER, ""), server.key):
                    return True
                self.send_error(403)
                return False

            def do_GET(self) -> None:
                if not self._allowed():
                    return
                if self.path != "/func":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.payload)))
                self.end_headers()
                self.wfile.write(server.payload)

            def do_PUT(self) -> None:
                if not self._allowed():
                    return
                kind, _, rank = self.path.strip("/").partition("/")
                if kind not in ("result", "error") or not rank.isdigit():
                    self.send_error(404)
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server._lock:
                    (server.results if kind == "result" else server.errors)[int(rank)] = body
                self.send_response(204)
                self.end_headers()

        self._http = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self._http.daemon_threads = True
        self.port = int(self._http.server_address[1])
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> FuncServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
