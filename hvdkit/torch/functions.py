"""State broadcasts that work on today's PyTorch: non-contiguous tensors (channels_last) and
fresh optimizers (no spurious step, so AdamW does not decay the weights once at start); and
``init``, which first checks that a launcher started the process."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import horovod.torch as hvd
import torch

from hvdkit import hang
from hvdkit.launch import direct


def init(*args: Any, **kwargs: Any) -> None:
    """Horovod's ``init(comm=None, process_sets=None)``. First, a process that ``srun`` or a
    bare ``mpirun`` started without a launcher Horovod can join stops with the fix, rather
    than train alone as rank 0 of 1 (:mod:`hvdkit.launch.direct`)."""
    direct.check(bool(hvd.mpi_built()))
    hang.install()  # under hvdkit run: this rank answers the hang doctor
    hvd.init(*args, **kwargs)


class InvalidParamsError(TypeError, ValueError):
    """``params`` of a kind ``broadcast_parameters`` cannot take. Horovod raises ``ValueError``
    here; hvdkit raised ``TypeError``: this is both, so either ``except`` catches it."""


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the order every rank broadcasts them.

    As Horovod: a ``state_dict()`` (sorted by name), or a list of ``(name, tensor)`` pairs
    (``named_parameters()``) and/or bare tensors (``parameters()``), which keeps its order.
    Beyond Horovod: any iterable (a ``named_parameters()`` generator without ``list()``)."""
    if isinstance(params, Mapping):
        tensors = [(k, v) for k, v in params.items() if torch.is_tensor(v)]
        return sorted(tensors, key=lambda kv: kv[0])
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise InvalidParamsError(
            f"invalid params of type {type(params).__name__}: expected a state_dict(), "
            "named_parameters() or parameters()"
        )
    named = []
    for index, item in enumerate(params):
        if isinstance(item, tuple) and len(item) == 2:
            name, tensor = item
        elif torch.is_tensor(item):
            # An unnamed tensor (parameters()): named by its place in the list, the same on
            # every rank, as Horovod's automatic names are.
            name, tensor = f"#{index}", item
        else:
            raise InvalidParamsError(
                f"params[{index}] is a {type(item).__name__}: expected a tensor or a "
                "(name, tensor) pair"
            )
        if torch.is_tensor(tensor):
            named.append((str(name), tensor))
    return named


def broadcast_tensors_(named: list[tuple[str, torch.Tensor]], root_rank: int, prefix: str) -> None:
    """Broadcast each tensor in place from ``root_rank``. Horovod needs contiguous buffers, so
    a non-contiguous one (channels_last) goes through a contiguous copy and back."""
    pending = []
    for name, tensor in named:
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        handle = hvd.broadcast_async_(buffer, root_rank, name=f"{prefix}.{name}")
        pending.append((tensor, buffer, handle))
    for tensor, buffer, handle in pending:
        hvd.synchronize(handle)
        if buffer is not tensor:
            with torch.no_grad():
                tensor.copy_(buffer)


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Horovod's ``broadcast_parameters``: a ``state_dict()`` or ``named_parameters()`` from
    ``root_rank`` to every rank, in place; channels_last tensors included."""
    broadcast_tensors_(_named_tensors(params), root_rank, "hvdkit.param")


def _state_skeleton(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The optimizer state with each tensor replaced by (shape, dtype): what the other ranks
    need to allocate buffers for the broadcast."""
    return {
        pid: {
            k: ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."), v.is_cpu)
            if torch.is_tensor(v)
            else ("value", v)
            for k, v in entries.items()
        }
        for pid, entries in state.items()
    }


