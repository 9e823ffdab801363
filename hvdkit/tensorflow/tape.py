"""Horovod's ``DistributedGradientTape`` and ``PartialDistributedGradientTape`` for TensorFlow 2
with Keras 3: ``tape.gradient`` returns gradients reduced over the ranks.

Horovod's tape fails on Keras 3 models (``'Variable' object has no attribute 'ref'``: it keys
its bookkeeping on ``tf.Variable.ref()``, which Keras 3 variables lack). This one keys on the
sources themselves, so Keras 3 variables, ``tf.Variable``s and watched tensors all work, eagerly
and inside ``tf.function``. The reduction is :func:`hvdkit.keras.optimizer.reduce_gradients`,
the same code that serves ``hvdkit.keras.DistributedOptimizer``: one fused allreduce of the
dense gradients (or ``groups`` of them), each sparse one by allgather.

Differences from Horovod's, all additions: ``gradient`` also takes ``sources`` as any nest
(a dict, a single variable) and ``unconnected_gradients``, as ``tf.GradientTape.gradient``
does; ``groups`` lists may hold Keras 3 variables; ``op=Adasum`` is reduced like
``DistributedOptimizer``'s (Horovod's tape passes it to a plain allreduce too);
``use_generic_names`` is accepted and has no effect (hvdkit names its ops itself).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from horovod.tensorflow import Average, Compression, global_process_set

from hvdkit.compression import is_bf16
from hvdkit.keras import backend
from hvdkit.keras.optimizer import Options, checked_groups, op_name, reduce_gradients, refuse_xla
from hvdkit.profile import recorder as profile_recorder
from hvdkit.profile import tf_hooks


class _Distributed:
    """Put in front of the wrapped tape's class (see :func:`DistributedGradientTape`)."""

    _hvdkit_options: Options
    _hvdkit_local: set[int]

    def register_local_source(self, source: Any) -> None:
        """Horovod's: ``source``'s gradient stays this rank's own (not reduced; divided by the
        number of ranks when ``scale_local_gradients``)."""
        self._hvdkit_local.add(id(source))

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """``tf.GradientTape.gradient``, the gradients then reduced over the ranks (but for
        the registered local sources)."""
        refuse_xla()
        if not tf.executing_eagerly() and profile_recorder.get() is not None:
            tf_hooks.tape_traced()
        grads = super().gradient(  # type: ignore[misc]
            target, sources, output_gradients, unconnected_gradients=unconnected_gradients
        )
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = reduce_gradients(
            self._hvdkit_options, flat_grads, flat_sources, self._hvdkit_local
        )
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """Horovod's: ``(local, global)`` lists of ``(source, gradient)`` pairs, the local ones
        those of the registered local sources."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for source, grad in zip(sources, grads, strict=True):
            (local if id(source) in self._hvdkit_local else shared).append((source, grad))
        return local, shared


_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    # One subclass per tape class, named like it, as Horovod does: a tape subclass the user
    # wrote keeps its own methods.
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_Distributed, base), {"__module__": base.__module__})
    return _CLASSES[base]


def DistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A tape whose ``gradient()`` averages (``op``) the gradients over the ranks
    (Horovod's signature). Wrap the tape after recording, as Horovod's examples do::

        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    ``compression=Compression.fp16`` halves the bytes sent; ``sparse_as_dense`` makes sparse
    gradients dense first; ``gradient_predivide_factor`` splits the average before and after
    the sum; ``groups`` is a number of fused allreduces or lists of variables fused together
    (``num_groups``: its deprecated name); ``process_set`` reduces within that set only.
    """
    hvd = backend.horovod()
    op = op_name(op, hvd)
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    options = Options(
        op=op,
        fp16=compression is not None and compression == hvd.Compression.fp16,
        bf16=is_bf16(compression),
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        scale_local_gradients=scale_local_gradients,
        name="hvdkit.tape",
        process_set=None if process_set is global_process_set else process_set,
        groups=checked_groups(num_groups, groups, who="DistributedGradientTape"),
        device_dense=device_dense,
        device_sparse=device_sparse,
    )
    tape: Any = object.__new__(_distributed_class(type(gradtape)))
    # The recording (and whether it is persistent, still open...) is the wrapped tape's: a
    # copy of its attributes, as Horovod's tape takes over the wrapped one's recording.
    tape.__dict__.update(vars(gradtape))
    tape._hvdkit_options = options
    tape._hvdkit_local = set()
    return tape


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """:func:`DistributedGradientTape` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients to this rank (Horovod's ``PartialDistributedGradientTape``)."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers: every local layer must be a keras.layers.Layer")
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
