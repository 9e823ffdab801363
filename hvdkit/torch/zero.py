"""ZeRO stage 1 on Horovod's collectives: each rank keeps the optimizer state of its shard
only (``hvdkit.torch.setup(..., shard_optimizer=True)``).

Each param group's parameters are laid out as one flat buffer, padded to a multiple of the
world size, and rank ``r`` owns the ``r``-th equal slice of it (:class:`Layout`, pure): a single
large tensor is split across ranks like everything else. A step:

1. the group's gradients, flattened, are reduce-scattered (averaged) in buckets as the
   backward pass fills them, each rank summing the copies of its slice it receives over its
   own gradient there (no buffer of its own), at most :data:`IN_FLIGHT` buckets of
   :data:`BUCKET` elements received at once and as many buckets' inputs sent and not yet
   done, whatever the timing (a rank that owns none of a bucket receives nothing of it, yet
   Horovod holds what it sends until every rank has sent theirs);
2. an inner optimizer of the user's class, over one shard tensor per group with the group's
   hyperparameters, updates the slice in place (its state is the slice's: 1/N of the whole);
3. each rank broadcasts its updated slice, in place, into the others' parameters.

So a rank holds weights, gradients and 1/N of the state, and buffers of a fixed size: no
copy the size of the model (at N=2 one would cost all that sharding saves).

The parameters and their gradients live in one flat buffer each per group (each ``p.data``
and ``p.grad`` a view, as DDP's ``gradient_as_bucket_view``), so flattening costs no copy, the
shard is a view of the parameters, and at one rank nothing is copied at all. ``zero_grad()``
zeroes the gradients in place rather than setting them to None.

Only trainable parameters are in the buffers: frozen ones (``requires_grad=False``) get no
gradient, state or weight decay, as in a plain optimizer. A group's parameters whose state is
at another step (a layer unfrozen mid-training) get a buffer of their own, and a change of the
trainable set (unfreezing, ``add_param_group``) re-cuts the buffers at the next step. Only
optimizers whose update is elementwise are taken (:func:`declare_elementwise`).

Reduce-scatter and the slices' broadcasts move together what one ring allreduce moves: 2
(N-1)/N of the gradient bytes. Whatever sets the weights in place (a broadcast,
``load_state_dict``) writes the flat buffer; a parameter whose ``data`` was replaced is copied
back in at the next step. After a step a rank's gradients hold the average over its own slice
(as Horovod's allreduce leaves the average in every gradient) and its own gradient elsewhere.

``state_dict()`` is collective: it gathers the slices into the state a plain optimizer of the
same class would have, keyed as torch keys it, so a checkpoint does not depend on the world
size; ``load_state_dict`` takes such a state and keeps this rank's slice of it (a sharded run
resumes a plain run's checkpoint and the other way round, at any ``-np``). The layout follows
the world size, so an elastic reset re-partitions at the next load or step.

Stage 2 (``setup(..., shard_optimizer="gradients")``): no gradient buffer the size of the
model. Each parameter's gradient, once its last backward pass is in, is copied into its
buckets and let go (``p.grad`` is None after the pass); a bucket's buffer lives until its
reduce-scatter is summed into the rank's own slice buffer. At one rank it is stage 1.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops

from hvdkit.torch import bf16
from hvdkit.torch.functions import load_optimizer_state_, step_like
from hvdkit.torch.optimizer import tell_schedulers


@dataclass(frozen=True)
class Layout:
    """Where each of a group's parameters lies in its flat buffer, and which slice a rank
    owns. Pure."""

    numels: tuple[int, ...]
    size: int

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def total(self) -> int:
        """The padded length: the smallest multiple of ``size`` that holds every element."""
        used = sum(self.numels)
        return max(1, -(-used // self.size)) * self.size

    @property
    def shard(self) -> int:
        return self.total // self.size

    def owned(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the flat buffer that ``rank`` owns."""
        return rank * self.shard, (rank + 1) * self.shard

    def buckets(self, limit: int) -> list[tuple[int, int]]:
        """The flat buffer cut into ``[start, end)`` ranges of at most ``limit`` elements,
        covering it all (the last one to the padded end), in the order a backward pass fills
        them: the last parameters first. Whole parameters while they fit; a parameter larger
        than ``limit`` is cut into pieces (each sent once the whole parameter's gradient is
        in), so what a bucket's reduce-scatter receives stays bounded however large a
        tensor is."""
        limit = max(1, limit)
        whole, hi, lo = [], self.total, self.total
        for i in reversed(range(len(self.numels))):
            start = self.offsets[i] if i > 0 else 0
            if lo < hi and hi - start > limit:
                whole.append((lo, hi))
                hi = lo
            lo = start
        if lo < hi:
            whole.append((lo, hi))
        ranges = []
        for lo, hi in whole:  # a bucket longer than the limit: one parameter, cut from its end
            while hi - lo > limit:
                ranges.append((hi - limit, hi))
                hi -= limit
            ranges.append((lo, hi))
        return ranges or [(0, self.total)]

    def splits(self, start: int, end: int) -> list[int]:
        """How many elements of ``[start, end)`` each rank owns (an ``alltoall``'s splits)."""
        return [
            max(0, min(end, (k + 1) * self.shard) - max(start, k * self.shard))
            for k in range(self.size)
        ]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(parameter index, start in it, end in it)`` of each parameter overlapping
        ``rank``'s slice, in order (padding excluded)."""
        start, end = self.owned(rank)
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out.append((i, lo - offset, hi - offset))
        return out