def _from_skeleton(
    skeleton: dict[int, dict[str, Any]], tensor_for: Any
) -> tuple[dict[int, dict[str, Any]], list[tuple[str, torch.Tensor]]]:
    """The state a :func:`_state_skeleton` describes: its values as they are, each tensor
    ``tensor_for(pid, key, shape, dtype, on_cpu)``; and those tensors, named, in order."""
    state: dict[int, dict[str, Any]] = {}
    named: list[tuple[str, torch.Tensor]] = []
    for pid, entries in skeleton.items():
        state[pid] = {}
        for key, (kind, *rest) in entries.items():
            if kind == "value":
                state[pid][key] = rest[0]
                continue
            state[pid][key] = tensor_for(pid, key, *rest)
            named.append((f"{pid}.{key}", state[pid][key]))
    return state, named


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, model: torch.nn.Module | None = None
) -> None:
    """Horovod's ``broadcast_optimizer_state`` without its side effect: Horovod runs a
    zero-gradient ``step()`` to create state on a fresh optimizer, which makes AdamW apply
    weight decay once. Here the hyperparameters and whatever state rank 0 has are copied;
    nothing steps.

    What Horovod's step leaves behind is kept: on a fresh optimizer (no state on this rank)
    each trainable parameter without a gradient gets a zero one, sparse where Horovod makes it
    sparse: every parameter under ``SparseAdam``, and under ``SGD`` the parameters of
    ``model``'s ``Embedding(sparse=True)`` modules (what ``model`` is for, in Horovod too), so
    that later sparse gradients accumulate onto a sparse tensor.

    Beyond Horovod: ``torch.optim.LBFGS`` state is broadcast too (Horovod refuses it), its
    nested lists going as pickled objects; channels_last state tensors are fine."""
    sd = optimizer.state_dict()
    if not sd["state"]:
        # Horovod leaves zero gradients on a fresh optimizer's trainable parameters (from its
        # state-creating step); scripts read them (Horovod's own test_broadcast_state_no_grad
        # broadcasts one), so they are there too, without the step.
        sparse_ids = set()
        if model is not None:
            sparse_ids = {
                id(p)
                for m in model.modules()
                if isinstance(m, torch.nn.Embedding) and m.sparse
                for p in m.parameters()
            }
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_ids
                    ):
                        grad = grad.to_sparse()
                    p.grad = grad
    skeleton = hvd.broadcast_object(
        {"param_groups": sd["param_groups"], "state": _state_skeleton(sd["state"])},
        root_rank,
        name="hvdkit.optim.skeleton",
    )
    device_of = {
        pid: p.device
        for pid, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }

    def tensor_for(pid: int, key: str, shape: tuple, dtype: str, on_cpu: bool) -> torch.Tensor:
        if hvd.rank() == root_rank:
            return sd["state"][pid][key]
        # Adam's "step" lives on the CPU even for CUDA parameters.
        device = torch.device("cpu") if on_cpu else device_of[pid]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=device)

    state, named = _from_skeleton(skeleton["state"], tensor_for)
    broadcast_tensors_(named, root_rank, "hvdkit.optim")
    if hvd.rank() != root_rank:
        load_optimizer_state_(optimizer, {"param_groups": skeleton["param_groups"], "state": state})


PIECE = 1 << 27
"""Elements one broadcast of a state tensor carries at most (512 MiB of float32): MPI counts in
32-bit ints."""


def broadcast_state_dict(
    state_dict: dict[str, Any] | None, root_rank: int, name: str
) -> dict[str, Any] | None:
    """``root_rank``'s optimizer ``state_dict`` (or None) on every rank, in host memory: its
    structure as one small object, then each tensor by itself. Horovod's ``broadcast_object``
    sends one pickle whose size is a 32-bit int, so a state above 2 GiB fails on the root
    while the others wait, and below it the root holds several copies at once."""
    mine = hvd.rank() == root_rank
    skeleton = hvd.broadcast_object(
        {**state_dict, "state": _state_skeleton(state_dict["state"])}
        if mine and state_dict is not None
        else None,
        root_rank,
        name=f"{name}.skeleton",
    )
    if skeleton is None:
        return None

    def tensor_for(pid: int, key: str, shape: tuple, dtype: str, _on_cpu: bool) -> torch.Tensor:
        if mine:
            assert state_dict is not None
            return state_dict["state"][pid][key].detach().to("cpu").contiguous()
        return torch.empty(shape, dtype=getattr(torch, dtype))

    state, named = _from_skeleton(skeleton["state"], tensor_for)
    for label, tensor in named:  # one at a time, in pieces MPI can count
        flat = tensor.view(-1)
        for at in range(0, flat.numel(), PIECE):
            hvd.broadcast_(flat[at : at + PIECE], root_rank, name=f"{name}.{label}.{at}")
    return {**skeleton, "state": state}


def load_optimizer_state_(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], to_device: bool = True
) -> None:
    """``optimizer.load_state_dict`` that keeps the existing param-group dicts. torch's
    version replaces them, which silently detaches an LR scheduler built on the optimizer:
    it goes on setting the LR of groups nothing uses any more. ``to_device=False`` keeps the
    state's tensors where they are (a sharded optimizer moves only its slice)."""
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"optimizer state has param groups of sizes {saved_sizes}, this optimizer {sizes}"
        )
    params = {
        pid: (p, group)
        for saved, group in zip(saved_groups, groups, strict=True)
        for pid, p in zip(saved["params"], group["params"], strict=True)
    }
    for group, saved in zip(groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    for pid, entries in state_dict["state"].items():
        param, group = params[int(pid)]
        optimizer.state[param] = {
            key: value if not to_device
            else _like_param(value, param) if key != "step"
            else step_like(value, param, group)
            for key, value in entries.items()
        }  # fmt: skip


def _like_param(value: Any, param: torch.Tensor) -> Any:
    if not torch.is_tensor(value):
        return value
    dtype = param.dtype if value.is_floating_point() else value.dtype
    return value.to(device=param.device, dtype=dtype)


def step_like(value: Any, param: torch.Tensor, group: dict[str, Any]) -> Any:
    """A step count where torch keeps it: on the CPU, except under ``capturable`` or ``fused``
    (Adam, AdamW, ...), whose kernels read it on the parameter's device, as float32 (torch's
    own ``load_state_dict`` rule). A checkpoint is read onto the CPU."""
    if torch.is_tensor(value) and (group.get("capturable") or group.get("fused")):
        return value.to(device=param.device, dtype=torch.float32)
    return value
