"""What both elastic modules (:mod:`hvdkit.torch.elastic`, :mod:`hvdkit.keras.elastic`) share:
the state object with per-type handlers, and the ``run`` decorator.

Horovod's elastic loop (``horovod.common.elastic.run_fn``) does the work: on a lost or added
worker every rank raises, restores the last ``commit()``, re-initialises Horovod and syncs the
state from rank 0. What hvdkit adds here: the handlers are hvdkit's own (so the broadcasts are
hvdkit's fixed ones), :mod:`hvdkit.rank_zero` learns the new rank after each reset (rank 0
may move), and each reset is reported on the new rank 0 with the new world size.
"""

from __future__ import annotations

import abc
import copy
import functools
import time
from collections.abc import Callable
from typing import Any, ClassVar

from horovod.common.elastic import ObjectState, run_fn

from hvdkit import rank_zero


class Handler(abc.ABC):
    """Keeps one framework object (a model, an optimizer...) committed: ``save`` copies its
    state to host memory, ``restore`` puts the copy back, ``sync`` makes every rank's equal
    to rank 0's."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    @abc.abstractmethod
    def save(self) -> None: ...

    @abc.abstractmethod
    def restore(self) -> None: ...

    @abc.abstractmethod
    def sync(self) -> None: ...


class StateDictHandler(Handler):
    """A handler for anything with ``state_dict()``/``load_state_dict()``; ``sync`` sends
    rank 0's state dict as an object (subclasses broadcast tensors instead)."""

    broadcast_object: ClassVar[Callable[[Any], Any]]

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(type(self).broadcast_object(self.value.state_dict()))


class ElasticState(ObjectState):
    """Horovod's ``ObjectState`` (plain values: epoch, batch...) plus one handler per
    framework object, chosen by type from ``HANDLERS``. Every keyword becomes an attribute;
    assigning a new object to a handled attribute re-commits it."""

    HANDLERS: ClassVar[list[tuple[type, type[Handler]]]] = []

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        handlers: dict[str, Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in self.HANDLERS if isinstance(value, t)), None)
            if kind is not None:
                handlers[name] = kind(value)
            else:
                plain[name] = value
        self.__dict__["_handlers"] = handlers
        for name, handler in handlers.items():
            self.__dict__[name] = handler.value
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None:
            handler.set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()


def make_run(
    hvd: Any, translate: Callable[[BaseException], BaseException | None] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Horovod's ``elastic.run`` decorator for the Horovod module ``hvd``, with hvdkit's reset
    (see the module docstring). ``translate`` turns a framework's own error for a failed
    Horovod op into the ``HorovodInternalError`` the loop recovers from (None: not one)."""

    def reset() -> None:
        started = time.monotonic()
        hvd.shutdown()
        hvd.init()
        rank_zero.set_rank(hvd.rank())
        rank_zero.print0(
            f"hvdkit elastic: reset to {hvd.size()} process(es) in "
            f"{time.monotonic() - started:.1f} s; restoring the last commit"
        )

    def run(func: Callable[..., Any]) -> Callable[..., Any]:
        def translated(state: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return func(state, *args, **kwargs)
            except Exception as error:
                internal = translate(error) if translate is not None else None
                if internal is None:
                    raise
                raise internal from error

        wrapped = run_fn(translated, reset)

        @functools.wraps(func)
        def start(state: Any, *args: Any, **kwargs: Any) -> Any:
            rank_zero.set_rank(hvd.rank())
            return wrapped(state, *args, **kwargs)

        return start

    return run
