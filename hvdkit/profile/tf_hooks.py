"""``hvdkit run --profile`` in TensorFlow custom loops (``hvdkit.tensorflow``'s tapes), scripts
written for Horovod included, with no change to them.

- A ``tf.data`` iterator's ``next`` is ``data``.
- An **eager** step: the tape's allreduce is ``communication`` (:mod:`hvdkit.keras.optimizer`
  times it), the optimizer's update is ``optimizer``, and a step ends with the update, any Keras
  optimizer's (a Horovod script's tape steps a plain one).
- A **compiled** step (the ``tf.function`` that traced a ``DistributedGradientTape``): each call
  of it is one step, timed whole (``compiled``, its time ``unsplit``), since inside the graph
  nothing runs in Python per step. The time between calls stays apart: the batches' ``data``
  and the script's ``other``.

Installed only when profiling, by :func:`hvdkit.profile.recorder.get`, if TensorFlow is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Timed(Protocol):
    """What the hooks need of :class:`hvdkit.profile.recorder.Recorder` (which imports this
    module: the dependency runs one way)."""

    compiled: bool

    def phase(self, name: str) -> AbstractContextManager[Any]: ...

    def within(self, name: str) -> bool: ...

    def step_done(self) -> None: ...


_traced = [0]  # DistributedGradientTape.gradient calls traced into a graph, in this process


def tape_traced() -> None:
    """Called by the tape when its ``gradient`` is traced into a graph: the ``tf.function``
    being called is a training step."""
    _traced[0] += 1


def install(recorder: Timed) -> Callable[[], None]:
    """Time ``tf.data`` iterators, Keras optimizers' updates and compiled tape steps into
    ``recorder``; returns the undo."""
    import tensorflow as tf
    from keras.src.optimizers import base_optimizer
    from tensorflow.python.data.ops import iterator_ops
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    iterator = iterator_ops.OwnedIterator
    function = polymorphic_function.Function
    optimizer = base_optimizer.BaseOptimizer
    plain_next, plain_call, plain_apply = iterator.__next__, function.__call__, optimizer.apply

    def timed_next(self: Any) -> Any:
        with recorder.phase("data"):
            return plain_next(self)

    def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_hvdkit_step", False) and tf.executing_eagerly():
            recorder.compiled = True
            with recorder.phase("unsplit"):  # inside the graph: no clock splits it
                out = plain_call(self, *args, **kwargs)
            recorder.step_done()
            return out
        before = _traced[0]
        out = plain_call(self, *args, **kwargs)
        if _traced[0] != before and tf.executing_eagerly():
            self._hvdkit_step = True  # traced a tape's gradient: a step from its next call
        return out

    def timed_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not tf.executing_eagerly() or recorder.within("optimizer"):
            return plain_apply(self, *args, **kwargs)  # traced, or hvdkit's optimizer's update
        with recorder.phase("optimizer"):
            out = plain_apply(self, *args, **kwargs)
        recorder.step_done()
        return out

    iterator.__next__ = timed_next
    function.__call__ = timed_call
    optimizer.apply = timed_apply

    def undo() -> None:
        iterator.__next__ = plain_next
        function.__call__ = plain_call
        optimizer.apply = plain_apply

    return undo
