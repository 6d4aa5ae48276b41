"""Turn a queued archive directory (or a data directory) into Parquet, partitioned by
queue and day, and print per-queue counts, bytes and time ranges.

    spark-submit deploy/spark/journal_to_parquet.py ARCHIVE_DIR OUT_DIR [--queues a,b]
    python deploy/spark/journal_to_parquet.py ARCHIVE_DIR OUT_DIR      # local[*] session

Needs `pip install 'queued[spark]'` on the driver and the executors. Re-running over
the same archive overwrites the days it writes (dynamic partition overwrite).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def convert(spark: Any, source: str, out: str, queues: str | None = None) -> list[Any]:
    """Write the Parquet dataset; return one summary row per queue."""
    from pyspark.sql import functions as F

    from queued.spark import register

    register(spark)
    reader = spark.read.format("queued")
    if queues:
        reader = reader.option("queues", queues)
    df = reader.load(source).withColumn("day", F.to_date("add_time"))
    (df.write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
     .partitionBy("queue", "day").parquet(out))
    written = spark.read.parquet(out)
    if queues:
        written = written.where(F.col("queue").isin(queues.split(",")))
    return (written.groupBy("queue")
            .agg(F.count("*").alias("items"), F.sum(F.length("data")).alias("bytes"),
                 F.min("add_time").alias("first_add_time"),
                 F.max("add_time").alias("last_add_time"))
            .orderBy("queue").collect())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="an archive_dir or a data directory")
    parser.add_argument("out", help="the Parquet output directory")
    parser.add_argument("--queues", help="comma list of queues (default: all)")
    parser.add_argument("--master", default=None, help="default: spark-submit's, else local[*]")
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("queued-journal-to-parquet")
    if args.master:
        builder = builder.master(args.master)
    elif not _under_spark_submit():
        # Run as a plain script: the workers use this interpreter (which has queued).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.master("local[*]").config("spark.ui.enabled", "false")
    spark = builder.getOrCreate()
    try:
        rows = convert(spark, args.source, args.out, args.queues)
    finally:
        spark.stop()
    print(f"{'queue':<24} {'items':>12} {'bytes':>14}  first add_time -> last add_time")
    for r in rows:
        print(f"{r['queue']:<24} {r['items']:>12} {r['bytes'] or 0:>14}  "
              f"{r['first_add_time']} -> {r['last_add_time']}")
    return 0


def _under_spark_submit() -> bool:
    return "SPARK_SUBMIT_OPTS" in os.environ or "PYSPARK_GATEWAY_PORT" in os.environ


if __name__ == "__main__":
    sys.exit(main())
