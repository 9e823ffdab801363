"""The one refusal of a 0-d tensor by the collectives that split or join tensors along their
first axis (``allgather``, ``alltoall`` and their grouped and async forms), for every binding:
Horovod 0.28.1 does not check, and crashes the process (``alltoall``) or fails obscurely.
Framework-free: each binding says how to read a tensor's rank and dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def zero_d_error(op: str, dtype: str, reshape: str, index: int | None = None) -> ValueError:
    """The error for a 0-d tensor given to ``op`` (``tensors[index]`` of a grouped op);
    ``reshape`` spells the fix in the binding's terms, ``{x}`` standing for the tensor."""
    which = "the tensor" if index is None else f"tensors[{index}]"
    fix = f"hvd.{op}({reshape.format(x='x')})" if index is None else reshape.format(x=which)
    return ValueError(
        f"hvd.{op}: {which} is 0-d (a scalar of dtype {dtype}), and {op} splits or joins "
        f"tensors along their first axis (Horovod would crash or fail obscurely on it). Fix: "
        f"give it one, e.g. {fix}"
    )


def check_first(op: str, first: Any, refuse: Callable[[str, Any, int | None], None]) -> None:
    """``refuse`` (which raises for a 0-d tensor) each tensor of ``first``: the op's first
    argument, a list or tuple of tensors for a grouped op."""
    if op.startswith("grouped_") and isinstance(first, (list, tuple)):
        for index, tensor in enumerate(first):
            refuse(op, tensor, index)
    else:
        refuse(op, first, None)
