"""hvdkit: Horovod data-parallel training on today's Keras and PyTorch.

``import hvdkit`` imports no deep-learning framework; each adapter imports its own lazily.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["RankError", "__version__", "run"]


def __getattr__(name: str) -> Any:
    # hvdkit.run (Horovod's horovod.run), imported when first used: `import hvdkit` stays light.
    if name in ("run", "RankError"):
        from hvdkit.launch import func_run

        return getattr(func_run, name)
    raise AttributeError(f"module 'hvdkit' has no attribute {name!r}")
