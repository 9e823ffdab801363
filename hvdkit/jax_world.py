"""JAX's distributed runtime over Horovod's world: the processes that ``hvd.init()`` joined
(under ``hvdkit run``, ``mpirun``, an allocation or an engine) become JAX's processes, rank for
rank, so that a compiled step can span them (Keras on JAX, :mod:`hvdkit.keras.backends.jax`;
``hvdkit doctor``'s JAX check).

Rank 0 hosts JAX's coordination service on a free port of its own and broadcasts the address
over Horovod; ``JAX_COORDINATOR_ADDRESS`` (JAX's own variable) overrides it, e.g. where rank 0's
host name does not resolve to an address the other hosts reach.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from types import ModuleType
from typing import Any

# Seconds: long enough for a loaded machine's start, short enough that a lost rank ends the
# job in minutes (JAX's defaults: 300 and 100).
INIT_TIMEOUT = 300
HEARTBEAT_TIMEOUT = 60
SHUTDOWN_TIMEOUT = 60


def _coordinator(hvd: ModuleType) -> str:
    """Where JAX's coordination service listens: ``JAX_COORDINATOR_ADDRESS`` when set (JAX's
    own variable), else a free port of rank 0's, broadcast by Horovod."""
    given = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if given:
        return given
    address = None
    if hvd.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if hvd.local_size() == hvd.size():
            host = "127.0.0.1"
        else:
            host = socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        address = f"{host}:{port}"
    return str(hvd.broadcast_object(address, 0, name="hvdkit.jax.coordinator"))


def _has_cuda_plugin() -> bool:
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )


def start(hvd: ModuleType) -> None:
    """Start JAX's runtime with Horovod's ranks (``hvd``: an initialised Horovod module), once;
    on a GPU machine each process takes the GPU of its local rank. Must come before the first
    JAX array: JAX fixes its devices then."""
    import jax

    if hvd.size() == 1 or jax.distributed.is_initialized():
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "hvd.init() came after JAX had started (a JAX array, a Keras model or "
            "jax.devices() was made first): JAX's distributed runtime can only start "
            "before. Fix: call hvd.init() right after the imports, before building anything"
        )
    jax.distributed.initialize(
        _coordinator(hvd), hvd.size(), hvd.rank(),
        local_device_ids=[hvd.local_rank()] if _has_cuda_plugin() else None,
        cluster_detection_method="deactivate", initialization_timeout=INIT_TIMEOUT,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT,
    )  # fmt: skip


def devices() -> list[Any]:
    """Every process's JAX devices in rank order (process index, then device id): the order a
    mesh over Horovod's ranks takes."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
