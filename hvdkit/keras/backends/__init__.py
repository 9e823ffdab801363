"""The Keras 3 backends hvdkit serves, one module each behind :class:`base.KerasBackend`;
:func:`current` picks the one Keras runs on. A third backend is a new module and one line in
``BACKENDS``."""

from __future__ import annotations

import functools
import importlib

import keras

from hvdkit.keras.backends.base import KerasBackend

# Keras's backend name -> "module:class", imported only when that backend is in use.
BACKENDS = {
    "tensorflow": "hvdkit.keras.backends.tensorflow:TensorFlowBackend",
    "torch": "hvdkit.keras.backends.torch:TorchBackend",
    "jax": "hvdkit.keras.backends.jax:JaxBackend",
}


@functools.cache
def current() -> KerasBackend:
    """The backend Keras runs on (``KERAS_BACKEND``), or an error that says what to set."""
    name = keras.config.backend()
    if name not in BACKENDS:
        raise RuntimeError(
            f"Keras backend {name!r} is not served by Horovod. Fix: set KERAS_BACKEND=tensorflow "
            "or KERAS_BACKEND=torch before importing keras."
        )
    module, _, cls = BACKENDS[name].partition(":")
    backend: KerasBackend = getattr(importlib.import_module(module), cls)()
    return backend


__all__ = ["BACKENDS", "KerasBackend", "current"]
