"""The SparkSession the Spark benchmarks run on: local[2], UI off, 2 GiB of driver memory,
the `queued` source registered. A session already active in this process (the test
suite's, when the smoke test runs a Spark benchmark in-process) is used as it is and left
running.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_ours: list[Any] = []  # the sessions spark_session() built (spark_done() stops those)


def spark_session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    from queued.spark import register

    register(spark)
    _ours.append(spark)
    return spark


def spark_done(spark: Any) -> None:
    """Stops `spark` if spark_session() built it."""
    if spark in _ours:
        _ours.remove(spark)
        spark.stop()
