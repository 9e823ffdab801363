"""Horovod on a Ray cluster: ``horovod.ray``'s API (Horovod 0.28.1) for functions that use
``hvdkit.torch`` or ``hvdkit.keras``. One Horovod rank per Ray actor, a Gloo rendezvous
served by the driver, each rank's result returned in rank order::

    import ray
    from hvdkit.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4)
    executor.start()
    results = executor.run(train, args=[config])   # one result per rank
    executor.shutdown()

Importing this module needs no Ray; using it does (``pip install 'hvdkit[ray]'``).
:class:`ElasticRayExecutor` is not provided (see docs/guides/ray-spark.md).
"""

from hvdkit.ray.executor import BaseHorovodWorker, MiniSettings, RayExecutor, WorkerError

__all__ = ["BaseHorovodWorker", "MiniSettings", "RayExecutor", "WorkerError"]
