"""Horovod's ``horovod.tensorflow.elastic`` on Keras 3: ``run``, ``TensorFlowKerasState``,
``TensorFlowState`` (and Horovod's ``ObjectState``, ``broadcast_object``...).

    import hvdkit.tensorflow as hvd
    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)

    @hvd.elastic.run
    def train(state): ...

Horovod's ``TensorFlowKerasState`` fails on Keras 3 at its first commit
(``optimizer.variables()``: a list property now). Here it is ``hvdkit.keras``'s elastic state
(commit in host memory, restore, sync from rank 0), so it shares that one's differences
(``hvdkit.keras.elastic``): the optimizer is built when the state is made, so a worker that
joins before its first step has the survivors' variables to receive. ``run`` is hvdkit's loop
on Horovod's: every reset is reported on the new rank 0, and a failed Horovod op in any
TensorFlow error (grouped allreduces too) counts as a lost peer.

A ``tf.function`` traced before a reset keeps the Python values it read then (``hvd.size()``
included), as in Horovod: read the world size outside it, or rescale in a reset callback, as
the examples do with the learning rate.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow import broadcast_object, broadcast_object_fn, init, rank, shutdown

from hvdkit.elastic import ElasticState, Handler
from hvdkit.keras.elastic import KerasState, run
from hvdkit.tensorflow.collectives import broadcast_variables


class TensorFlowKerasState(KerasState):
    """Horovod's ``TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)``: a
    built Keras 3 model's and its optimizer's variables, and the plain values in ``kwargs``.
    ``backend`` (Keras 2's backend module, for TF1 sessions) has no use on Keras 3."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        super().__init__(model, optimizer, **kwargs)


class _VariableList(list[Any]):
    """The ``variables`` of a :class:`TensorFlowState`, told apart from a plain list value."""


class VariableListHandler(Handler):
    """Keeps a list of ``tf.Variable``s (or Keras 3 variables) committed: numpy copies in host
    memory, assigned back on restore, broadcast from rank 0 on sync."""

    def save(self) -> None:
        self.saved = [np.array(v.numpy()) for v in self.value]

    def restore(self) -> None:
        for variable, value in zip(self.value, self.saved, strict=True):
            variable.assign(value)

    def sync(self) -> None:
        broadcast_variables(list(self.value), root_rank=0)
        self.save()


class TensorFlowState(ElasticState):
    """Horovod's ``TensorFlowState(variables=None, session=None, **kwargs)``: ``variables``
    (``tf.Variable``s or Keras 3 variables, e.g. a ``tf.Module``'s ``variables``) and the
    plain values in ``kwargs``. TF1 graph sessions are not served: ``variables`` is required
    (Horovod's default, ``tf.compat.v1.global_variables()``, is empty in TensorFlow 2)."""

    HANDLERS: ClassVar[list[tuple[type, type[Handler]]]] = [(_VariableList, VariableListHandler)]

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError(
                "TensorFlowState(session=...): TF1 graph sessions are not served by "
                "hvdkit.tensorflow (TensorFlow 2 runs eagerly). Fix: drop session= and pass "
                "the variables, TensorFlowState(variables=model.variables, ...)"
            )
        if variables is None:
            raise ValueError(
                "TensorFlowState: give the variables to keep, e.g. "
                "TensorFlowState(variables=model.variables + opt.variables, batch=0) (TensorFlow 2 "
                "has no global variable collection)"
            )
        super().__init__(
            bcast_object=broadcast_object, get_rank=rank, variables=_VariableList(variables),
            **kwargs,
        )  # fmt: skip


__all__ = [
    "HorovodInternalError",
    "ObjectState",
    "TensorFlowKerasState",
    "TensorFlowState",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "init",
    "rank",
    "run",
    "run_fn",
    "shutdown",
]
