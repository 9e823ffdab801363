"""Horovod's ``DistributedOptimizer`` made to work with today's PyTorch, and the one pattern
for AMP and gradient clipping."""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import torch

from hvdkit.profile import recorder as profile_recorder
from hvdkit.torch.bf16 import install as install_bf16
from hvdkit.torch.bf16 import is_bf16


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    # Horovod 0.28.1's zero_grad(self) predates the set_to_none argument (TypeError when
    # given); the race check it does is kept.
    if getattr(self, "_handles", None):
        raise AssertionError(
            "optimizer.zero_grad() was called after loss.backward() but before "
            "optimizer.step() or optimizer.synchronize(): gradients are still being reduced"
        )
    torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)


class _ContiguousCompression:
    """Wraps a Horovod compressor so that what reaches allreduce is contiguous: gradients of
    channels_last weights are not, and Horovod refuses them ("Tensor is required to be
    contiguous")."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compressed, ctx = self.inner.compress(tensor)
        return compressed.contiguous(), ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(tensor, ctx)


def _require_materialized(optimizer: torch.optim.Optimizer) -> None:
    """Lazy modules (``torch.nn.LazyLinear``, ...) have no parameters until their first forward
    pass; Horovod fails on them deep inside (``Attempted to use an uninitialized parameter``)."""
    from torch.nn.parameter import is_lazy

    if any(is_lazy(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer holds uninitialized parameters of a lazy module (e.g. "
            "torch.nn.LazyLinear): their shapes are only known after a forward pass, so they "
            "cannot be broadcast or reduced yet. Fix: run one forward pass with a batch of the "
            "real input shape before wrapping the optimizer / hvdkit.torch.setup (as "
            "DistributedDataParallel requires too), then build the optimizer."
        )


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = hvd.Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = hvd.global_process_set,
) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer`` (same parameters, same order) with
    ``zero_grad(set_to_none=...)`` and channels_last gradients working.

    Example::

        optimizer = hvdkit.torch.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters())
    """
    _require_materialized(optimizer)
    bf16 = is_bf16(compression)
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        compression=_ContiguousCompression(hvd.Compression.none if bf16 else compression),
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set,
    )
    if bf16:
        install_bf16(wrapped)
    # Horovod builds its optimizer with the class's defaults (SGD's momentum 0), and
    # add_param_group fills a new group from them: the user's are the ones to fill it with.
    wrapped.defaults = dict(optimizer.defaults)
    _follow_trainable(wrapped)
    wrapped.zero_grad = types.MethodType(_zero_grad, wrapped)
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        tell_schedulers(optimizer, wrapped)
    recorder = profile_recorder.get()
    if recorder is not None:
        _profile(wrapped, recorder)
    return wrapped


def _follow_trainable(wrapped: Any) -> None:
    """Horovod reduces the parameters that were trainable when it was built: one unfrozen
    later (fine-tuning's second phase) or added by ``add_param_group`` would step on each
    rank's own gradient, and the ranks drift apart without a word. Here each ``synchronize``
    first takes in every parameter that is trainable now (reduced as Horovod reduces one its
    hook missed), and an added group's parameters are named."""
    synchronize, add_param_group = wrapped.synchronize, wrapped.add_param_group
    # Where Horovod reduces (several ranks, or elastic: it sends nothing at one rank
    # otherwise), one by one (its grouped allreduces stay as built).
    follows = (hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1") and getattr(
        wrapped, "_groups", None
    ) is None

    def following_synchronize(*args: Any, **kwargs: Any) -> Any:
        if follows:
            wrapped._requires_update.update(
                p for g in wrapped.param_groups for p in g["params"] if p.requires_grad
            )
        return synchronize(*args, **kwargs)

    def naming_add_param_group(group: dict[str, Any]) -> None:
        add_param_group(group)
        for p in wrapped.param_groups[-1]["params"]:
            if p not in wrapped._parameter_names:
                wrapped._parameter_names[p] = f"hvdkit.added.{len(wrapped._parameter_names)}"
                wrapped._allreduce_delay[p] = wrapped.backward_passes_per_step

    wrapped.synchronize = following_synchronize
    wrapped.add_param_group = naming_add_param_group


def _profile(wrapped: Any, recorder: profile_recorder.Recorder) -> None:
    """Under ``hvdkit run --profile``: the wait in ``synchronize`` is ``communication`` (also
    when ``step`` calls it), the rest of ``step`` is ``optimizer``, and a step ends with
    ``step``: what a Horovod script does, so its steps are profiled with no change."""
    synchronize, step = wrapped.synchronize, wrapped.step

    def timed_synchronize(*args: Any, **kwargs: Any) -> Any:
        with recorder.phase("communication"):
            return synchronize(*args, **kwargs)

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        with recorder.phase("optimizer"):
            result = step(*args, **kwargs)
        recorder.step_done()
        return result

    wrapped.synchronize = timed_synchronize
    wrapped.step = timed_step


