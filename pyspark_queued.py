"""Auto-registration of the `queued` Spark data source.

PySpark (>= 4.0) imports every top-level module named `pyspark_*` that it finds on the
Python path and registers its `DefaultSource`, so once queued is installed with the
`spark` extra, `spark.read.format("queued")` works without `spark.dataSource.register`.
"""

from queued.spark import QueuedDataSource as DefaultSource

__all__ = ["DefaultSource"]
