"""queued as a PySpark data source: `spark.read/readStream.format("queued")`, `df.write`.

Owns nothing but the import check. The source lives in `queued.spark.source`, the sink
in `queued.spark.sink`, option parsing in `queued.spark.options`, and the file
scanning (no pyspark) in `queued.storage.journal_scan`. Needs `pip install 'queued[spark]'`.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401
    import pyspark.sql.datasource  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "queued.spark needs pyspark >= 4.0 and pyarrow: pip install 'queued[spark]' "
        f"(import failed: {exc})"
    ) from exc

from queued.spark.options import QueuedDataSourceError
from queued.spark.source import SCHEMA, QueuedDataSource, register

__all__ = ["SCHEMA", "QueuedDataSource", "QueuedDataSourceError", "register"]
