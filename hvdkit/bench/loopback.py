"""The physical reference for one host: how fast two processes can move bytes over loopback
TCP (what Gloo uses between local ranks), and how fast one process copies memory.

Each message is sent whole and acknowledged with one byte before the next, like the
synchronous step of an allreduce, so small messages show latency and large ones bandwidth.
"""

from __future__ import annotations

import multiprocessing
import socket
import time

from hvdkit.bench.allreduce import iterations

CHUNK = 4 * 1024 * 1024
# Rounds of the largest message before timing: Linux grows a connection's socket buffers
# with its traffic, and the first sizes timed would otherwise see a cold connection
# (measured: 1.4 GB/s at 64 MiB first vs 3.3 GB/s after warm-up).
WARMUP = 2


def _sender(port: int, sizes: list[int], quick: bool) -> None:
    buf = memoryview(bytearray(max(sizes)))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for nbytes in [max(sizes)] * WARMUP + sizes:
            for _ in range(iterations(nbytes, quick) + 1):  # +1: the untimed warm-up
                conn.sendall(buf[:nbytes])
                conn.recv(1)


def _receive(conn: socket.socket, view: memoryview, nbytes: int) -> None:
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got : min(nbytes, got + CHUNK)])
        if n == 0:
            raise ConnectionError("the sending process closed the connection early")
        got += n


def tcp_seconds(sizes: list[int], quick: bool = False) -> list[float]:
    """Seconds per message of each size sent between two processes over 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_sender, args=(port, sizes, quick), daemon=True)
    proc.start()
    out = []
    try:
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(bytearray(max(sizes)))
        with conn:
            for _ in range(WARMUP):
                for _ in range(iterations(max(sizes), quick) + 1):
                    _receive(conn, view, max(sizes))
                    conn.sendall(b"k")
            for nbytes in sizes:
                iters = iterations(nbytes, quick)
                _receive(conn, view, nbytes)
                conn.sendall(b"k")
                start = time.perf_counter()
                for _ in range(iters):
                    _receive(conn, view, nbytes)
                    conn.sendall(b"k")
                out.append((time.perf_counter() - start) / iters)
    finally:
        server.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def memcpy_seconds(sizes: list[int], quick: bool = False) -> list[float]:
    """Seconds per copy of each size within one process (``memoryview`` slice copy: memcpy)."""
    src = memoryview(bytearray(max(sizes)))
    dst = memoryview(bytearray(max(sizes)))
    out = []
    for nbytes in sizes:
        iters = iterations(nbytes, quick)
        dst[:nbytes] = src[:nbytes]
        start = time.perf_counter()
        for _ in range(iters):
            dst[:nbytes] = src[:nbytes]
        out.append((time.perf_counter() - start) / iters)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from hvdkit.bench.worker import emit

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    emit({"sizes": sizes, "seconds": {"loopback TCP": tcp_seconds(sizes, args.quick),
                                         "memcpy": memcpy_seconds(sizes, args.quick)}})  # fmt: skip


if __name__ == "__main__":
    main()
