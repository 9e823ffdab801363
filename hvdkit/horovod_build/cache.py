"""The wheel cache: built Horovod wheels kept outside any checkout, keyed by what they depend on.

A wheel compiled against torch 2.13 / TF 2.21 with gcc 12 is only valid for exactly that
combination, so the key covers every input that changes the binary and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from hvdkit.horovod_build.config import BuildConfig, BuildEnv

RECIPE_VERSION = 2
"""Bump when the remedies change what gets compiled, so old wheels are not reused."""


def cache_inputs(env: BuildEnv, cfg: BuildConfig) -> dict[str, object]:
    """The values the cache key is made from, readable in ``build.json`` beside each wheel."""
    inputs: dict[str, object] = {
        "recipe": RECIPE_VERSION,
        "horovod": cfg.horovod_version,
        "python": env.python_tag,
        "platform": env.platform,
        "compiler": f"{env.compiler_id}-{env.compiler_version}",
        "frameworks": sorted(cfg.frameworks),
        "controllers": sorted(cfg.controllers),
    }
    if cfg.debug_info:
        inputs["debug_info"] = True
    if "torch" in cfg.frameworks:
        inputs["torch"] = env.torch_version
        if env.torch_cuda:
            # A CUDA torch gets CUDA compiled in (hvdkit.horovod_build.cuda): the toolkit is an
            # input.
            inputs["torch_cuda"] = env.torch_cuda
            inputs["cuda"] = env.cuda_version
    if "tensorflow" in cfg.frameworks:
        inputs["tensorflow"] = env.tensorflow_version
    if "mpi" in cfg.controllers:
        inputs["mpi"] = f"{env.mpi_implementation}-{env.mpi_version}"
    if cfg.gpu_operations:
        inputs["gpu_operations"] = cfg.gpu_operations
        inputs["cuda"] = env.cuda_version
        inputs["cuda_arch"] = sorted(cfg.cuda_arch_list or env.gpu_compute_capabilities)
        inputs["nccl"] = env.nccl_version
    return inputs


def cache_key(env: BuildEnv, cfg: BuildConfig) -> str:
    """A readable prefix plus a hash, e.g. ``horovod-0.28.1-cp311-3f2a9c1e04d2b7aa``."""
    inputs = cache_inputs(env, cfg)
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return f"horovod-{cfg.horovod_version}-{env.python_tag}-{digest}"


class WheelCache:
    """A directory of ``<key>/horovod-*.whl`` plus ``<key>/build.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def lookup(self, key: str) -> Path | None:
        """The cached wheel for ``key``, or None."""
        wheels = sorted((self.root / key).glob("horovod-*.whl"))
        return wheels[0] if wheels else None

    def store(self, key: str, wheel: Path, metadata: dict[str, object]) -> Path:
        """Copy ``wheel`` in; the entry appears whole or not at all (rename is atomic)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.root))
        try:
            shutil.copy2(wheel, staging / wheel.name)
            (staging / "build.json").write_text(json.dumps(metadata, indent=2, sort_keys=True))
            final = self.root / key
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final / wheel.name
