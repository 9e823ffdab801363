"""Keras 3 ``fit()`` throughput: hvdkit.keras against Horovod's ops wired in by hand.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_synthetic_benchmark.py \\
        --backend torch

Both variants train the same CNN on the same synthetic batches with the same optimizer:
"hvdkit" is a plain ``model.fit`` with ``hvdkit.keras.DistributedOptimizer``, "by hand" a
``train_step`` override that calls Horovod's grouped allreduce itself. Rank 0 prints samples/s
per rank for each and the ratio. The code is :mod:`hvdkit.bench.keras_fit`, which
``hvdkit bench`` also runs (at 1 and 2 ranks, both backends, next to the other benchmarks).
"""

from hvdkit.bench.keras_fit import main

if __name__ == "__main__":
    main()
