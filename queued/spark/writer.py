"""The `queued` Spark sink: `df.write.format("queued").mode("append")` enqueues each row's
`data` into a running server over MessagePack-RPC.

Owns turning write partitions into batched puts (one connection per partition,
at-least-once). The data source class that hands it out lives in `queued.spark.source`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from queued import journal_format as jf
from queued.spark.options import QueuedDataSourceError, int_option

DEFAULT_WRITE_BATCH = 1000
DEFAULT_WRITE_BATCH_BYTES = 8 << 20

@dataclass(frozen=True)
class WriteCommit(WriterCommitMessage):
    rows: int
    puts: int


class QueuedWriter(DataSourceArrowWriter):
    """Each partition opens one connection and puts its rows in batches (at-least-once:
    a retried task puts its rows again)."""

    def __init__(self, options: Any, schema: StructType) -> None:
        self.servers = options.get("server") or options.get("servers")
        if not self.servers:
            raise QueuedDataSourceError(
                'the queued sink needs .option("server", "host:2229") (a comma list for several)')
        self.queue = options.get("queue")
        names = set(schema.fieldNames())
        if "data" not in names:
            raise QueuedDataSourceError(
                f"the queued sink needs a column `data` (binary or string); got {sorted(names)}")
        self.has_queue_column = "queue" in names
        if not self.has_queue_column and not self.queue:
            raise QueuedDataSourceError(
                'the queued sink needs a `queue` column or .option("queue", name)')
        if self.queue and not jf.valid_name(self.queue):
            raise QueuedDataSourceError(f"bad queue name {self.queue!r}")
        self.batch = int_option(options, "batch_size", DEFAULT_WRITE_BATCH)
        self.batch_bytes = int_option(options, "batch_bytes", DEFAULT_WRITE_BATCH_BYTES)
        self.expiration_ms = int(options.get("expiration_ms", 0) or 0)
        self.timeout = float(options.get("timeout", 30.0))

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        from queued.client import Client

        rows = puts = 0
        pending: dict[str, list[bytes | str]] = {}
        sizes: dict[str, int] = {}
        with Client(self.servers, read_timeout=self.timeout) as client:

            def flush(queue: str) -> None:
                nonlocal puts
                items = pending.pop(queue, [])
                sizes.pop(queue, None)
                if items:
                    client.put(queue, items, self.expiration_ms)
                    puts += 1

            for batch in iterator:
                data = batch.column("data").to_pylist()
                if self.has_queue_column:
                    queues = batch.column("queue").to_pylist()
                else:
                    queues = [self.queue] * len(data)
                for queue, item in zip(queues, data, strict=True):
                    if item is None:
                        continue  # a null row has nothing to enqueue
                    q = queue or self.queue
                    if not q:
                        raise QueuedDataSourceError(
                            "a row has a null queue and no .option('queue', ...) default")
                    items = pending.setdefault(q, [])
                    items.append(item)
                    sizes[q] = sizes.get(q, 0) + len(item)
                    rows += 1
                    if len(items) >= self.batch or sizes[q] >= self.batch_bytes:
                        flush(q)
            for q in list(pending):
                flush(q)
        return WriteCommit(rows, puts)
