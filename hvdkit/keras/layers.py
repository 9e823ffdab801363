"""``SyncBatchNormalization`` for Keras 3, both backends (Horovod has one for tf.keras only,
``horovod.tensorflow.SyncBatchNormalization``, which Keras 3 breaks: ``fused=`` is gone)."""

from __future__ import annotations

from typing import Any

import keras

from hvdkit.keras import backend


@keras.saving.register_keras_serializable(package="hvdkit")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` (same arguments) whose training statistics are those
    of the global batch: N ranks with B rows each normalise, and update the moving mean and
    variance, exactly as one process with the N * B rows would. One allreduce of each rank's
    per-channel sums, sums of squares and row count per call, differentiable on both backends
    (gradients flow to every rank's rows). Inference uses the moving statistics, as usual.
    On JAX, ``fit``'s step already holds the global batch (sharded over the processes, compiled
    or not), so the layer's statistics are global without a collective there; a call on this
    rank's own arrays outside the step is reduced through Horovod as on the other backends.

    ``fused=False`` (Horovod's only accepted value, which Keras 3 no longer takes) is accepted
    and dropped; ``fused=True`` is refused, as Horovod does."""

    def __init__(self, *args: Any, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(*args, **kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
        hvd = backend.horovod()
        if mask is not None or hvd.size() == 1 or backend.current().holds_global_batch(inputs):
            return super()._moments(inputs, mask)
        ops = keras.ops
        channels = inputs.shape[self.axis]
        local = ops.concatenate([
            ops.sum(inputs, axis=self._reduction_axes),
            ops.sum(ops.square(inputs), axis=self._reduction_axes),
            ops.reshape(ops.cast(ops.size(inputs), inputs.dtype) / channels, (1,)),
        ])  # fmt: skip
        local = backend.current().for_horovod(local)
        total = hvd.allreduce(local, op=hvd.Sum, name=f"hvdkit.sync_bn.{self.name}")
        count = total[2 * channels]
        mean = total[:channels] / count
        variance = ops.maximum(total[channels : 2 * channels] / count - ops.square(mean), 0.0)
        return mean, variance
