"""Input pipeline throughput: ``python -m hvdkit.bench.pipeline`` (one process).

A starved accelerator is the usual bottleneck of data-parallel training: each rank needs its
batches prepared faster than it trains on them. This times a ``DataLoader`` over in-memory
JPEG images decoded and augmented per sample (random crop, flip, scale to float, normalise:
the CPU work of a real image pipeline), with and without worker processes, ``pin_memory``
(only meaningful with a GPU) and a deeper prefetch.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

MEAN = (0.485, 0.456, 0.406)  # the ImageNet statistics every torchvision recipe uses
STD = (0.229, 0.224, 0.225)
CONFIGS: dict[str, dict[str, object]] = {
    "main process": {"num_workers": 0},
    "workers": {"num_workers": "W"},
    "workers + pin_memory": {"num_workers": "W", "pin_memory": True},
    "workers + prefetch 8": {"num_workers": "W", "prefetch_factor": 8},
}


class JpegImages:
    """``n`` JPEG-encoded ``side``x``side`` RGB images in memory, decoded and augmented on
    every access: random crop to ``crop``, horizontal flip, scale to float, normalise."""

    def __init__(self, n: int, side: int = 144, crop: int = 128) -> None:
        import io

        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        # Smooth gradients plus noise: compresses like a photo, not like white noise.
        ramp = np.linspace(0, 255, side, dtype=np.float32)
        self.jpegs = []
        for _ in range(n):
            base = ramp[None, :, None] * rng.random(3) + ramp[:, None, None] * rng.random(3)
            pixels = np.clip(base / 2 + rng.normal(0, 12, (side, side, 3)), 0, 255)
            buffer = io.BytesIO()
            Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
            self.jpegs.append(buffer.getvalue())
        self.labels = rng.integers(0, 10, n)
        self.side, self.crop = side, crop

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> Any:
        import io
        import random

        import numpy as np
        import torch
        from PIL import Image

        image = Image.open(io.BytesIO(self.jpegs[i])).convert("RGB")
        top, left = (random.randint(0, self.side - self.crop) for _ in range(2))
        image = image.crop((left, top, left + self.crop, top + self.crop))
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = np.asarray(image, dtype=np.float32) / 255.0
        array = (array - MEAN) / STD
        return torch.from_numpy(array.transpose(2, 0, 1).copy()), int(self.labels[i])


def samples_per_second(dataset: Any, batch_size: int, batches: int, **loader_options: Any) -> float:
    """Samples/s over ``batches`` batches, after the first (worker start-up is not counted)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                        **loader_options)  # fmt: skip
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    del iterator  # stops the workers
    return batch_size * batches / seconds


def run(workers: int, batch_size: int, batches: int) -> dict[str, float | None]:
    """Samples/s per configuration; ``None`` where it does not apply (pin_memory without GPU)."""
    import torch

    dataset = JpegImages(batch_size * (batches + 1))
    out: dict[str, float | None] = {}
    for name, options in CONFIGS.items():
        options = {k: workers if v == "W" else v for k, v in options.items()}
        if options.get("pin_memory") and not torch.cuda.is_available():
            out[name] = None
            continue
        if options.get("num_workers") == 0 and "prefetch_factor" in options:
            continue
        out[name] = samples_per_second(dataset, batch_size, batches, **options)
    return out


def main(argv: list[str] | None = None) -> None:
    from hvdkit.bench.worker import emit

    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=30)
    args = parser.parse_args(argv)
    emit({"workers": args.workers, "batch_size": args.batch_size,
             "samples_per_s": run(args.workers, args.batch_size, args.batches)})  # fmt: skip


if __name__ == "__main__":
    main()
