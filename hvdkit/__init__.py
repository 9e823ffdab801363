"""hvdkit: Horovod data-parallel training on today's Keras and PyTorch.

``import hvdkit`` imports no deep-learning framework; each adapter imports its own lazily.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