ON_RANK_0 = "hvdkit_gathered_on_rank_0"
"""The key marking a sharded ``state_dict()`` of a rank other than 0 (which holds no state)."""
CHUNK = 1 << 21
"""Elements per inner-optimizer parameter (8 MiB of float32)."""
BUCKET = 1 << 21
"""Elements a reduce-scatter bucket's output may take (8 MiB of float32): a bucket is
``BUCKET // N`` elements, and each rank receives N copies of its piece of it."""
IN_FLIGHT = 4
"""Buckets' worth a group may have in flight, of outputs and of inputs each (what has arrived
is summed and freed first). A buffer for all of them, the size of the model, would cost what
sharding saves (at N=2, all of it); fewer in flight make the backward pass wait on the
collectives."""


def in_flight_bytes(element_size: int = 4) -> int:
    """The most a group's reduce-scatters hold received at once, in bytes."""
    return IN_FLIGHT * BUCKET * element_size


class _Group:
    """One param group at the current world size: its parameters and their gradients live in
    two flat buffers (each parameter's ``data`` and ``grad`` are views into them), and this
    rank's shard is a view of its slice of the parameters, which the inner optimizer updates
    in place."""

    def __init__(
        self,
        params: list[torch.Tensor],
        size: int,
        rank: int,
        like: torch.Tensor,
        reuse: _Group | None = None,
        gradients: bool = False,
    ) -> None:
        self.params = params
        self.layout = Layout(tuple(p.numel() for p in params), size)
        self.rank = rank
        # Stage 2: no gradient buffer the size of the model. Each parameter's gradient is
        # copied into its buckets once its last pass is in, and let go; a bucket's buffer
        # lives until its reduce-scatter is summed into this rank's slice (its own buffer).
        self.stage2 = gradients
        self.filling: dict[int, torch.Tensor] = {}  # stage 2: the buckets being filled
        self.flat_param: torch.Tensor
        self.flat_grad: torch.Tensor
        if reuse is not None and (reuse.layout, reuse.rank, reuse.stage2) == (
            self.layout, rank, gradients
        ):  # fmt: skip
            # The same parameters at the same world (a state loaded, an elastic reset that
            # kept the size): their buffers as they are. New ones would hold the weights and
            # gradients twice until the old were let go.
            self.flat_param, self.flat_grad = reuse.flat_param, reuse.flat_grad
        else:
            # An empty group (a decay/no-decay split with nothing on one side, or all
            # frozen) keeps one padding slice per rank, so every group steps and gathers
            # alike.
            first = params[0] if params else like
            self.flat_param = torch.zeros(self.layout.total, dtype=first.dtype, device=first.device)
            self.flat_grad = self.flat_param.new_zeros(0 if gradients else self.layout.total)
        self._adopt_params()
        for i, p in enumerate(params):
            if p.requires_grad and not gradients:
                # Now, not at the next pass: zero_grad() zeroes this buffer, and a gradient
                # left in an older one (a step cut short by an elastic reset) must not be
                # added to the next pass's.
                self._take_grad(i)
        start, end = self.layout.owned(rank)
        self.shard = self.flat_param[start:end]
        self.slice_grad = self.shard.new_zeros(self.layout.shard if gradients else 0)
        # The inner optimizer's parameters: the shard in pieces of at most CHUNK elements.
        # Its temporaries then stay below glibc's largest reused block (32 MiB): one 67 MB
        # tensor took Adam twice the time, every temporary a fresh mmap and page faults.
        self.chunks = [self.shard[a : a + CHUNK] for a in range(0, self.layout.shard, CHUNK)]
        self.grad: torch.Tensor | None = None  # the reduced gradient of the shard
        # Buckets of at most BUCKET // N elements (whole parameters while they fit), each
        # reduce-scattered (an alltoall) as soon as the backward pass has filled it, behind
        # the rest of the pass.
        self.buckets = self.layout.buckets(BUCKET // size)
        self.bucket_of = [
            [b for b, (lo, hi) in enumerate(self.buckets)
             if lo < off + n and off < hi or (n == 0 and lo <= off < hi)]
            for off, n in zip(self.layout.offsets, self.layout.numels, strict=True)
        ]  # fmt: skip
        self.members = [[i for i, bs in enumerate(self.bucket_of) if k in bs]
                        for k in range(len(self.buckets))]  # fmt: skip
        self.counts = [0] * len(params)
        self.sent: set[int] = set()  # this step's buckets, sent (and maybe reduced already)
        self.summed: set[int] = set()  # those reduced into this rank's slice of flat_grad
        self.received = 0  # elements of the outputs in flight
        self.sending = 0  # elements of the inputs in flight
        self.pending: dict[int, Any] = {}  # bucket: (handle, output), in the order sent
        self.late: set[int] = set()  # buckets written to after they were sent
        self.hooks: list[Any] = []

    def watch(self, passes: Callable[[], int], compression: Any, op: Any, name: str) -> None:
        """Send each bucket once every parameter in it has had its gradient accumulated
        ``passes()`` times (the last backward pass of a step); what arrives is reduced with
        ``op`` (Average or Sum), travelling as ``compression`` makes it."""
        self._compression, self._average, self._name = compression, op == hvd.Average, name
        self._passes = passes

        def ready(i: int) -> None:
            if self.stage2:
                self._ready_stage2(i, passes())
                return
            self._take_grad(i)
            self.counts[i] += 1
            for bucket in self.bucket_of[i]:
                if bucket in self.summed:
                    raise _pass_too_many(i, passes(), "True", "reduced into this rank's slice")
                if bucket in self.sent:
                    self.late.add(bucket)  # sent again at the step
                elif all(self.counts[j] >= passes() for j in self.members[bucket]):
                    self.send(bucket)

        for i, p in enumerate(self.params):
            if p.requires_grad:
                hook = p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))
                self.hooks.append(hook)

    def _ready_stage2(self, i: int, passes: int) -> None:
        """Stage 2: once ``params[i]`` has its last pass's gradient, its pieces go into its
        buckets' buffers, each bucket sent as soon as it is full, and ``p.grad`` is let go."""
        self.counts[i] += 1
        if self.counts[i] < passes:
            return  # accumulating in p.grad, as a plain optimizer does
        if any(b in self.sent for b in self.bucket_of[i]):
            raise _pass_too_many(i, passes, "'gradients'", "sent and its gradient let go")
        self._into_buckets(i, send=True)

    def _into_buckets(self, i: int, send: bool = False) -> None:
        """Stage 2: ``params[i]``'s gradient (None: zeros) into its buckets' buffers, and
        ``p.grad`` let go; with ``send``, each bucket sent once full. One bucket at a time:
        a large parameter's pieces are sent as they are cut, so its gradient is never held
        twice (once by autograd, once in buffers) and what is in flight stays bounded."""
        p, offset, n = self.params[i], self.layout.offsets[i], self.layout.numels[i]
        grad = p.grad
        for bucket in self.bucket_of[i]:
            lo, hi = self.buckets[bucket]
            if bucket not in self.filling:
                self.filling[bucket] = self.flat_param.new_zeros(hi - lo)
            a, b = max(lo, offset), min(hi, offset + n)
            if grad is not None and a < b:
                self.filling[bucket][a - lo : b - lo] = grad.detach().reshape(-1)[
                    a - offset : b - offset
                ]
            if send and all(self.counts[j] >= self._passes() for j in self.members[bucket]):
                self.send(bucket)
        p.grad = None

    def unwatch(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def _take_grad(self, i: int) -> None:
        """``params[i]``'s gradient into the flat buffer, and ``p.grad`` a view there (a
        gradient autograd allocated: the first pass, or after ``p.grad = None``)."""
        p, (offset, n) = self.params[i], (self.layout.offsets[i], self.layout.numels[i])
        view = self.flat_grad[offset : offset + n].view_as(p)
        with torch.no_grad():
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        p.grad = view

    def send(self, bucket: int) -> None:
        """Start ``bucket``'s reduce-scatter: this rank receives every rank's copy of its
        piece of the bucket. What has arrived is summed first; then, while the outputs or
        the inputs in flight would pass :data:`IN_FLIGHT` buckets' worth, the oldest is
        waited for, so neither ever takes more than that. (Bounding the outputs alone let a
        rank that owns none of the buckets send the whole backward pass's stage-2 buffers
        ahead of a slow peer: 27 of them at 4 ranks, 11% over the cost model under load.)"""
        lo, hi = self.buckets[bucket]
        splits = self.layout.splits(lo, hi)
        need = splits[self.rank] * self.layout.size
        for older in [b for b, (handle, _) in self.pending.items() if hvd.poll(handle)]:
            self._finish(older)  # arrived already: summed now, its output freed
        while self.pending and (
            self.received + need > IN_FLIGHT * BUCKET
            or self.sending + hi - lo > IN_FLIGHT * (BUCKET // self.layout.size)
        ):
            self._finish(next(iter(self.pending)))
        if self.stage2:
            source = self.filling.pop(bucket, None)
            if source is None:
                source = self.flat_param.new_zeros(hi - lo)
        else:
            source = self.flat_grad[lo:hi]
        # Horovod holds the input (and output) of a collective in flight until it is done.
        wire = to_wire(source, self._compression)
        output = wire.new_empty(need)
        self.received += need
        self.sending += hi - lo
        handle = mpi_ops._alltoall_async(
            wire, torch.tensor(splits, dtype=torch.int32), output,
            torch.empty(self.layout.size, dtype=torch.int32), f"{self._name}.{bucket}",
            hvd.global_process_set,
        )  # fmt: skip
        self.pending[bucket] = (handle, output)
        self.sent.add(bucket)

    def _landed(self, bucket: int, output: torch.Tensor) -> None:
        """``bucket``'s input and output no longer in flight."""
        lo, hi = self.buckets[bucket]
        self.received -= output.numel()
        self.sending -= hi - lo

    def _finish(self, bucket: int) -> None:
        """Wait for ``bucket``'s reduce-scatter and sum what came in, in place of this
        rank's own gradient in its slice (sent already): the reduced slice costs no memory of
        its own, as Horovod's allreduce writes the average over the gradient."""
        handle, output = self.pending.pop(bucket)
        self._landed(bucket, output)
        received = bf16.tensor_of(hvd.synchronize(handle))
        lo, hi = self.buckets[bucket]
        mine_lo, mine_hi = self.layout.owned(self.rank)
        lo, hi = max(lo, mine_lo), min(hi, mine_hi)
        if lo < hi:
            total = reduce_received(
                received, self.layout.size, self._average, self._compression,
                self.shard.dtype,
            )  # fmt: skip
            if self.stage2:
                self.slice_grad[lo - mine_lo : hi - mine_lo] = total
            else:
                self.flat_grad[lo:hi] = total
                self.summed.add(bucket)

    def reduce(self) -> torch.Tensor:
        """This rank's slice of the gradients reduced over the ranks: the buckets not sent
        during the backward pass (or written to since) are sent now, and each rank's pieces
        of the slice are summed as they arrive."""
        if self.stage2:
            for i in range(len(self.params)):
                if self.counts[i] < self._passes():  # not in by the hooks: unused, no grad
                    self._into_buckets(i)
        else:
            self.flat_grads()
        for bucket in sorted(self.late):  # none summed: that raised at the accumulation
            if bucket in self.pending:
                handle, output = self.pending.pop(bucket)
                hvd.synchronize(handle)
                self._landed(bucket, output)
            self.sent.discard(bucket)
        for bucket in range(len(self.buckets)):
            if bucket not in self.sent:
                self.send(bucket)
        while self.pending:
            self._finish(next(iter(self.pending)))
        self.sent.clear()
        self.summed.clear()
        self.late.clear()
        self.counts = [0] * len(self.params)
        return self.slice_grad if self.stage2 else self.mine(self.flat_grad)

    def set_grad(self, grad: torch.Tensor | None) -> None:
        self.grad = grad
        for chunk, at in zip(self.chunks, range(0, self.layout.shard, CHUNK), strict=True):
            chunk.grad = None if grad is None else grad[at : at + chunk.numel()]

    def joined(self, entries: list[Any]) -> Any:
        """One state entry of every chunk as the shard's: per-element tensors joined, a
        scalar (Adam's step) taken once."""
        pairs = zip(entries, self.chunks, strict=True)
        if all(torch.is_tensor(e) and e.shape == c.shape for e, c in pairs):
            return torch.cat([e.detach().reshape(-1) for e in entries])
        return entries[0]

    def _adopt_params(self) -> None:
        """Each parameter's values into the flat buffer, and its ``data`` a view there (again
        for one whose ``data`` was replaced since)."""
        with torch.no_grad():
            for p, view in zip(self.params, self.unflat(self.flat_param), strict=True):
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view

    def flat_grads(self) -> torch.Tensor:
        """The group's gradients as one padded flat buffer: each ``p.grad`` becomes a view
        into it (a missing one zeros), so autograd accumulates there from the next backward
        pass on and this costs no copy."""
        self._adopt_params()
        for i in range(len(self.params)):
            self._take_grad(i)
        return self.flat_grad

    def gather_params(self, name: str) -> None:
        """Every rank's updated slice into the parameters: each rank broadcasts its slice in
        place, into the same place in the others' flat buffers, all at once. An all-gather
        would need an output apart from the parameters (the ranks' pieces of one call are
        not contiguous there, and MPI refuses an input inside its output): memory the size of
        the model, or many small calls in turn."""
        size, shard = self.layout.size, self.layout.shard
        if size == 1:
            return  # the shard is the whole buffer, updated in place
        handles = [
            hvd.broadcast_async_(self.flat_param[r * shard : (r + 1) * shard], root_rank=r,
                                 name=f"{name}.{r}")
            for r in range(size)
        ]  # fmt: skip
        for handle in handles:
            hvd.synchronize(handle)

    def slice_of(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's slice of the group's per-parameter tensors (None: zeros), on the
        shard's device, in its dtype where they are floating point: copied piece by piece,
        never the whole group's flat buffer."""
        sample = next(t for t in tensors if t is not None)
        dtype = self.shard.dtype if sample.is_floating_point() else sample.dtype
        out = torch.zeros(self.layout.shard, dtype=dtype, device=self.shard.device)
        start, _ = self.layout.owned(self.rank)
        for i, lo, hi in self.layout.pieces(self.rank):
            tensor = tensors[i]
            if tensor is not None:
                at = self.layout.offsets[i] + lo - start
                out[at : at + hi - lo] = tensor.detach().reshape(-1)[lo:hi]
        return out

    def unflat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A padded flat buffer as one tensor per parameter, each shaped like it."""
        return [
            flat[o : o + n].view_as(p)
            for o, n, p in zip(self.layout.offsets, self.layout.numels, self.params, strict=True)
        ]

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        start, end = self.layout.owned(self.rank)
        return flat[start:end]


def _pass_too_many(i: int, passes: int, setting: str, what: str) -> RuntimeError:
    """A gradient accumulated into parameter ``i`` after its bucket was ``what``: the error
    with the fix, for either stage."""
    return RuntimeError(
        f"hvdkit: shard_optimizer={setting}: parameter {i} of a param group had its gradient "
        f"accumulated again after its bucket was {what} (more backward passes than "
        f"backward_passes_per_step={passes}, or a parameter accumulated twice in one pass, as "
        "under torch.utils.checkpoint(use_reentrant=True)). Fix: pass setup() the number of "
        "backward passes a step takes (backward_passes_per_step=), or checkpoint with "
        "use_reentrant=False"
    )


def _gather(tensor: torch.Tensor, name: str, root: int | None) -> torch.Tensor | None:
    """Every rank's slice ``tensor`` joined, on the host: on every rank (``root`` None), or on
    ``root`` only (an alltoall in which every rank sends its slice there; the others get
    None). One state tensor at a time, so no rank ever holds more than one tensor's gather
    beyond what it keeps."""
    mine = tensor.detach().to("cpu")
    if hvd.size() == 1:
        return mine.clone() if mine.data_ptr() == tensor.data_ptr() else mine
    if root is None:
        return hvd.allgather(mine, name=name)
    splits = [mine.numel() if r == root else 0 for r in range(hvd.size())]
    received, _ = hvd.alltoall(mine, splits=torch.tensor(splits, dtype=torch.int32), name=name)
    return received if hvd.rank() == root else None


def to_wire(flat: torch.Tensor, compression: Any) -> torch.Tensor:
    """What travels for ``flat``: bf16 bits as int16, or ``compression``'s dtype."""
    if bf16.is_bf16(compression):
        return bf16.to_wire(flat)
    return compression.compress(flat)[0]


def reduce_received(
    received: torch.Tensor, size: int, average: bool, compression: Any, dtype: torch.dtype
) -> torch.Tensor:
    """Every rank's copy of one piece of this rank's slice, back to back, in the wire's
    dtype: their sum in ``dtype``, in rank order, averaged, rounded as the wire's dtype once
    (as Horovod's reduction rounds), in ``dtype``."""
    if bf16.is_bf16(compression):
        return bf16.from_wire(bf16.reduce_received(received, size, average)).to(dtype)
    total = received.view(size, -1).sum(0, dtype=dtype)  # one pass over what came in
    if average:
        total.div_(size)
    if received.dtype != dtype:
        total = total.to(received.dtype).to(dtype)
    return total


class _Sharded:
    """Put in front of the user's optimizer class (see :func:`ShardedOptimizer`): the outer
    object keeps the user's param groups (schedulers, the LR multiplier and clipping see full
    parameters); the state lives in ``_hvdkit_inner``, over the shards."""

    param_groups: list[dict[str, Any]]
    state: Any
    _hvdkit_base: type
    _hvdkit_inner: torch.optim.Optimizer | None
    _hvdkit_template: dict[str, Any]
    _hvdkit_loaded: dict[str, Any] | None  # the state last loaded, until the next step
    _hvdkit_groups: list[_Group]
    _hvdkit_owners: list[int]  # the param group each of them belongs to
    _hvdkit_parked: dict[torch.Tensor, dict[str, Any]]  # whole state of frozen parameters
    _hvdkit_world: tuple[int, int]
    _hvdkit_signature: tuple[tuple[int, ...], ...]
    _hvdkit_compression: Any
    _hvdkit_op: Any
    _hvdkit_stage2: bool  # ZeRO stage 2: gradients sharded too
    _synchronized: bool
    _should_synchronize: bool
    backward_passes_per_step: int  # the session's: the last pass of a step sends the buckets

    sharded = True

    def _hvdkit_trainable(self) -> tuple[tuple[int, ...], ...]:
        """Which parameters the flat buffers hold: each group's trainable ones. Frozen
        parameters (``requires_grad=False``) stay out, as in a plain optimizer they get no
        gradient, no state and no weight decay."""
        return tuple(
            tuple(id(p) for p in g["params"] if p.requires_grad) for g in self.param_groups
        )

    def _hvdkit_partition(self, given: dict[torch.Tensor, dict[str, Any]] | None = None) -> None:
        """(Re)build the layout and the inner optimizer when the world changed (the first
        step, an elastic reset) or the trainable parameters did (``add_param_group``, a layer
        unfrozen), or with the state ``given`` (``load_state_dict``); the inner state is then
        the slice of the state a gather gives, so nothing is lost."""
        world = (hvd.size(), hvd.rank())
        trainable = self._hvdkit_trainable()
        if (
            given is None
            and self._hvdkit_inner is not None
            and (world, trainable) == (self._hvdkit_world, self._hvdkit_signature)
        ):
            return
        carried = given
        inner_now = self._hvdkit_inner
        if given is None and inner_now is not None and (inner_now.state or self._hvdkit_parked):
            if world != self._hvdkit_world:
                # The slices were cut for another world: only the whole state re-cuts them.
                raise RuntimeError(
                    f"hvdkit: the world changed from {self._hvdkit_world} to {world} (size, "
                    "rank) with a sharded optimizer state that was not reloaded: "
                    "load_state_dict() the whole state (hvdkit.torch.setup(..., elastic=True) "
                    "does it at each reset)"
                )
            carried = self._hvdkit_full_state()  # collective: every rank changed its groups
        elif given is None and inner_now is None and self.state:
            # State the constructor made (Adagrad's initial sums): sliced like any other.
            carried, self.state = dict(self.state), collections.defaultdict(dict)
        reusable = (
            {tuple(id(p) for p in old.params): old for old in self._hvdkit_groups}
            if world == self._hvdkit_world
            else {}
        )
        for old in self._hvdkit_groups:
            old.unwatch()
            for handle, _ in old.pending.values():  # sent before the change was seen
                hvd.synchronize(handle)
        self._hvdkit_world, self._hvdkit_signature = world, trainable
        every = [p for g in self.param_groups for p in g["params"]]
        like = every[0] if every else torch.zeros(())
        self._hvdkit_groups, self._hvdkit_owners = [], []
        for index, g in enumerate(self.param_groups):
            for cohort in _cohorts([p for p in g["params"] if p.requires_grad], carried):
                reuse = reusable.get(tuple(id(p) for p in cohort))
                stage2 = self._hvdkit_stage2 and world[0] > 1  # one rank: nothing to free
                self._hvdkit_groups.append(
                    _Group(cohort, *world, like=like, reuse=reuse, gradients=stage2)
                )
                self._hvdkit_owners.append(index)
        if world[0] > 1:
            for i, group in enumerate(self._hvdkit_groups):
                group.watch(
                    lambda: self.backward_passes_per_step,
                    self._hvdkit_compression,
                    self._hvdkit_op,
                    f"hvdkit.zero.grad.{i}",
                )
        groups = [
            {**{k: v for k, v in self.param_groups[i].items() if k != "params"},
             "params": list(s.chunks)}
            for i, s in zip(self._hvdkit_owners, self._hvdkit_groups, strict=True)
        ]  # fmt: skip
        # The user's optimizer as it was given (its settings, hooks, flags), over the shards:
        # no constructor call, whose arguments a class need not keep.
        inner: Any = object.__new__(type(self)._hvdkit_base)
        inner.__dict__.update(self._hvdkit_template)
        inner.param_groups, inner.state = groups, collections.defaultdict(dict)
        self._hvdkit_inner = inner
        if carried is not None:
            self._hvdkit_take_state(carried)

    def synchronize(self) -> None:
        """Reduce-scatter the gradients: each rank gets the average of its slice."""
        self._hvdkit_partition()
        assert self._hvdkit_inner is not None
        for group in self._hvdkit_groups:
            if hvd.size() == 1:  # nothing to reduce with, and nothing sent (as Horovod's)
                group.set_grad(group.mine(group.flat_grads()))
            else:
                group.set_grad(group.reduce())
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's: ``step()`` inside uses the reduction ``synchronize()`` did."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Reduce-scatter (unless ``synchronize()`` did), update this rank's slice with the
        groups' current hyperparameters, broadcast each rank's slice into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized:
            self.synchronize()
        inner = self._hvdkit_inner
        assert inner is not None
        for owner, mine in zip(self._hvdkit_owners, inner.param_groups, strict=True):
            mine.update({k: v for k, v in self.param_groups[owner].items() if k != "params"})
        inner.step()  # in place, into this rank's slice of the parameters
        self._hvdkit_loaded = None
        with torch.no_grad():
            for i, group in enumerate(self._hvdkit_groups):
                group.gather_params(f"hvdkit.zero.param.{i}")
        self._synchronized = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place: they live in one flat buffer per group, which
        autograd accumulates into (``set_to_none`` is not followed, as in DDP's
        ``gradient_as_bucket_view``); before the first step, torch's own."""
        if not self._hvdkit_groups:
            torch.optim.Optimizer.zero_grad(self, set_to_none)  # type: ignore[arg-type]
            return
        for group in self._hvdkit_groups:
            group.flat_grad.zero_()
            if group.stage2:  # its gradients live in p.grad until their buckets take them
                for p in group.params:
                    p.grad = None

    def unscale_grads_(self, scale: float) -> bool:
        """After ``synchronize()``, an AMP loss scale's: whether any rank's slice of the
        reduced gradient overflowed (agreed by an allreduce of one flag, so every rank skips
        the step or none does); if not, the slices are divided by ``scale``."""
        bad = torch.zeros(1)
        for group in self._hvdkit_groups:
            if group.grad is not None and not bool(torch.isfinite(group.grad).all()):
                bad.fill_(1.0)
        overflow = hvd.allreduce(bad, op=hvd.Max, name="hvdkit.zero.overflow").item() > 0
        if not overflow:
            for group in self._hvdkit_groups:
                if group.grad is not None:
                    group.grad.mul_(1.0 / scale)
        return bool(overflow)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After ``synchronize()``: ``torch.nn.utils.clip_grad_norm_`` of the whole reduced
        gradient, its norm summed over the slices (an allreduce of one number)."""
        squares = sum(
            (group.grad.float() ** 2).sum()
            for group in self._hvdkit_groups
            if group.grad is not None
        )
        total = hvd.allreduce(
            torch.as_tensor(squares, dtype=torch.float32), op=hvd.Sum, name="hvdkit.zero.norm"
        ).sqrt()
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in self._hvdkit_groups:
            if group.grad is not None:
                group.grad.mul_(scale.to(group.grad.dtype))
        return total

    def _hvdkit_full_state(self, root: int | None = None) -> dict[torch.Tensor, dict[str, Any]]:
        """Collective: every parameter's state, as a plain optimizer would hold it, in host
        memory: on every rank (``root`` None), or on ``root`` only (the others get the frozen
        parameters' state and the step counts, not the slices' tensors)."""
        inner = self._hvdkit_inner
        # Frozen parameters keep the state they had, as a plain optimizer's do.
        full: dict[torch.Tensor, dict[str, Any]] = dict(self._hvdkit_parked)
        if inner is None:
            return full
        for i, group in enumerate(self._hvdkit_groups):
            states = [inner.state.get(chunk, {}) for chunk in group.chunks]
            per_param: list[dict[str, Any]] = [{} for _ in group.params]
            for key in sorted(states[0]):
                value = group.joined([state[key] for state in states])
                if key != "step" and torch.is_tensor(value) and value.shape == group.shard.shape:
                    gathered = _gather(value, f"hvdkit.zero.state.{i}.{key}", root)
                    if gathered is None:
                        continue
                    for entry, piece in zip(per_param, group.unflat(gathered), strict=True):
                        entry[key] = piece.clone()
                else:
                    for entry in per_param:
                        entry[key] = copy.deepcopy(value)
            for param, entry in zip(group.params, per_param, strict=True):
                if entry:
                    full[param] = entry
        return full

    def _hvdkit_take_state(self, full: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Keep this rank's slice of ``full`` (every parameter's state) in the inner
        optimizer."""
        inner = self._hvdkit_inner
        assert inner is not None
        inner.state.clear()
        sliced = {id(p) for group in self._hvdkit_groups for p in group.params}
        self._hvdkit_parked = {p: entry for p, entry in full.items() if id(p) not in sliced}
        for group, owner in zip(self._hvdkit_groups, self._hvdkit_owners, strict=True):
            present = [full.get(p, {}) for p in group.params]
            keys = {k for entry in present for k in entry}
            if not keys:
                continue
            state: dict[str, Any] = {}
            for key in sorted(keys):
                values = [entry.get(key) for entry in present]
                sample = next(v for v in values if v is not None)
                if key != "step" and all(
                    v is None or (torch.is_tensor(v) and v.shape == p.shape)
                    for v, p in zip(values, group.params, strict=True)
                ):
                    state[key] = group.slice_of(values)
                elif key == "step":  # the same on every parameter; fused kernels' on the GPU
                    state[key] = step_like(copy.deepcopy(sample), group.shard,
                                           self.param_groups[owner])  # fmt: skip
                else:
                    state[key] = copy.deepcopy(sample)
            for chunk, at in zip(group.chunks, range(0, group.layout.shard, CHUNK), strict=True):
                inner.state[chunk] = {
                    k: v[at : at + chunk.numel()]  # views of the slice: no second copy
                    if torch.is_tensor(v) and v.shape == group.shard.shape and k != "step"
                    else copy.deepcopy(v)
                    for k, v in state.items()
                }

    def state_dict(self) -> dict[str, Any]:
        """Collective (every rank calls it): on rank 0, the state a plain optimizer of this
        class would have, in torch's format, in host memory, gathered one tensor at a time;
        independent of the world size. The other ranks get the param groups and the step
        counts, marked (:data:`ON_RANK_0`): a checkpoint is written on rank 0, and no GPU
        ever holds the whole state. Right after ``load_state_dict`` (no step since) it is the
        state loaded, and gathers nothing."""
        if self._hvdkit_loaded is not None:
            return self._hvdkit_loaded
        state = self._hvdkit_packed(self._hvdkit_full_state(root=0))
        if hvd.rank() != 0:
            state[ON_RANK_0] = True
        return state

    def _hvdkit_state_everywhere(self) -> dict[str, Any]:
        """Collective: the whole state (as :meth:`state_dict` gives rank 0) on every rank, in
        host memory: what an elastic commit keeps, since any rank may be the root after a
        reset."""
        if self._hvdkit_loaded is not None and ON_RANK_0 not in self._hvdkit_loaded:
            return self._hvdkit_loaded
        return self._hvdkit_packed(self._hvdkit_full_state())

    def _hvdkit_packed(self, full: dict[torch.Tensor, dict[str, Any]]) -> dict[str, Any]:
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: entry for p, entry in full.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A plain (or gathered) optimizer state: the groups' hyperparameters, and this
        rank's slice of the per-parameter state. Every rank must be given the same one."""
        if state_dict.get(ON_RANK_0):
            raise ValueError(
                "hvdkit: shard_optimizer=True: this state_dict() came from a rank other than "
                "0, which holds no gathered state (rank 0 does: a sharded optimizer gathers "
                "its state there only). Fix: load the state rank 0 saved, on every rank, or "
                "let hvdkit's session save and resume it"
            )
        plain = _Plain(self.param_groups)
        # Where the state is (the host, for a checkpoint): each rank moves its slice only.
        load_optimizer_state_(plain, state_dict, to_device=False)  # type: ignore[arg-type]
        self._hvdkit_loaded = state_dict
        self._synchronized = False  # a step cut short (an elastic reset) is not taken up
        self._hvdkit_inner = None  # rebuilt for the current world, then given the slice
        self._hvdkit_partition(dict(plain.state))


class _Plain:
    """Just what :func:`load_optimizer_state_` reads and writes of an optimizer."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.param_groups = param_groups
        self.state: dict[torch.Tensor, dict[str, Any]] = {}


_CLASSES: dict[type, type] = {}
_ELEMENTWISE: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                 "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, name)
)  # fmt: skip


def _cohorts(
    params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]] | None
) -> list[list[torch.Tensor]]:
    """A param group's trainable parameters split by how far their state is (its ``step``,
    or none yet), each part its own flat buffer: the inner optimizer keeps one step count a
    buffer, and a layer unfrozen mid-training starts its own at 0, as a plain optimizer's
    does. Usually one part (never none: an empty group keeps its padding slice)."""
    parts: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        entry = (state or {}).get(p) or {}
        step = entry.get("step")
        key = (bool(entry), None if step is None else float(step))
        parts.setdefault(key, []).append(p)
    return list(parts.values()) or [[]]


def _stepped(state: dict[str, Any]) -> bool:
    """Whether a parameter's state comes from a step, not from the constructor (Adagrad
    makes its sums, at step 0, when it is built)."""
    step = state.get("step")
    return bool(state) and (step is None or float(step) != 0)


def state_everywhere(optimizer: Any) -> dict[str, Any]:
    """Collective: a sharded optimizer's whole state on every rank, in host memory (what an
    elastic commit keeps: any rank may be the root after a reset)."""
    return optimizer._hvdkit_state_everywhere()


def declare_elementwise(cls: type) -> None:
    """Let ``shard_optimizer=True`` take an optimizer class (and its subclasses) whose update
    of each element reads only that element's parameter, gradient and state (and scalars),
    as Adam's does: then an update of flat slices is the update of the whole. torch's
    elementwise optimizers are known already; the others are refused, naming this."""
    global _ELEMENTWISE
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_elementwise({cls!r}): expected a torch.optim.Optimizer class")
    _ELEMENTWISE = (*_ELEMENTWISE, cls)


def ShardedOptimizer(  # noqa: N802 - a class built at run time, as DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    compression: Any = hvd.Compression.none,
    op: Any = hvd.Average,
    gradients: bool = False,
) -> torch.optim.Optimizer:
    """``optimizer`` (any ``torch.optim.Optimizer``, not yet stepped) with its state sharded
    across the ranks, ZeRO stage 1 (see the module's text); with ``gradients=True`` stage 2:
    the gradients too, each parameter's let go once its buckets hold it, so a rank keeps the
    reduced gradient of its slice only. It is still an instance of the optimizer's class,
    with the same param-group dicts, so an LR scheduler built on it goes on working;
    ``synchronize()``/``skip_synchronize()`` are Horovod's."""
    if not isinstance(optimizer, _ELEMENTWISE):
        name = type(optimizer).__qualname__
        raise ValueError(
            f"shard_optimizer=True: {name} is not known to update each element on its own, "
            "and ZeRO runs it on flat slices of the parameters: an update that reads a whole "
            "tensor (Adafactor's factored moments, LAMB's or LARS's trust ratio per layer, "
            "LBFGS) would silently compute something else. Fix: shard_optimizer=False; or, "
            f"if {name}'s update is elementwise, hvdkit.torch.zero.declare_elementwise({name}) "
            "before setup()"
        )
    if any(_stepped(state) for state in optimizer.state.values()):
        raise ValueError(
            "shard_optimizer=True: the optimizer has state already (it has stepped); "
            "give setup() a fresh optimizer and resume its state from a checkpoint"
        )
    for group in optimizer.param_groups:
        kinds = sorted({f"{p.dtype} on {p.device}" for p in group["params"]})
        if len(kinds) > 1:
            raise ValueError(
                f"shard_optimizer=True: a param group mixes {', '.join(kinds)}; put the "
                "parameters of each dtype and device in a param group of their own"
            )
    base = type(optimizer)
    if base not in _CLASSES:
        _CLASSES[base] = type(
            base.__name__, (_Sharded, base), {"__module__": base.__module__, "_hvdkit_base": base}
        )
    sharded: Any = object.__new__(_CLASSES[base])
    # Not the instance's own ``step``: an LR scheduler replaced it with a wrapper of the
    # plain optimizer's step (told apart below, as DistributedOptimizer does).
    own = {k: v for k, v in vars(optimizer).items() if k != "step"}
    sharded.__dict__.update(own)
    sharded._hvdkit_template = dict(own)
    sharded._hvdkit_inner = None
    sharded._hvdkit_loaded = None
    sharded._hvdkit_groups = []
    sharded._hvdkit_owners = []
    sharded._hvdkit_parked = {}
    sharded._hvdkit_world = (0, 0)
    sharded._hvdkit_signature = ()
    sharded._hvdkit_compression = compression
    sharded._hvdkit_op = op
    sharded._hvdkit_stage2 = bool(gradients)
    sharded._synchronized = False
    sharded._should_synchronize = True
    sharded._handles = {}
    sharded._allreduce_delay = {}
    sharded.backward_passes_per_step = 1
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        tell_schedulers(optimizer, sharded)
    if hvd.is_initialized():  # the buckets' hooks in place before the first backward pass
        sharded._hvdkit_partition()
    return sharded
