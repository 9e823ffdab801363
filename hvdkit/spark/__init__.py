"""Horovod on Spark: ``horovod.spark.run``'s API (Horovod 0.28.1) on today's pyspark, for
functions that use ``hvdkit.torch`` or ``hvdkit.keras``::

    from pyspark.sql import SparkSession
    import hvdkit.spark

    spark = SparkSession.builder.master("spark://head:7077").getOrCreate()
    results = hvdkit.spark.run(train, args=(config,), num_proc=4)   # one result per rank

Importing this module needs no pyspark; calling :func:`run` does (``pip install
'hvdkit[spark]'``). See :func:`run` for what differs from Horovod.
"""

from hvdkit.spark.runner import TaskError, run

__all__ = ["TaskError", "run"]
