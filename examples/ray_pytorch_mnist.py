"""examples/pytorch_mnist.py on a Ray cluster through hvdkit.ray (Horovod's RayExecutor API):
one Horovod rank per Ray actor, each rank's test accuracy returned to this driver.

    python examples/ray_pytorch_mnist.py --num-workers 2 --epochs 3
    RAY_ADDRESS=head:6379 python examples/ray_pytorch_mnist.py --num-workers 8 --epochs 5

Without RAY_ADDRESS it starts a local Ray with this machine's cores. Other arguments go to
pytorch_mnist.py (``--synthetic``, ``--batch-size``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_mnist  # noqa: E402  (beside this file)

from hvdkit.ray import RayExecutor  # noqa: E402


def main() -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    args, rest = parser.parse_known_args()
    # The actors need pytorch_mnist's code, not a copy of this directory: send it by value.
    ray.cloudpickle.register_pickle_by_value(pytorch_mnist)
    ray.init(include_dashboard=False)
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=120),
        num_workers=args.num_workers,
        cpus_per_worker=args.cpus_per_worker,
    )
    executor.start()
    try:
        accuracies = executor.run(pytorch_mnist.main, args=[rest])
    finally:
        executor.shutdown()
    print(f"test accuracy by rank: {', '.join(f'{a:.4f}' for a in accuracies)}")
    return accuracies


if __name__ == "__main__":
    main()
