"""Version arithmetic and the ranges hvdkit's build remedies are known for (pure).

A release outside a range may build, but nothing measured says so: the build stops before a
15-minute compile and names ``--allow-untested`` (see :mod:`hvdkit.horovod_build.prereqs`).
"""

from __future__ import annotations

import re

PYTHON_TESTED = ("3.11", "3.13")
"""The Pythons hvdkit's matrix runs (``make matrix``)."""
KNOWN_RANGES = {"torch": ("1.5", "2.15"), "tensorflow": ("2.6", "2.21")}
"""Per framework, the oldest Horovod 0.28.1 supports and the newest a remedy is known for."""
CXX20_COMPILERS = {"gcc": "10", "clang": "10"}
"""The first releases with the C++20 that torch >= 2.14's headers use (concepts, <=>)."""


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading numeric release components."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def at_least(version: str | None, minimum: str) -> bool:
    """``version >= minimum`` on release components; False for an unknown version."""
    return version is not None and version_tuple(version) >= version_tuple(minimum)


def in_range(version: str, low: str, high: str) -> bool:
    """``low <= version`` and ``version``'s major.minor ``<= high`` (patch releases of the
    newest known minor count as known)."""
    parts = version_tuple(version)
    return parts >= version_tuple(low) and parts[:2] <= version_tuple(high)[:2]
