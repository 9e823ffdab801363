"""``Compression.bf16``, the one marker the torch, Keras and TensorFlow modules share: each
module's ``Compression`` is Horovod's (``none``, ``fp16``) with ``bf16`` added. The reduction
itself is each framework's (``hvdkit.torch.bf16``, ``hvdkit.keras.backend``): Horovod 0.28.1's
collectives refuse bfloat16 tensors, so the bf16 bits travel as int16 through ``alltoall``
and ``allgather`` and are summed in float32 (see ``hvdkit.torch.bf16`` for the scheme and
where bf16 loses against fp16). Framework-free."""

from __future__ import annotations

import functools
from typing import Any


class BF16Compressor:
    """Gradients travel as bfloat16 and come back in their own dtype. A marker: its
    ``compress``/``decompress`` change nothing, as the reduction is hvdkit's."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def is_bf16(compression: Any) -> bool:
    """Whether ``compression`` asks for bf16 transport."""
    return compression is BF16Compressor or isinstance(compression, BF16Compressor)


@functools.cache
def with_bf16(horovod_compression: type) -> Any:
    """Horovod's ``Compression`` class (its ``none`` and ``fp16``) with ``bf16`` added."""
    return type(
        "Compression",
        (horovod_compression,),
        {"bf16": BF16Compressor, "__doc__": "Horovod's compression choices and ``bf16``.",
         "__module__": horovod_compression.__module__},
    )  # fmt: skip
