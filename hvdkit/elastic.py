"""What both elastic modules (:mod:`hvdkit.torch.elastic`, :mod:`hvdkit.keras.elastic`) share:
the state object with per-type handlers, and the ``run`` decorator.

Horovod's elastic loop (``horovod.common.elastic.run_fn``) does the work: on a lost or added
worker every rank raises, restores the last ``commit()``, re-initialises Horovod and syncs the
state from rank 0. What hvdkit adds here: the handlers are hvdkit's own (so the broadcasts are
hvdkit's fixed ones), :mod:`hvdkit.rank_zero` learns the new rank after each reset (rank 0
may move), and each reset is reported on the new rank 0 with the new world size.

:class:`SessionElastic` is the second template method over an adapter's hooks, beside
:meth:`hvdkit.core.Adapter.setup`: it calls the ``_``-prefixed hooks (``_snapshot``,
``_position``, ``_resume``...) from outside the class. STYLE.md's template methods keep the
hooks behind one public method of the base class; here the elastic half lives in its own module
instead, so that ``core`` stays small and imports nothing of Horovod's elastic machinery. The
hooks stay package-private: user code reaches them only through ``setup(..., elastic=True)``.
"""

from __future__ import annotations

import abc
import copy
import functools
import time
from collections.abc import Callable
from typing import Any, ClassVar

from horovod.common.elastic import ObjectState, State, run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvdkit import elastic_restart, rank_zero
from hvdkit.core import restart
from hvdkit.profile import recorder as profile_recorder


class Handler(abc.ABC):
    """Keeps one framework object (a model, an optimizer...) committed: ``save`` copies its
    state to host memory, ``restore`` puts the copy back, ``sync`` makes every rank's equal
    to rank 0's."""

    saved: Any  # the last commit, set by save()

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

    def committed(self) -> dict[str, Any]:
        """The last commit, picklable: what a restarted worker loads back."""
        return {
            "handlers": {name: h.saved for name, h in self._handlers.items()},
            "values": self._saved_state,
        }

    def load_committed(self, committed: dict[str, Any]) -> None:
        """Make :meth:`committed`'s output (a previous run of this process's) the last
        commit, and restore it."""
        for name, handler in self._handlers.items():
            handler.saved = committed["handlers"][name]
        self._saved_state = committed["values"]
        self.restore()


def make_run(
    hvd: Any,
    translate: Callable[[BaseException], BaseException | None] | None = None,
    restarts: Callable[[], bool] = lambda: False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Horovod's ``elastic.run`` decorator for the Horovod module ``hvd``, with hvdkit's reset
    (see the module docstring). ``translate`` turns a framework's own error for a failed
    Horovod op into the ``HorovodInternalError`` the loop recovers from (None: not one).
    Where ``restarts()``, a reset restarts the process instead (:mod:`hvdkit.elastic_restart`),
    and a state that a restarted process made resumes from what it committed before."""

    def reset(state: Any) -> None:
        if restarts():
            elastic_restart.restart(state.committed())
        started = time.monotonic()
        topology = restart(hvd)
        rank_zero.print0(
            f"hvdkit elastic: reset to {topology.size} process(es) in "
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

        @functools.wraps(func)
        def start(state: Any, *args: Any, **kwargs: Any) -> Any:
            rank_zero.set_rank(hvd.rank())
            restarted = bool(getattr(state, "restarted", False))
            if restarts():
                check_restart_source(hvd, restarted)
            if restarted:
                state.restarted = False
                state.on_reset()  # the reset callbacks, as after an in-process reset
                rank_zero.print0(
                    f"hvdkit elastic: restarted at {hvd.size()} process(es); restoring the "
                    "last commit"
                )
            return run_fn(translated, functools.partial(reset, state))(state, *args, **kwargs)

        return start

    return run


def check_restart_source(hvd: Any, restarted: bool) -> None:
    """Rank 0's state is what the first sync sends everyone: after restarts it must be one
    that survived (Horovod keeps a previous host first; this checks it, collectively)."""
    restored = hvd.allgather_object(restarted, name="hvdkit.elastic.restarted")
    if any(restored) and not restored[0]:
        raise RuntimeError(
            "hvdkit elastic: after the restart, rank 0 is a new worker without the committed "
            f"state that ranks {[r for r, x in enumerate(restored) if x]} hold; syncing from it "
            "would lose the training. Fix: keep at least the first host of the job"
        )


class _Commit(State):
    """Horovod's ``State`` for a session: ``commit()`` (save, then the host-update check all
    ranks take together) and the host-update queue the worker's notification service fills."""

    def __init__(self, owner: SessionElastic) -> None:
        self.owner = owner
        super().__init__(bcast_object=owner.broadcast_object, get_rank=owner.hvd.rank)

    def save(self) -> None:
        self.owner.saved = (self.owner.adapter._snapshot(), self.owner.position())

    def restore(self) -> None:
        assert self.owner.saved is not None, "nothing committed yet"
        snapshot, position = self.owner.saved
        self.owner.adapter._restore_snapshot(snapshot)
        self.owner.set_position(position)

    def sync(self) -> None:
        self.owner.sync()


