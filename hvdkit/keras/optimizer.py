"""``DistributedOptimizer`` for Keras 3: gradients are reduced across ranks before the wrapped
optimizer applies them, in ``model.fit`` (compiled or eager) and in custom loops.

Horovod's own Keras optimizer fails on Keras 3 (``'Variable' object has no attribute 'ref'``)
or, worse, runs without averaging. Here the optimizer's class is swapped for a subclass (one
per optimizer class and set of options, named like it, as Horovod does) that overrides the one
entry point every Keras 3 path goes through, ``apply`` (``apply_gradients`` calls it too). So
the user's optimizer keeps its state, ``from_config`` builds a distributed optimizer again, and
a saved model names the plain class (it loads without hvdkit).

Behaviour follows Horovod 0.28.1's where it defines it:

- ``backward_passes_per_step=N`` applies the *sum* of the N passes' gradients (each pass's
  gradients reduced across ranks), or their mean with ``average_aggregated_gradients=True``;
  ``optimizer.iterations`` counts passes, not updates (so does the LR schedule).
- A sparse gradient (TensorFlow ``IndexedSlices``, e.g. from an ``Embedding``) is reduced by
  allgather, separately from the dense ones; ``sparse_as_dense=True`` densifies it first.
- ``register_local_var(var)``: that variable's gradient is not reduced (scaled by 1 / size
  when ``scale_local_gradients``).

Deliberate differences: the optimizer is wrapped in place (Horovod builds a fresh one from the
config, losing any state it had); ``name`` names the allreduce ops only (in Keras 3 the
optimizer's name is part of its variables' paths, which checkpoints use); ``device_dense``,
``device_sparse``, ``num_groups`` and ``groups`` are accepted and have no effect (Horovod's ops
run on the tensor's device; all dense gradients go in one fused group, which gives the same
values as any grouping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras

from hvdkit.keras import backend

WRAPPED = "_hvdkit_distributed"


@dataclass(frozen=True)
class Options:
    """How gradients are reduced; one subclass per optimizer class and options."""

    op: str = "average"
    fp16: bool = False
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    scale_local_gradients: bool = True
    name: str = "hvdkit.grads"
    process_set: Any = None


_CLASSES: dict[tuple[type, Options], type] = {}


def refuse_xla() -> None:
    """Stop with the fix when the step is being compiled with XLA (TensorFlow backend): Horovod's
    ops have no XLA kernels, and Keras turns XLA on by itself on a GPU."""
    if keras.config.backend() != "tensorflow":
        return
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "the training step is compiled with XLA (jit_compile), but Horovod's TensorFlow ops "
            "have no XLA kernels. Fix: model.compile(..., jit_compile=False), or add "
            "hvdkit.keras.callbacks.BroadcastGlobalVariablesCallback(0) to fit()'s callbacks "
            "(it turns XLA off), or use hvdkit.keras.setup()."
        )


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    refuse_xla()
    options: Options = self._hvdkit_options
    grads = list(grads)
    variables = (
        list(trainable_variables)
        if trainable_variables is not None
        else list(getattr(self, "_trainable_variables", []))
    )
    local = getattr(self, "_hvdkit_local_vars", set())
    shared = [i for i in range(len(grads)) if i >= len(variables) or id(variables[i]) not in local]
    reduced = backend.allreduce_list(
        [grads[i] for i in shared],
        op=options.op,
        name=options.name,
        fp16=options.fp16,
        predivide=options.gradient_predivide_factor,
        sparse_as_dense=options.sparse_as_dense,
        process_set=options.process_set,
    )
    for i, grad in zip(shared, reduced, strict=True):
        grads[i] = grad
    if local and options.scale_local_gradients:
        size = _set_size(options.process_set)
        grads = [
            g / size if g is not None and i not in shared else g for i, g in enumerate(grads)
        ]
    if options.backward_passes_per_step > 1 and not options.average_aggregated_gradients:
        # Keras applies the mean of the accumulated passes; Horovod's default is their sum.
        n = options.backward_passes_per_step
        grads = [g * n if g is not None else g for g in grads]
    return type(self)._hvdkit_base.apply(self, grads, trainable_variables)


def _set_size(process_set: Any) -> int:
    return process_set.size() if process_set is not None else backend.horovod().size()


def _iterations(self: Any) -> Any:
    # Horovod counts backward passes; Keras's own property counts updates under accumulation.
    return self._iterations


def _register_local_var(self: Any, var: Any) -> None:
    """Horovod's ``register_local_var``: ``var``'s gradient stays this rank's own (not
    reduced); with ``scale_local_gradients`` it is divided by the number of ranks."""
    if not hasattr(self, "_hvdkit_local_vars"):
        self._hvdkit_local_vars = set()
    self._hvdkit_local_vars.add(id(var))


def _from_config(cls: type, config: dict[str, Any], custom_objects: Any = None) -> Any:
    # The base class's from_config builds cls(**config): an instance of this subclass, so a
    # distributed optimizer rebuilt from its config still reduces gradients.
    return cls._hvdkit_base.from_config.__func__(cls, config, custom_objects=custom_objects)


def distributed_class(base: type, options: Options) -> type:
    """The subclass of ``base`` that reduces gradients with ``options`` (cached)."""
    key = (base, options)
    if key not in _CLASSES:
        namespace: dict[str, Any] = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_hvdkit_base": base,
            "_hvdkit_options": options,
            WRAPPED: True,
            "apply": _apply,
            "register_local_var": _register_local_var,
            "from_config": classmethod(_from_config),
        }
        if options.backward_passes_per_step > 1:
            namespace["iterations"] = property(_iterations)
        _CLASSES[key] = type(base.__name__, (base,), namespace)
    return _CLASSES[key]


def _op_name(op: Any, hvd: Any) -> str:
    if op is None or op == hvd.Average:
        return "average"
    if op == hvd.Sum:
        return "sum"
    if op == getattr(hvd, "Adasum", object()):
        return "adasum"
    raise ValueError(f"op={op!r}: DistributedOptimizer reduces with Average, Sum or Adasum")


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = None,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Make ``optimizer`` reduce its gradients over all ranks (Horovod's signature).

    ``op``: ``Average`` (default), ``Sum`` or ``Adasum``. ``compression=Compression.fp16``
    halves the bytes sent. ``backward_passes_per_step=N`` accumulates N batches locally before
    each update and applies their sum (``average_aggregated_gradients=True``: their mean).
    ``process_set`` reduces within that set only. See the module docstring for what differs
    from Horovod.

    Example::

        opt = hvdkit.keras.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    backend.require_keras3(optimizer)
    if getattr(optimizer, WRAPPED, False):
        return optimizer
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    hvd = backend.horovod()
    if gradient_predivide_factor != 1.0 and _op_name(op, hvd) != "average":
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if backward_passes_per_step > 1:
        if optimizer.built and not optimizer.gradient_accumulation_steps:
            raise ValueError(
                "backward_passes_per_step > 1 needs an optimizer that has not been built yet "
                "(its gradient accumulators are made when it is built): wrap it before "
                "training or build it with gradient_accumulation_steps"
            )
        optimizer.gradient_accumulation_steps = backward_passes_per_step
    options = Options(
        op=_op_name(op, hvd),
        fp16=compression is not None and compression == hvd.Compression.fp16,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        scale_local_gradients=scale_local_gradients,
        name=name or "hvdkit.grads",
        process_set=process_set,
    )
    optimizer.__class__ = distributed_class(type(optimizer), options)
    return optimizer
