"""``Compression.bf16``: gradients travel as bfloat16, half the bytes of float32, on Gloo, MPI
and NCCL alike, and come back in the parameters' dtype.

Horovod 0.28.1 refuses ``torch.bfloat16`` tensors in its collectives on Gloo and MPI ("Tensor
type torch.BFloat16Tensor is not supported"), so bf16 cannot be a Horovod ``Compressor`` (which
only changes the dtype around Horovod's own allreduce). Here the bf16 bits travel as int16,
through collectives that do no arithmetic, and the sum is done in float32:

1. each rank rounds its gradient to bf16 and ``alltoall``s it: rank r receives every rank's
   r-th slice (the reduce-scatter phase of a ring allreduce);
2. it sums the slices in float32 (in rank order), averages, and rounds once to bf16;
3. ``allgather`` of the reduced slices gives every rank the whole reduced gradient.

That moves 2 (N-1)/N of the bf16 bytes, what a ring allreduce of bf16 moves, and rounds each
rank's gradient once and the average once (a ring that summed in bf16 would round at every hop).

Where bf16 loses against fp16: bf16 keeps float32's exponent range but only 8 bits of
mantissa (fp16: 11). For gradients in fp16's normal range (|g| >= 6e-5) bf16's rounding error
is about 8x fp16's (median 1.4e-3 against 1.7e-4 relative); below it fp16 degrades
(subnormals) and under about 6e-8 flushes to zero, where bf16 keeps its 1.4e-3. The PyTorch
guide has the table.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch

from hvdkit.compression import is_bf16 as is_bf16  # re-exported: the optimizer asks it
from hvdkit.compression import with_bf16

Compression = with_bf16(hvd.Compression)
"""Horovod's compression choices (``none``, ``fp16``) and ``bf16``."""


def to_wire(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` rounded to bf16, as int16 bits (what Horovod's collectives carry)."""
    return flat.to(torch.bfloat16).view(torch.int16)


def from_wire(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.bfloat16)


def reduce_received(received: torch.Tensor, size: int, average: bool) -> torch.Tensor:
    """The ``size`` ranks' bf16 copies of one slice (int16 bits, back to back): their sum in
    float32, averaged, rounded once to bf16 (as int16 bits)."""
    total = from_wire(received).view(size, -1).sum(0, dtype=torch.float32)
    if average:
        total.div_(size)
    return to_wire(total)


class Reducer:
    """bf16 reductions started one tensor at a time (a gradient hook) and finished together:
    the first result asked for waits for every ``alltoall`` started, starts every
    ``allgather`` (Horovod fuses them), and keeps the results for the others."""

    def __init__(self, average: bool, process_set: Any = hvd.global_process_set) -> None:
        self.average, self.process_set = average, process_set
        self._started: dict[Any, tuple[Any, int, torch.Size, torch.dtype, str]] = {}
        self._done: dict[Any, torch.Tensor] = {}

    def start(self, key: Any, name: str, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start reducing ``tensor``; the returned callable gives the reduced tensor."""
        size = self.process_set.size()
        flat = tensor.detach().reshape(-1)
        pad = -flat.numel() % size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        handle = hvd.alltoall_async(
            to_wire(flat), name=f"{name}.bf16.scatter", process_set=self.process_set
        )
        self._started[key] = (handle, tensor.numel(), tensor.shape, tensor.dtype, name)
        return lambda: self.result(key)

    def result(self, key: Any) -> torch.Tensor:
        if key not in self._done:
            self._finish()
        return self._done.pop(key)

    def _finish(self) -> None:
        size = self.process_set.size()
        gathers = []
        for key, (handle, numel, shape, dtype, name) in self._started.items():
            received = tensor_of(hvd.synchronize(handle))
            mine = reduce_received(received, size, self.average)
            gathered = hvd.allgather_async(
                mine, name=f"{name}.bf16.gather", process_set=self.process_set
            )
            gathers.append((key, gathered, numel, shape, dtype))
        self._started.clear()
        for key, handle, numel, shape, dtype in gathers:
            full = from_wire(tensor_of(hvd.synchronize(handle)))[:numel]
            self._done[key] = full.to(dtype).view(shape)


def tensor_of(output: Any) -> torch.Tensor:
    """A collective's result (``alltoall``'s may come with the splits received)."""
    return output[0] if isinstance(output, tuple) else output


def install(optimizer: Any) -> None:
    """Make Horovod's ``DistributedOptimizer`` ``optimizer`` reduce its gradients in bf16:
    its hooks start a :class:`Reducer` reduction instead of an allreduce, and its
    ``synchronize()`` takes the results (Horovod takes a callable as a handle)."""
    if optimizer._groups is not None:
        raise ValueError(
            "Compression.bf16 with groups/num_groups is not supported: leave the grouping "
            "to Horovod's fusion (drop groups=), or use Compression.fp16"
        )
    if optimizer.op not in (hvd.Average, hvd.Sum):
        raise ValueError("Compression.bf16 takes op=Average or op=Sum")
    reducer = Reducer(optimizer.op == hvd.Average, optimizer.process_set)

    def start(self: Any, p: torch.Tensor) -> tuple[Callable[[], torch.Tensor], None]:
        if p.grad is None:  # as Horovod: another rank may have one
            p.grad = p.data.new(p.size()).zero_()
        tensor = p.grad
        if tensor.is_sparse and self.sparse_as_dense:
            tensor = tensor.to_dense()
        elif tensor.is_sparse:
            raise ValueError(
                "Compression.bf16: a sparse gradient (an Embedding(sparse=True)) cannot "
                "travel as bf16: pass sparse_as_dense=True, or use Compression.none"
            )
        name = self._parameter_names.get(p) or f"param.{id(p)}"
        return reducer.start(p, f"hvdkit.{name}", tensor), None

    optimizer._allreduce_grad_async = types.MethodType(start, optimizer)


def allreduce(
    tensors: list[torch.Tensor], average: bool, name: str, process_set: Any = hvd.global_process_set
) -> list[torch.Tensor]:
    """``tensors`` reduced over the ranks in bf16, fused into one buffer (for Keras's torch
    backend); each comes back in its own dtype and shape."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    whole = Reducer(average, process_set).start(0, name, flat)()
    out, at = [], 0
    for t in tensors:
        out.append(whole[at : at + t.numel()].to(t.dtype).view(t.shape))
        at += t.numel()
    return out
