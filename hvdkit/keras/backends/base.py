"""What differs between Keras 3 backends for hvdkit, as abstract methods, so that no backend
can drift from the others unnoticed (Keras 3's own backends share no enforced interface)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any


class KerasBackend(abc.ABC):
    """One Keras 3 backend as hvdkit's Keras layer needs it."""

    #: Whether the backend can compile a step with XLA (``jit_compile``), which Horovod's
    #: ops cannot run in.
    has_xla: bool = False
    #: Whether the compiled step itself averages the gradients over the processes (JAX: XLA
    #: does, under Keras's DataParallel), so that the optimizer must not reduce them again.
    reduces_in_step: bool = False

    @abc.abstractmethod
    def horovod(self) -> ModuleType:
        """The Horovod module whose ops take this backend's tensors."""

    @abc.abstractmethod
    def for_horovod(self, tensor: Any, *, copy: bool = False) -> Any:
        """``tensor`` as Horovod's ops accept it (``copy``: detached from the variable)."""

    @abc.abstractmethod
    def from_host(self, array: Any) -> Any:
        """A host (numpy) array as Horovod's ops take it, in its own dtype (the sync guard's
        float64 fingerprints, the metric sums)."""

    @abc.abstractmethod
    def bf16_allreduce(
        self, tensors: list[Any], average: bool, name: str, process_set: Any
    ) -> list[Any]:
        """``tensors`` reduced over ``process_set``, travelling as bf16
        (:mod:`hvdkit.compression`): fused, each back in its dtype and shape."""

    @abc.abstractmethod
    def set_cpu_threads(self, threads: int) -> None:
        """Compute on CPU with ``threads`` threads (every pool the backend has)."""

    @abc.abstractmethod
    def gpu_count(self) -> int:
        """GPUs this process can see."""

    @abc.abstractmethod
    def use_gpu(self, index: int, rank: int) -> None:
        """Make GPU ``index`` this process's only one (``rank`` for the error message)."""

    @abc.abstractmethod
    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        """Ops created inside run on ``device`` (Horovod's ``device_dense``/``device_sparse``)."""

    @abc.abstractmethod
    def densify(self, tensors: Sequence[Any]) -> list[Any]:
        """``tensors`` with each sparse gradient made dense."""

    @abc.abstractmethod
    def is_sparse(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a sparse gradient (reduced by allgather)."""

    def holds_global_batch(self, tensor: Any) -> bool:
        """Whether ``tensor`` is already the whole global batch (every rank's rows), so a
        statistic over it needs no collective. Only JAX's data-parallel step has such values."""
        return False

    def after_init(self, hvd: Any) -> None:  # noqa: B027 (optional hook: most need nothing)
        """Runs once Horovod (``hvd``, :meth:`horovod`'s module) is initialised."""

    def scale(self, tensor: Any, factor: float) -> Any:
        """``tensor`` times ``factor`` (a sparse gradient stays sparse)."""
        return tensor * factor

    def tape_gradients(
        self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
    ) -> tuple[list[Any], list[Any]]:
        """Horovod's ``compute_gradients`` core: the gradients of ``loss`` (a tensor recorded
        on ``tape``, or a callable) for ``var_list``, and the variables. Only TensorFlow has
        a tape."""
        raise NotImplementedError(
            "compute_gradients(loss, var_list, tape) needs a TensorFlow GradientTape: on the "
            "torch backend call loss.backward() and pass [v.value.grad for v in variables] to "
            "optimizer.apply(grads, variables), which reduces them"
        )

    def in_xla_context(self) -> bool:
        """Whether the code running now is being compiled with XLA."""
        return False
