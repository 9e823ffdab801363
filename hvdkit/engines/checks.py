"""What hvdkit.ray and hvdkit.spark check before they send work to an engine, so that a
missing engine, a cluster that does not answer or a function that cannot travel is said at
once, with the fix, instead of surfacing from inside Ray or Spark."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable
from typing import Any


def require(module: str, who: str, extra: str) -> Any:
    """The engine's module, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{who} needs {module}, which is not installed. Fix: pip install 'hvdkit[{extra}]'"
        ) from None


def answers(address: str, timeout: float = 3.0) -> bool:
    """Whether something accepts a TCP connection at ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def pickled(dumps: Callable[[Any], bytes], fn: Any, payload: Any, who: str) -> bytes:
    """``dumps(payload)`` (``fn`` and what it is sent with), or a TypeError that says why
    ``fn`` cannot travel to the workers and how to write it so that it can."""
    try:
        return dumps(payload)
    except Exception as exc:
        raise TypeError(
            f"{who}: {getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled to "
            f"send to the workers ({type(exc).__name__}: {exc}). Fix: define it at module "
            "level, and pass what it needs as arguments rather than capturing locks, open "
            "files, sockets or clients (a SparkContext, a Ray handle)"
        ) from exc
