"""What each rank of :func:`hvdkit.run` runs (``python -m hvdkit.launch.func_task``): fetch the
pickled function from the launcher's server, call it, and send back its return value, or the
exception it raised with its traceback (then exit 1, as a failing script does, so the job
stops and the launcher names this rank)."""

from __future__ import annotations

import os
import sys
import traceback
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any

from hvdkit import rank_zero
from hvdkit.launch.func_server import ADDRS, HEADER, KEY

CONNECT_TIMEOUT_S = 10.0


def _request(base: str, path: str, key: str, body: bytes | None = None) -> bytes:
    method = "GET" if body is None else "PUT"
    request = urllib.request.Request(f"http://{base}{path}", data=body, method=method,
                                     headers={HEADER: key})  # fmt: skip
    with urllib.request.urlopen(request, timeout=CONNECT_TIMEOUT_S) as reply:
        return bytes(reply.read())


def _server(addrs: list[str], key: str) -> tuple[str, bytes]:
    """The first address that answers, and the function's bytes."""
    problems = []
    for base in addrs:
        try:
            return base, _request(base, "/func", key)
        except (OSError, urllib.error.URLError) as exc:
            problems.append(f"{base}: {exc}")
    raise SystemExit(
        "hvdkit.run: this rank cannot reach the launcher to fetch its function ("
        + "; ".join(problems)
        + "). Fix: let this host connect back to the launching machine, or name the "
        "interface they share: hvdkit.run(..., network_interfaces=['eth0'])"
    )


def _theirs(error: BaseException) -> TracebackType | None:
    """The traceback from the function's own frames on: without this module's and the
    wrapper's that call it."""
    trace = error.__traceback__
    for _ in range(2):
        if trace is not None and trace.tb_next is not None:
            trace = trace.tb_next
    return trace


def _failure(error: BaseException) -> dict[str, Any]:
    import cloudpickle

    record: dict[str, Any] = {
        "kind": type(error).__qualname__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, _theirs(error))),
        "exception": None,
    }
    try:
        record["exception"] = cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that will not pickle is still reported
        pass
    return record


def main() -> int:
    import cloudpickle

    key = os.environ.pop(KEY, "")  # the function's own code never sees it
    addrs = [a for a in os.environ.pop(ADDRS, "").split(",") if a]
    if not key or not addrs:
        print(f"hvdkit.launch.func_task: {ADDRS} and {KEY} are not set: this module is what "
              "hvdkit.run starts on each rank, not a command to run by hand",
              file=sys.stderr)  # fmt: skip
        return 2
    base, payload = _server(addrs, key)
    func = cloudpickle.loads(payload)
    try:
        body = _returned(func())
    except BaseException as error:
        body = cloudpickle.dumps(_failure(error))
        try:
            _request(base, f"/error/{rank_zero.rank()}", key, body)
        except OSError:
            pass  # the launcher still names this rank from its exit and stderr
        raise
    _request(base, f"/result/{rank_zero.rank()}", key, body)
    return 0


def _returned(value: Any) -> bytes:
    """``value`` pickled for the launcher, or a TypeError that says what to return instead."""
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(value))
    except Exception as exc:
        raise TypeError(
            f"the function returned a {type(value).__qualname__}, which cannot be sent back "
            f"({type(exc).__name__}: {exc}). Fix: return plain data (numbers, lists, dicts, "
            "numpy arrays, a model's state_dict or get_weights())"
        ) from exc


if __name__ == "__main__":
    sys.exit(main())