class SessionElastic:
    """The elastic side of a six-step session (``setup(..., elastic=True)``), shared by both
    frameworks' sessions: the session calls :meth:`step_done` after each optimizer step and
    :meth:`commit` at each epoch end, and runs its own collectives through :meth:`guard`.

    A lost worker makes a collective raise ``HorovodInternalError`` on every survivor; an added
    one makes the next commit raise ``HostsUpdatedInterrupt``. Either way :meth:`recover` puts
    back the last commit (after a loss), re-initialises Horovod at the new size, rescales the
    LR (:meth:`hvdkit.core.Adapter.rescale`), and syncs from rank 0 with the same collectives a
    joining worker's ``setup()`` runs, so the two meet. ``generation`` counts recoveries: the
    session's data loader restarts from the restored position when it changes.

    ``position``/``set_position`` carry the session's own place (e.g. samples done in the
    epoch) besides the adapter's; ``on_reset`` runs after each recovery."""

    def __init__(
        self,
        hvd: Any,
        adapter: Any,
        broadcast_object: Callable[[Any], Any],
        position: Callable[[], dict[str, Any]],
        set_position: Callable[[dict[str, Any]], None],
        on_reset: Callable[[], None],
    ) -> None:
        from horovod.common.elastic import notification_manager

        self.hvd, self.adapter = hvd, adapter
        self.broadcast_object = broadcast_object
        self._position, self._set_position, self._on_reset = position, set_position, on_reset
        self.every = adapter.config.commit_every
        self.generation = 0
        self.since_commit = 0
        self.between_passes = False  # saved at a pass's end; committed at the next one's start
        self.saved: tuple[Any, dict[str, Any]] | None = None
        self.state = _Commit(self)
        notification_manager.init()  # a no-op outside an elastic job
        notification_manager.register_listener(self.state)
        self.sync_position()  # setup() has run step 4: the rest of a joining worker's sync
        self.state.save()

    def position(self) -> dict[str, Any]:
        return {"adapter": self.adapter._position(), "session": self._position()}

    def set_position(self, position: dict[str, Any]) -> None:
        self.adapter._set_position(position["adapter"])
        self._set_position(position["session"])

    def sync_position(self) -> None:
        self.set_position(self.broadcast_object(self.position()))

    def sync(self) -> None:
        # Rank 0's position as it is before the state's broadcast: loading an optimizer state
        # (ZeRO's, cut anew for the new world) sets the groups' LR to the snapshot's, which
        # a reset between passes has moved on from (the script's epoch-end scheduler step).
        position = self.position()
        self.adapter._resume(read_checkpoint=False)
        self.set_position(self.broadcast_object(position))

    def step_done(self) -> bool:
        """After an optimizer step: whether a commit is due (every ``commit_every`` steps)."""
        self.since_commit += 1
        return self.since_commit >= self.every

    def commit_or_raise(self) -> None:
        """Save the state in host memory and take the pending host changes (collective);
        raises ``HostsUpdatedInterrupt`` when workers were added or removed."""
        self.state.commit()
        self.since_commit, self.between_passes = 0, False

    def save_at_pass_end(self) -> None:
        """At the end of the training pass over the data: saved (no collective), so that a
        reset does not go back into the pass; the commit (and the check for added workers)
        waits for the next pass or ``epochs()``'s epoch end, after the script's epoch-end
        code (a scheduler's step: a worker joining before it would start without it). Until
        then nothing trains, and a reset keeps the position and scheduler as they are then."""
        self.state.save()
        self.since_commit, self.between_passes = 0, True

    def back_to_the_reset(self) -> None:
        """When the script asks for its next batch after a reset in a pass: the position
        (scheduler, LR) as the reset left it, undoing what the script's code after the failed
        step did (a scheduler's step) before the batches from there are trained again."""
        assert self.saved is not None
        self.set_position(self.saved[1])

    def commit(self) -> None:
        """:meth:`commit_or_raise`, recovering in place."""
        try:
            with profile_recorder.phase("checkpoint"):  # under --profile: apart from steps
                self.commit_or_raise()
        except (HostsUpdatedInterrupt, HorovodInternalError) as error:
            self.recover_from(error)

    def recover_from(
        self,
        error: BaseException,
        translate: Callable[[BaseException], BaseException | None] | None = None,
    ) -> bool:
        """Recover if ``error`` (raised out of a framework's training loop, e.g. Keras
        ``fit``) means a lost or added worker; False if it is another error."""
        if translate is not None and not isinstance(error, HostsUpdatedInterrupt):
            error = translate(error) or error
        if isinstance(error, HostsUpdatedInterrupt):
            self.recover(failed=False)
        elif isinstance(error, HorovodInternalError):
            self.recover(failed=True)
        else:
            return False
        return True

    def guard(self, collective: Callable[[], Any]) -> tuple[bool, Any]:
        """Run a session collective: ``(True, result)``, or ``(False, None)`` when a worker was
        lost during it (the session has recovered; the caller may run it again)."""
        try:
            return True, collective()
        except HorovodInternalError:
            self.recover(failed=True)
            return False, None

    def recover(self, *, failed: bool) -> None:
        """Back to the last commit (``failed``: a worker was lost), Horovod at the new size,
        the LR rescaled, and the state synced from rank 0. Repeated while workers keep
        failing during it, as Horovod's own loop does."""
        with profile_recorder.phase("reset"):  # under --profile: apart from the steps
            self._recover(failed)

    def _recover(self, failed: bool) -> None:
        started, lost = time.monotonic(), self.since_commit if failed else 0
        while True:
            try:
                if failed:
                    if self.between_passes:  # the script's epoch-end code has moved them on
                        assert self.saved is not None
                        self.saved = (self.saved[0], self.position())
                    self.state.restore()
                topology = restart(self.hvd)
                self.adapter.rescale(topology)
                self.state.on_reset()
                self.sync()
                self.state.save()
                break
            except HorovodInternalError:
                failed = True
        self.since_commit = 0
        self.generation += 1
        self._on_reset()
        rank_zero.print0(
            f"hvdkit elastic: {'a worker was lost' if failed else 'workers were added'}; "
            f"{topology.size} process(es) after {time.monotonic() - started:.1f} s, "
            f"{lost} step(s) since the last commit redone, LR x{self.adapter.warmup.factor:g}"
        )
