"""Keras on PyTorch: ``horovod.torch``'s ops, which take contiguous tensors only; no sparse
gradients, no XLA."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

from hvdkit.keras.backends.base import KerasBackend


class TorchBackend(KerasBackend):
    def horovod(self) -> ModuleType:
        import horovod.torch as hvd

        return hvd

    def for_horovod(self, tensor: Any, *, copy: bool = False) -> Any:
        if copy:
            tensor = tensor.detach().clone()
        return tensor.contiguous()  # Horovod refuses non-contiguous tensors

    def from_host(self, array: Any) -> Any:
        import keras

        return keras.ops.convert_to_tensor(array, dtype=array.dtype.name)

    def bf16_allreduce(
        self, tensors: list[Any], average: bool, name: str, process_set: Any
    ) -> list[Any]:
        from hvdkit.torch import bf16

        return bf16.allreduce(tensors, average, name, process_set)

    def set_cpu_threads(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)

    def gpu_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def use_gpu(self, index: int, rank: int) -> None:
        import torch

        torch.cuda.set_device(index)

    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        # Horovod's torch ops run on the tensor's device: device_dense/device_sparse mean nothing.
        return contextlib.nullcontext()

    def densify(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def is_sparse(self, tensor: Any) -> bool:
        return False
