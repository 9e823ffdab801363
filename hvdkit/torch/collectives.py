"""Horovod's torch collectives that split or join tensors along their first axis, refusing a
0-d tensor with the fix.

A 0-d tensor has no first axis. Horovod 0.28.1 does not check: ``alltoall`` and
``alltoall_async`` crash the process (a segmentation fault in its Gloo op), ``allgather`` and
``grouped_allgather`` fail with an ``IndexError`` inside their autograd function, and their
``_async`` forms raise ``HorovodInternalError``, which elastic training takes for a lost rank
and answers with a reset. Here each refuses the tensor first, with a ``ValueError`` naming it;
anything else is Horovod's function with its signature. (``reducescatter`` refuses a 0-d tensor
itself, with a clear ``ValueError``: it is Horovod's.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import horovod.torch as _hvd
import torch

from hvdkit.first_axis import check_first, zero_d_error

F = TypeVar("F", bound=Callable[..., Any])


def refuse_0d(op: str, tensor: Any, index: int | None = None) -> None:
    """Raise the ``ValueError`` for ``op`` given a 0-d ``tensor`` (``tensors[index]`` of a
    grouped op); anything else passes."""
    if not (torch.is_tensor(tensor) and tensor.dim() == 0):
        return
    dtype = str(tensor.dtype).removeprefix("torch.")
    raise zero_d_error(op, dtype, "{x}.reshape(1)", index)


def _first_axis_needed(horovod_fn: F) -> F:
    """``horovod_fn`` (whose first parameter is ``tensor``, or ``tensors`` for a grouped op),
    refusing 0-d tensors first."""
    op = horovod_fn.__name__
    key = "tensors" if op.startswith("grouped_") else "tensor"

    @functools.wraps(horovod_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        check_first(op, args[0] if args else kwargs.get(key), refuse_0d)
        return horovod_fn(*args, **kwargs)

    call.__module__ = __name__
    return call  # type: ignore[return-value]


allgather = _first_axis_needed(_hvd.allgather)
allgather_async = _first_axis_needed(_hvd.allgather_async)
grouped_allgather = _first_axis_needed(_hvd.grouped_allgather)
grouped_allgather_async = _first_axis_needed(_hvd.grouped_allgather_async)
alltoall = _first_axis_needed(_hvd.alltoall)
alltoall_async = _first_axis_needed(_hvd.alltoall_async)
