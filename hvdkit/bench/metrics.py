"""The arithmetic of ``hvdkit bench``: bandwidths, scaling efficiencies and bounds.

Pure functions on numbers, so the definitions are tested on their own:

- algorithm bandwidth ``algbw = bytes / time`` and bus bandwidth
  ``busbw = algbw * 2(n-1)/n`` (the nccl-tests definition for allreduce: what each link
  carries, comparable across world sizes and with the hardware's limit);
- weak-scaling efficiency: per-rank throughput at n ranks over the throughput at one rank,
  with a fixed per-rank batch;
- the no-overlap bound ``t_compute / (t_compute + t_allreduce)``: the efficiency a rank gets
  when gradient communication overlaps nothing. Beating it means communication overlapped
  backward; falling short means time goes somewhere else.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

KIB = 1024
MIB = 1024 * KIB


def message_sizes(smallest: int = 4 * KIB, largest: int = 256 * MIB, factor: int = 4) -> list[int]:
    """Message sizes in bytes from ``smallest`` to ``largest``, each ``factor`` times the last."""
    if smallest <= 0 or largest < smallest or factor < 2:
        raise ValueError(f"bad size range {smallest}..{largest} x{factor}")
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    return sizes


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds


def busbw(algbw_value: float, ranks: int) -> float:
    """Allreduce bus bandwidth (nccl-tests): ``algbw * 2(n-1)/n``; 0 for one rank."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return algbw_value * 2 * (ranks - 1) / ranks


def weak_scaling_efficiency(per_rank_at_one: float, per_rank_at_n: float) -> float:
    """Per-rank throughput at n ranks over the throughput of one rank alone."""
    if per_rank_at_one <= 0:
        raise ValueError("the one-rank throughput must be positive")
    return per_rank_at_n / per_rank_at_one


def no_overlap_bound(t_compute: float, t_allreduce: float) -> float:
    """Weak-scaling efficiency when the gradient allreduce overlaps no compute."""
    if t_compute <= 0 or t_allreduce < 0:
        raise ValueError(f"bad times: compute {t_compute}, allreduce {t_allreduce}")
    return t_compute / (t_compute + t_allreduce)


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median of per-round ratios: rounds were interleaved, so each pair shares the machine's
    state at that moment and slow phases cancel out."""
    if not numerators or len(numerators) != len(denominators):
        raise ValueError("need one denominator per numerator")
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def gbps(bytes_per_second: float) -> float:
    """Bytes/s as GB/s (10^9, as nccl-tests and network links count)."""
    return bytes_per_second / 1e9


def human_bytes(n: int) -> str:
    """``4096`` -> ``4 KiB``; ``268435456`` -> ``256 MiB``."""
    for unit, size in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"
