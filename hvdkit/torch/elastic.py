"""Horovod's elastic API for PyTorch (``horovod.torch.elastic``): ``run``, ``TorchState``,
``ElasticSampler``, with hvdkit's fixes.

    import hvdkit.torch as hvd       # was: import horovod.torch as hvd
    from hvdkit.torch import elastic  # was: hvd.elastic

What differs from Horovod's ``TorchState``: the model and the optimizer are synced with
hvdkit's broadcasts (channels_last parameters; no spurious zero-gradient optimizer step,
which Horovod's takes when it syncs an optimizer that has no state yet); an LR scheduler given
as a keyword is committed, restored and synced too (Horovod treats it as a plain object, so a
restore left its step count ahead of the restored optimizer). The rank seen by
:mod:`hvdkit.rank_zero` follows each reset.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import horovod.torch as _hvd
import torch
from horovod.torch.elastic import ElasticSampler

from hvdkit.elastic import ElasticState, Handler, StateDictHandler, make_run
from hvdkit.torch.functions import (
    broadcast_optimizer_state,
    broadcast_parameters,
    load_optimizer_state_,
)
from hvdkit.torch.optimizer import reset_pending


class _ObjectHandler(StateDictHandler):
    broadcast_object = staticmethod(_hvd.broadcast_object)


class ModelHandler(_ObjectHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerHandler(_ObjectHandler):
    def restore(self) -> None:
        # Into the existing param groups, which an LR scheduler drives (torch's
        # load_state_dict replaces them, and the scheduler is left setting an unused LR).
        load_optimizer_state_(self.value, copy.deepcopy(self.saved))
        if hasattr(self.value, "_allreduce_delay"):  # Horovod's: drop the failed step's
            reset_pending(self.value)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class TorchState(ElasticState):
    """Horovod's ``TorchState(model=None, optimizer=None, **kwargs)``: the state a worker
    commits and every rank restores after a reset. Models, optimizers, LR schedulers and
    :class:`ElasticSampler` keywords get handlers; anything else is a plain value."""

    HANDLERS: ClassVar[list[tuple[type, type[Handler]]]] = [
        (torch.nn.Module, ModelHandler),
        (torch.optim.Optimizer, OptimizerHandler),
        (torch.optim.lr_scheduler.LRScheduler, _ObjectHandler),
        (ElasticSampler, _ObjectHandler),
    ]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(
            bcast_object=_hvd.broadcast_object,
            get_rank=_hvd.rank,
            model=model,
            optimizer=optimizer,
            **kwargs,
        )


run = make_run(_hvd)
run.__doc__ = """``@hvdkit.torch.elastic.run`` on ``train(state, ...)``: Horovod's elastic
loop. On a lost or added worker, every rank restores ``state``'s last commit, Horovod is
re-initialised at the new size, and ``train`` runs again from the synced state."""

__all__ = ["ElasticSampler", "TorchState", "run"]