def tell_schedulers(optimizer: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
    """An LR scheduler made on ``optimizer`` before it was wrapped checks, at its first step,
    that ``optimizer`` stepped (torch's wrapper of ``optimizer.step`` sets ``_opt_called``);
    the steps go through ``wrapped`` now, so they set it too. Otherwise torch warns "Detected
    call of `lr_scheduler.step()` before `optimizer.step()`" on every rank."""
    step = wrapped.step

    def marking_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapped.step = types.MethodType(marking_step, wrapped)  # type: ignore[method-assign]


def reset_pending(optimizer: Any) -> None:
    """Forget the reductions of an unfinished step, as Horovod's ``load_state_dict`` does
    (for state loaded without it, :func:`hvdkit.torch.functions.load_optimizer_state_`): an
    elastic restore drops a step whose allreduces will never complete."""
    optimizer._handles = {}
    optimizer._synchronized = False
    optimizer._should_synchronize = True
    for p in optimizer._allreduce_delay:
        optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step


def _accumulating(optimizer: Any) -> bool:
    """After a backward pass: whether Horovod's optimizer is still accumulating passes
    (``backward_passes_per_step``): its hooks have counted the pass but started no
    allreduce yet."""
    if getattr(optimizer, "backward_passes_per_step", 1) <= 1:
        return False
    handles = getattr(optimizer, "_handles", {})
    return bool(handles) and all(handle is None for handle, _ in handles.values())


def step_or_accumulate(
    loss: torch.Tensor,
    optimizer: Any,
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
    parameters: Iterable[torch.Tensor] | None = None,
    accumulate: bool | None = None,
) -> tuple[bool, torch.Tensor | None]:
    """:func:`backward_and_step`, saying whether the optimizer stepped: ``(False, None)``
    after a backward pass that only accumulated (``backward_passes_per_step``). Whether this
    pass is one of those is ``accumulate`` when the caller counts the passes (the session
    does), else what Horovod's hooks counted (they are not there at size 1)."""
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if accumulate if accumulate is not None else _accumulating(optimizer):
        return False, None
    return True, reduce_and_step(
        optimizer, scaler=scaler, clip_grad_norm=clip_grad_norm, parameters=parameters
    )


def _all_parameters(optimizer: Any, parameters: list[torch.Tensor] | None) -> bool:
    """Whether ``parameters`` (None: all) are the optimizer's, every one."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return parameters is None or {id(p) for p in parameters} >= mine


def _reduce_and_step_sharded(
    optimizer: Any,
    scaler: torch.amp.GradScaler | None,
    clip_grad_norm: float | None,
    parameters: list[torch.Tensor] | None,
) -> torch.Tensor | None:
    """:func:`reduce_and_step` for ZeRO's optimizer (:mod:`hvdkit.torch.zero`): each rank
    holds only its slice of the reduced gradient, so the scaler's overflow check and the
    clipping norm are agreed over the ranks, and the scaler's step skipped on all or none."""
    if not _all_parameters(optimizer, parameters):
        raise ValueError(
            "shard_optimizer=True: clipping a subset of the parameters is not supported (each "
            "rank holds its slice of the reduced gradient). Fix: clip_grad_norm over all of "
            "them, or shard_optimizer=False"
        )
    optimizer.synchronize()
    scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
    overflow = scale is not None and optimizer.unscale_grads_(scale)
    norm = None
    if clip_grad_norm is not None:
        norm = torch.tensor(float("inf")) if overflow else optimizer.clip_grad_norm_(clip_grad_norm)
    if not overflow:
        with optimizer.skip_synchronize():
            optimizer.step()
    if scaler is not None and scale is not None:
        _update_scaler(scaler, overflow)
    return norm


def _update_scaler(scaler: torch.amp.GradScaler, overflow: bool) -> None:
    """GradScaler's ``update()`` after a step it did not see (the overflow check was the
    ranks'): back off after an overflow, grow after ``growth_interval`` clean steps. Through
    its state dict, its public face."""
    state = scaler.state_dict()
    if overflow:
        state["scale"] *= state["backoff_factor"]
        state["_growth_tracker"] = 0
    else:
        state["_growth_tracker"] += 1
        if state["_growth_tracker"] >= state["growth_interval"]:
            state["scale"] *= state["growth_factor"]
            state["_growth_tracker"] = 0
    scaler.load_state_dict(state)


def reduce_and_step(
    optimizer: Any,
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
    parameters: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Reduce what the backward passes so far left (all of them, even fewer than
    ``backward_passes_per_step``), (unscale, clip,) step; the gradient norm when clipping."""
    if parameters is not None:
        parameters = list(parameters)
    if getattr(optimizer, "sharded", False):
        return _reduce_and_step_sharded(optimizer, scaler, clip_grad_norm, parameters)
    optimizer.synchronize()
    norm = None
    if clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = (
            list(parameters)
            if parameters is not None
            else [p for g in optimizer.param_groups for p in g["params"]]
        )
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    with optimizer.skip_synchronize():
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return norm


def backward_and_step(
    loss: torch.Tensor,
    optimizer: Any,  # Horovod's DistributedOptimizer: a torch.optim.Optimizer built at run time
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
    parameters: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Backward, reduce, (unscale, clip,) step: the one order that is right with Horovod.

    Gradients must be averaged across ranks *before* they are unscaled and clipped, and the
    step must not reduce them again. Returns the total gradient norm when clipping.

    With ``backward_passes_per_step=N`` (Horovod's accumulation) a call only runs the
    backward pass until the N-th, which reduces the gradients summed over the N passes and
    steps (do not zero the gradients in between; :func:`hvdkit.torch.setup`'s session skips
    ``zero_grad()`` there for you).

    Example::

        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        backward_and_step(loss, optimizer, scaler=scaler, clip_grad_norm=1.0)
    """
    _, norm = step_or_accumulate(
        loss, optimizer, scaler=scaler, clip_grad_norm=clip_grad_norm, parameters=parameters
    )
    return norm
