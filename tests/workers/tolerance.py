"""How close two code paths must be: the one rule for comparing floats in hvdkit's tests.

- **The same computation on different ranks** (weights after a broadcast, an allreduce, the same
  step on the same bytes): compare bit for bit (a digest, ``==``). Every rank runs the same
  kernels on the same machine, so any difference is real divergence.
- **Two code paths** (eager vs ``tf.function``, np=1 vs np=2, two backends or controllers, a
  resumed run vs an uninterrupted one where the arithmetic differs): compare with
  :func:`paths_close`. Each path may round differently, and how depends on the CPU (AVX-512
  kernels, fused multiply-add, another reduction order), so a digest that holds on one
  machine fails on the next (issue 37).

The tolerance grows with the number of optimizer steps: each step can add a rounding error of
the order of the dtype's epsilon to every weight, and later steps carry it on.
"""

from __future__ import annotations

import numpy as np

# Machine epsilon (the gap above 1.0) per dtype name; bfloat16 is not a numpy dtype.
EPSILON = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# Rounding differences between paths are a few ulps a step; 64 leaves room for an optimizer
# that divides by a small number (Adam's sqrt(v)) without hiding a wrong step, which moves a
# weight by lr (1e-3 and more) and is orders of magnitude larger.
ULPS_PER_STEP = 64


def path_tolerance(dtype: str = "float32", steps: int = 1) -> float:
    """The relative tolerance for two paths after ``steps`` optimizer steps in ``dtype``."""
    return ULPS_PER_STEP * EPSILON[str(dtype)] * max(1, steps)


def max_difference(a, b) -> float:
    """The largest absolute difference between two lists of arrays (of the same shapes)."""
    pairs = list(zip(_arrays(a), _arrays(b), strict=True))
    return max((float(np.max(np.abs(x - y), initial=0.0)) for x, y in pairs), default=0.0)


def paths_close(a, b, dtype: str = "float32", steps: int = 1) -> bool:
    """Whether two paths' results (arrays, or lists of them) agree to :func:`path_tolerance`,
    relative to the largest magnitude in ``b`` (at least 1, so weights near 0 are not held to
    an absolute error below one ulp of a weight of order 1)."""
    left, right = _arrays(a), _arrays(b)
    if len(left) != len(right) or any(x.shape != y.shape for x, y in zip(left, right, strict=True)):
        return False
    scale = max([1.0] + [float(np.max(np.abs(y), initial=0.0)) for y in right])
    return max_difference(left, right) <= path_tolerance(dtype, steps) * scale


def _arrays(values) -> list[np.ndarray]:
    if isinstance(values, (list, tuple)):
        return [np.asarray(v, dtype="float64") for v in values]
    return [np.asarray(values, dtype="float64")]
