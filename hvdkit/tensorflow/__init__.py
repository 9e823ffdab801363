"""Horovod's TensorFlow 2 API (``horovod.tensorflow``) on TensorFlow >= 2.16 with Keras 3, for
custom training loops.

    import hvdkit.tensorflow as hvd     # was: import horovod.tensorflow as hvd

Every public name of Horovod 0.28.1's module is here with its signature. Horovod's ops are
fine on TensorFlow tensors and are Horovod's own here; what Keras 3 broke is hvdkit's:
``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (:mod:`.tape`),
``broadcast_variables``, ``DistributedOptimizer`` given a Keras 3 optimizer,
``SyncBatchNormalization`` and :mod:`.elastic`. All of them take Keras 3 variables as well as
``tf.Variable``s (a ``tf.Module``'s), eagerly and inside ``tf.function``; XLA
(``jit_compile=True``) is refused with the fix, as Horovod's ops have no XLA kernels. Keras
must run on TensorFlow (``KERAS_BACKEND=tensorflow``, Keras's default); for Keras on torch use
:mod:`hvdkit.keras`.

What differs from Horovod's, on purpose:

- ``DistributedOptimizer`` around a Keras 3 optimizer is ``hvdkit.keras.DistributedOptimizer``:
  it also reduces the gradients given to ``apply_gradients``, so a custom loop that wraps its
  optimizer instead of its tape trains alike on every rank (Horovod's reduced only in
  ``compute_gradients``/``minimize``, and such a loop silently let the ranks drift apart).
  ``tf.compat.v1.train.Optimizer``s go to Horovod's own.
- The collectives and ``broadcast_variables`` take Keras 3 variables (Horovod's fail on them).
- Keras 3 makes an optimizer's variables at its first ``apply_gradients``: broadcast
  ``opt.variables`` after the first step, as Horovod's examples do (``opt.variables()`` of
  Keras 2 is a list property now), or call ``opt.build(model.trainable_variables)`` first.
- ``barrier()`` (``horovod.torch``'s) is here too.
"""

from __future__ import annotations

from hvdkit.tensorflow._require import problem as _problem

if (_why := _problem()) is not None:
    raise ImportError(_why)

# Imported after the check above, which says what to install when TensorFlow is missing.
from typing import Any

import tensorflow as tf
from horovod.tensorflow import (
    Adasum,
    Average,
    LocalGradientAggregationHelper,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    ccl_built,
    check_extension,
    check_num_rank_power_of_2,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    gpu_available,
    handle_average_backwards_compatibility,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    refs_to_vars,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    split_list,
    start_timeline,
    stop_timeline,
    vars_to_refs,
)
from horovod.tensorflow import Compression as _HorovodCompression

from hvdkit.compression import with_bf16
from hvdkit.keras import init  # one init (and GPU pinning) for both modules
from hvdkit.keras import optimizer as keras_optimizer
from hvdkit.keras.layers import SyncBatchNormalization
from hvdkit.tensorflow import elastic
from hvdkit.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hvdkit.tensorflow.tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)

Compression = with_bf16(_HorovodCompression)
"""Horovod's compression choices (``none``, ``fp16``) and ``bf16`` (:mod:`hvdkit.compression`)."""


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Make ``optimizer`` reduce its gradients over the ranks (Horovod's signature).

    A Keras 3 optimizer becomes ``hvdkit.keras.DistributedOptimizer(optimizer, ...)``: it
    reduces in ``model.fit`` and in ``apply_gradients``/``apply`` of a custom loop
    (``use_locking`` has no meaning there). A ``tf.compat.v1.train.Optimizer`` gets Horovod's
    own wrapper, as in Horovod.

    Example (Horovod's seed script, ``tf.estimator`` replaced by ``fit``)::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        import horovod.tensorflow as horovod_tf

        return horovod_tf.DistributedOptimizer(
            optimizer, name, use_locking, device_dense, device_sparse, compression,
            sparse_as_dense, backward_passes_per_step, op, gradient_predivide_factor,
            average_aggregated_gradients, num_groups, groups, process_set,
            scale_local_gradients,
        )  # fmt: skip
    return keras_optimizer.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=None if process_set is global_process_set else process_set,
        scale_local_gradients=scale_local_gradients,
    )  # fmt: skip


def __getattr__(name: str) -> Any:
    # Anything else of Horovod's module (its submodules, private helpers that scripts and
    # Horovod's tests reach for, e.g. hvd.util._executing_eagerly) is Horovod's own.
    import horovod.tensorflow as horovod_tf

    if hasattr(horovod_tf, name):
        return getattr(horovod_tf, name)
    raise AttributeError(f"module 'hvdkit.tensorflow' has no attribute {name!r}")


__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "LocalGradientAggregationHelper", "Max", "Min", "PartialDistributedGradientTape",
    "ProcessSet", "Product", "Sum", "SyncBatchNormalization", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "check_extension", "check_num_rank_power_of_2",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set",
    "gloo_built", "gloo_enabled", "gpu_available", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "handle_average_backwards_compatibility", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "process_set_included_op", "rank", "rank_op", "reducescatter", "refs_to_vars",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "split_list",
    "start_timeline", "stop_timeline", "vars_to_refs",
]  # fmt: skip
