"""``hvdkit run --profile`` in Keras's ``fit`` (:mod:`hvdkit.profile`).

Where the step runs eagerly (the torch backend, or ``run_eagerly=True``), the distributed
optimizer's allreduce is ``communication`` and its update ``optimizer``, and a step ends with
the update; :class:`ProfileCallback` (added by :func:`hvdkit.keras.setup`) makes the gap
between batches ``data``, which is when the torch backend fetches the next one. A compiled
TensorFlow step runs all of it inside one graph: there only the step's time is known, and the
record says so (``compiled``, the time ``unsplit``) rather than calling all of it compute; what
hvdkit's ``PyDataset`` wrapper spent loading batches meanwhile (:func:`loading`) is ``data``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import keras

from hvdkit.profile import recorder as profile_recorder


def eager() -> bool:
    """Whether the Python running now runs at each step (not once, while tracing a graph)."""
    if keras.backend.backend() == "torch":
        return True
    import tensorflow as tf

    return bool(tf.executing_eagerly())


def phase(name: str) -> Any:
    """A ``name`` phase under ``--profile`` in an eager step; nothing otherwise."""
    recorder = profile_recorder.get()
    return recorder.phase(name) if recorder is not None and eager() else nullcontext()


@contextmanager
def update() -> Iterator[None]:
    """The optimizer's update: a step ends with it (eager steps under ``--profile``)."""
    recorder = profile_recorder.get()
    if recorder is None or not eager():
        yield
        return
    with recorder.phase("optimizer"):
        yield
    recorder.step_done()


class ProfileCallback(keras.callbacks.Callback):
    """The gap between batches is ``data`` (eager steps); a compiled step, from its batch's
    begin to its end, is ``unsplit`` (less its input wrapper's loading: ``data``). Validation
    and the epoch's end (the other callbacks': put first, this one's ``on_epoch_end`` runs
    before theirs), and what Keras does between the epoch's last batch and them, are apart
    from the steps, until the next batch."""

    def __init__(self, recorder: profile_recorder.Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._open: str | None = None  # the phase this callback opened, if any

    def _eager_steps(self) -> bool:
        return keras.backend.backend() == "torch" or bool(getattr(self.model, "run_eagerly", 0))

    def _switch(self, phase: str | None) -> None:
        if self._open is not None:
            self.recorder.exit()
        self._open = phase
        if phase is not None:
            self.recorder.enter(phase)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.recorder.start()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # Until the first batch begins, Keras sets the epoch up: eager, it also fetches that
        # batch (data); compiled, the step fetches it, so this is set-up alone (on TensorFlow
        # the PyDataset's enqueuer restarts: up to 1.1 s seen, which had landed in the step
        # as compute), time between steps.
        self._switch("data" if self._eager_steps() else "epoch end")

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._switch(None if self._eager_steps() else "unsplit")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._eager_steps():
            self._switch(None)
            self.recorder.compiled = True
            self.recorder.step_done()
            return
        self._switch("data")

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._switch("validation")
        self.recorder.reclaim("validation")  # its set-up since the last batch, too

    def on_test_end(self, logs: dict | None = None) -> None:
        self._switch("epoch end")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._switch("epoch end")
        self.recorder.reclaim("epoch end")  # since the last batch, when no validation ran

    def on_train_end(self, logs: dict | None = None) -> None:
        self._switch(None)


@contextmanager
def loading() -> Iterator[None]:
    """An input wrapper's load of one batch (in whichever thread Keras loads it)."""
    recorder = profile_recorder.get()
    if recorder is None:
        yield
        return
    recorder.loading(True)
    try:
        yield
    finally:
        recorder.loading(False)
