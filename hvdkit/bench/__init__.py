"""``hvdkit bench``: the benchmark workers (one module per kind, each run as
``python -m hvdkit.bench.MODULE`` by the launcher), the pure parts (``metrics``, ``plan``,
``report``) and the runner (``execute``) and ``plots``.

Every number is measured side by side in one run, and compared within the same job wherever
possible (interleaved rounds, median of per-round ratios): this machine's speed drifts.
"""
