"""A Spark driver for the streaming sink's fault tests (tests/test_spark_exactly_once.py):
one query, `spark.readStream.format("queued")` over a journal directory of 1500 rows into
`writeStream.format("queued")`, with faults injected into its micro-batches.

    python tests/spark_sink_driver.py JOURNAL SERVER WORKDIR [--pause]

Trigger.AvailableNow, 3 micro-batches of 500 rows, 2 partitions each, 50-row chunks,
local[2,4] (a failed task runs again, up to 4 attempts). Each row goes to the queue named
after the fault its micro-batch and partition meet, once the server holds that
partition's first two chunks (the sink stored some of its rows, not all):

- micro-batch 1, partition 1, queue `retry`: its first attempt raises; Spark runs the
  task again, which puts the whole partition again.
- micro-batch 1, partition 0, queue `diverge`: as retry, and the second attempt gives
  the rows in reverse order (a plan whose re-run differs: a shuffle, a nondeterministic
  expression).
- micro-batch 2, queue `killed`: with `--pause`, partition 0 writes WORKDIR/killed.paused
  and sleeps, for the test to SIGKILL this driver; run again without it, the query goes
  on from its checkpoint (micro-batch 2 again).
- micro-batch 0, queue `steady`: no fault.

Each partition that gives all its rows writes them to WORKDIR/QUEUE.BATCH.PARTITION.rows
(what the queue must hold once); `retry` and `diverge` write WORKDIR/QUEUE.failed-once
when their first attempt raised. Standalone: never imports pytest.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROWS = 1500
ROWS_PER_BATCH = 500
CHUNK = 50


def queue_of(batch: int, partition: int) -> str:
    if batch == 1:
        return "diverge" if partition == 0 else "retry"
    return "killed" if batch == 2 else "steady"


def fault_fn(server: str, work: str, pause: bool) -> Any:
    def fn(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        from queued.client import Client

        tc = TaskContext.get()
        batch, part = int(tc.getLocalProperty("streaming.sql.batchId")), tc.partitionId()
        queue = queue_of(batch, part)
        fault = (queue in ("retry", "diverge") or (queue == "killed" and pause and part == 0))
        rows = pa.Table.from_batches(list(batches), schema=pa.schema([("data", pa.binary())]))
        if queue == "diverge" and tc.attemptNumber() > 0:
            rows = rows.take(pa.array(range(rows.num_rows - 1, -1, -1)))
        data = rows.column("data").to_pylist()
        queues = pa.array([queue] * rows.num_rows, pa.string())
        out = pa.Table.from_arrays([queues, rows.column("data")], ["queue", "data"])
        if not fault or tc.attemptNumber() > 0:
            yield from out.to_batches(20)
            Path(work, f"{queue}.{batch}.{part}.rows").write_bytes(b"\n".join(data))
            return
        deadline = time.monotonic() + 120
        with Client(server) as client:
            def two_chunks_stored() -> bool:
                """Whether the sink stored this partition's first two chunks."""
                stored = {it.data for it in client.browse(queue, 0, 10_000)}
                return all(row in stored for row in data[:2 * CHUNK])

            for k, piece in enumerate(out.to_batches(20)):
                yield piece
                if 20 * (k + 1) >= 2 * CHUNK and two_chunks_stored():
                    break
            while not two_chunks_stored():
                if time.monotonic() > deadline:
                    raise RuntimeError("the sink did not store two chunks in time")
                time.sleep(0.05)
        if queue == "killed":
            Path(work, "killed.paused").touch()
            while time.monotonic() < deadline:
                time.sleep(0.2)  # the test kills this driver meanwhile
            raise RuntimeError("not killed in time")
        Path(work, f"{queue}.failed-once").touch()
        raise RuntimeError(f"injected fault ({queue}) in the first attempt")
    return fn


def main() -> None:
    journal, server, work, *flags = sys.argv[1:]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2,4]").appName("queued-sink-faults")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20")
             # Python workers flush their output every 1 KiB, not 64: a task's rows reach
             # the sink as the fault function yields them.
             .config("spark.buffer.size", "1024")
             .config("spark.driver.memory", "512m")
             # A short-lived JVM (as the suite's session, tests/conftest.py): C1 only, one
             # GC thread.
             .config("spark.driver.extraJavaOptions",
                     "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xss4m")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = (spark.readStream.format("queued").option("maxOffsetsPerTrigger", ROWS_PER_BATCH)
          .option("minPartitions", 2).load(journal).select("data")
          .mapInArrow(fault_fn(server, work, "--pause" in flags), "queue string, data binary"))
    q = (df.writeStream.format("queued").option("server", server)
         .option("batch_size", CHUNK).option("delivery_timeout", "60")
         .option("checkpointLocation", str(Path(work) / "checkpoint"))
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    if q.exception() is not None:
        raise SystemExit(f"the query failed: {q.exception()}")
    spark.stop()


if __name__ == "__main__":
    main()
