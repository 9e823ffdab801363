"""The check ``import hvdkit.tensorflow`` makes before anything else: TensorFlow is installed
and Keras runs on it; if not, the error says what to install or set."""

from __future__ import annotations

NO_TENSORFLOW = (
    "hvdkit.tensorflow needs TensorFlow, which is not installed. Fix: pip install "
    "'hvdkit[tensorflow-cpu]' (or 'hvdkit[tensorflow]' for the GPU build), then rebuild Horovod "
    "for it: hvdkit build-horovod --frameworks tensorflow"
)


def wrong_backend(backend: str) -> str:
    return (
        f"hvdkit.tensorflow needs Keras on its TensorFlow backend, but KERAS_BACKEND={backend}. "
        "Fix: for a Keras model on the torch backend use `import hvdkit.keras as hvd` (Horovod's "
        "Keras API, both backends); for hvdkit.tensorflow set KERAS_BACKEND=tensorflow before "
        "the first `import keras`"
    )


def problem() -> str | None:
    """Why ``hvdkit.tensorflow`` cannot serve this process, or None."""
    try:
        import tensorflow  # noqa: F401 - imported here anyway, next
    except ModuleNotFoundError as error:
        if error.name == "tensorflow":
            return NO_TENSORFLOW
        raise
    import keras  # TensorFlow's own dependency; its backend may come from ~/.keras too

    backend = keras.config.backend()
    return None if backend == "tensorflow" else wrong_backend(backend)
