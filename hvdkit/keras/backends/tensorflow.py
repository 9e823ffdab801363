"""Keras on TensorFlow: ``horovod.tensorflow``'s ops; ``IndexedSlices`` sparse gradients; XLA."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

from hvdkit.keras.backends.base import KerasBackend


class TensorFlowBackend(KerasBackend):
    has_xla = True

    def horovod(self) -> ModuleType:
        import horovod.tensorflow as hvd

        return hvd

    def for_horovod(self, tensor: Any, *, copy: bool = False) -> Any:
        return tensor  # TensorFlow's ops copy; layout is not the caller's concern

    def from_host(self, array: Any) -> Any:
        import keras

        return keras.ops.convert_to_tensor(array, dtype=array.dtype.name)

    def bf16_allreduce(
        self, tensors: list[Any], average: bool, name: str, process_set: Any
    ) -> list[Any]:
        # hvdkit.torch.bf16's scheme in TensorFlow ops, so it runs inside tf.function too.
        import tensorflow as tf

        hvd = self.horovod()
        size = process_set.size()
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
        length = tf.size(flat)
        flat = tf.pad(flat, [[0, tf.math.floormod(-length, size)]])
        bits = tf.bitcast(tf.cast(flat, tf.bfloat16), tf.int16)
        received = hvd.alltoall(bits, name=f"{name}.bf16.scatter", process_set=process_set)
        received = received[0] if isinstance(received, tuple) else received
        slices = tf.cast(tf.bitcast(tf.reshape(received, [size, -1]), tf.bfloat16), tf.float32)
        mine = tf.reduce_sum(slices, 0) / (size if average else 1)
        mine = tf.bitcast(tf.cast(mine, tf.bfloat16), tf.int16)
        gathered = hvd.allgather(mine, name=f"{name}.bf16.gather", process_set=process_set)
        whole = tf.cast(tf.bitcast(gathered, tf.bfloat16), tf.float32)
        out, at = [], 0
        for t in tensors:
            n = tf.size(t)
            out.append(tf.cast(tf.reshape(whole[at : at + n], tf.shape(t)), t.dtype))
            at += n
        return out

    def set_cpu_threads(self, threads: int) -> None:
        # Both pools: the inter-op pool alone (one thread per core by default) runs
        # independent ops on every core, so the ranks on a host would still share them all
        # (Keras fit() at 2 ranks on 2 cores: 0.69 weak-scaling efficiency with only the
        # intra-op pool set, 0.91 with both). TensorFlow fixes its pools at its first op.
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)

    def tape_gradients(
        self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
    ) -> tuple[list[Any], list[Any]]:
        import tensorflow as tf

        if not callable(loss) and tape is None:
            raise ValueError("compute_gradients: a tensor loss needs the tape that recorded it")
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:
                var_list = list(var_list() if callable(var_list) else var_list)
                tape.watch(var_list)
                loss = loss()
        var_list = list(var_list() if callable(var_list) else var_list)
        return tape.gradient(loss, var_list, grad_loss), var_list

    def gpu_count(self) -> int:
        import tensorflow as tf

        return len(tf.config.list_physical_devices("GPU"))

    def use_gpu(self, index: int, rank: int) -> None:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        try:
            tf.config.set_visible_devices([gpus[index]], "GPU")
            tf.config.experimental.set_memory_growth(gpus[index], True)
        except RuntimeError as exc:
            # TensorFlow fixes its devices when the first op runs; too late to change them.
            if tf.config.get_visible_devices("GPU") != [gpus[index]]:
                raise RuntimeError(
                    f"rank {rank}: TensorFlow has already initialised its GPUs, so this "
                    f"process cannot be pinned to GPU {index} ({exc}). Fix: call "
                    "hvdkit.keras.init() first thing in the script, before building the model "
                    "or running any TensorFlow op."
                ) from None

    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        if not device:
            return contextlib.nullcontext()
        import tensorflow as tf

        scope: AbstractContextManager[Any] = tf.device(device)
        return scope

    def densify(self, tensors: Sequence[Any]) -> list[Any]:
        if not any(self.is_sparse(t) for t in tensors):
            return list(tensors)
        import tensorflow as tf

        return [tf.convert_to_tensor(t) if self.is_sparse(t) else t for t in tensors]

    def scale(self, tensor: Any, factor: float) -> Any:
        if self.is_sparse(tensor):
            return type(tensor)(tensor.values * factor, tensor.indices, tensor.dense_shape)
        return tensor * factor

    def is_sparse(self, tensor: Any) -> bool:
        return type(tensor).__name__ == "IndexedSlices"

    def in_xla_context(self) -> bool:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
