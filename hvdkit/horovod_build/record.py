"""The build record: what hvdkit built the installed Horovod from (its cache key, wheel and the
inputs of that key: versions, frameworks, controllers). Written by the builder into the
environment (``sys.prefix``), read by the launcher (which controllers exist, without importing
a framework) and by ``hvdkit doctor``. This module alone knows its path and fields."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PATH = Path(sys.prefix) / "share" / "hvdkit" / "horovod-build.json"


@dataclass(frozen=True)
class BuildRecord:
    """One build of Horovod, as recorded."""

    key: str
    wheel: str
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def controllers(self) -> list[str]:
        """The controllers (``gloo``, ``mpi``) Horovod was built with."""
        return list(self.inputs.get("controllers", []))

    @property
    def nccl(self) -> bool:
        """Whether Horovod was built to reduce GPU tensors with NCCL."""
        return self.inputs.get("gpu_operations") == "NCCL"


def read(path: Path = PATH) -> BuildRecord | None:
    """The record, or None when there is none (Horovod installed some other way) or it is
    unreadable."""
    try:
        data = json.loads(path.read_text())
        return BuildRecord(str(data["key"]), str(data.get("wheel", "")), dict(data["inputs"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def controllers(path: Path = PATH) -> list[str] | None:
    """The controllers the record says this Horovod was built with (None without a record:
    Horovod was installed some other way)."""
    built = read(path)
    return None if built is None else built.controllers


def nccl_built(path: Path = PATH) -> bool:
    """Whether the installed Horovod (as recorded) reduces GPU tensors with NCCL."""
    built = read(path)
    return built is not None and built.nccl


def write(record: BuildRecord, path: Path = PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": record.key, "wheel": record.wheel, "inputs": record.inputs}))
