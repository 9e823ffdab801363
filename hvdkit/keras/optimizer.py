"""``DistributedOptimizer`` for Keras 3: gradients are averaged across ranks before the
wrapped optimizer applies them, in ``model.fit`` (compiled or eager) and in custom loops.

Horovod's own Keras optimizer fails on Keras 3 (``'Variable' object has no attribute 'ref'``)
or, worse, runs without averaging. This one hooks the single entry point every Keras 3 path
goes through, ``optimizer.apply`` (``apply_gradients`` calls it too), on the instance, so the
user's optimizer class, its state and its serialization stay as they are.
"""

from __future__ import annotations

from typing import Any

import keras

from hvdkit.keras import backend

WRAPPED = "_hvdkit_distributed"


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
) -> keras.optimizers.Optimizer:
    """Make ``optimizer`` average (``op=Average``, default) or sum gradients over all ranks.

    ``compression=Compression.fp16`` halves the bytes sent. ``backward_passes_per_step=N``
    accumulates N batches locally (Keras's ``gradient_accumulation_steps``) before each update.

    Example::

        opt = hvdkit.keras.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    backend.require_keras3(optimizer)
    if getattr(optimizer, WRAPPED, False):
        return optimizer
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if backward_passes_per_step > 1:
        optimizer.gradient_accumulation_steps = backward_passes_per_step
    hvd = backend.horovod()
    op_name = "sum" if op is not None and op == hvd.Sum else "average"
    fp16 = compression is not None and compression == hvd.Compression.fp16
    inner_apply = optimizer.apply

    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        reduced = backend.allreduce_list(list(grads), op=op_name, fp16=fp16)
        return inner_apply(reduced, trainable_variables)

    optimizer.apply = apply
    setattr(optimizer, WRAPPED, True)
    return optimizer
