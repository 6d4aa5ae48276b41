"""The `queued` Spark sink: `df.write.format("queued").mode("append")` and
`df.writeStream.format("queued")` enqueue each row's `data` into running servers over
MessagePack-RPC.

Owns the sink's options and columns, one blocking `queued.client.Client` per task (with
the TLS and login options), and what the driver logs of a write. A task's rows become
puts in `queued.spark.partition_write`; exactly-once puts (streams; batch writes with an
`idempotency_key`) are `queued.spark.exactly_once`'s. The data source class that hands the
writers out lives in `queued.spark.source`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from queued.client.credentials import tls_files_context
from queued.client.servers import parse_servers
from queued.journal import format as jf
from queued.spark.exactly_once import ExactlyOnceSender, task_run_key
from queued.spark.options import (
    WRITE_OPTIONS,
    Options,
    QueuedDataSourceError,
    bool_option,
    float_option,
    int_option,
)
from queued.spark.partition_write import (
    AtLeastOnceSender,
    Layout,
    PartitionWrite,
    PutFailed,
    Sender,
)
from queued.spark.task_input import InputEnd

__all__ = ["PutFailed", "QueuedStreamWriter", "QueuedWriter", "WriteCommit"]

log = logging.getLogger("queued.spark")

#: Items per put. 5000 x 200 B puts make 1.2x the rows/s of 1000 (bench/spark_write_bench.py):
#: the server's cost per put (parse, fsync, reply) is then spread over more items.
DEFAULT_WRITE_BATCH = 5000
DEFAULT_WRITE_BATCH_BYTES = 8 << 20
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds an exactly-once put is sent again while its server does not answer (restarting).
DEFAULT_DELIVERY_TIMEOUT = 120.0


@dataclass(frozen=True)
class WriteCommit(WriterCommitMessage):
    rows: int  #: rows put (stored by a server now)
    puts: int  #: put calls answered
    skipped: int = 0  #: rows with a null `data` skipped (option skip_null_data)
    #: rows an earlier run of this write had stored: answered as repeats, not stored again
    found: int = 0
    #: chunks an earlier run stored with other rows (the re-run's rows differ; see README)
    diverged: int = 0


def _summary(messages: list[WriterCommitMessage | None]) -> tuple[int, int, int, int, int, int]:
    """(rows, puts, tasks, skipped, found, diverged) of a write's commit messages."""
    done = [m for m in messages if isinstance(m, WriteCommit)]
    return (sum(m.rows for m in done), sum(m.puts for m in done), len(done),
            sum(m.skipped for m in done), sum(m.found for m in done),
            sum(m.diverged for m in done))


_INTEGERS = (ByteType, ShortType, IntegerType, LongType)


def _check_headers_type(t: Any) -> None:
    """The optional `headers` column: array<struct<key: string, value: binary or string>>,
    the Kafka source's (includeHeaders gives it)."""
    element = t.elementType if isinstance(t, ArrayType) else None
    if not (isinstance(element, StructType) and element.fieldNames() == ["key", "value"]
            and isinstance(element["key"].dataType, StringType)
            and isinstance(element["value"].dataType, BinaryType | StringType)):
        raise QueuedDataSourceError(
            "the queued sink's column `headers` must be array<struct<key: string, value: "
            f"binary>> (as the Kafka source's; value may be a string), not {t.simpleString()}")


class QueuedWriter(DataSourceArrowWriter):
    """Each partition opens a client and puts its rows in chunks: at-least-once (a retried
    task puts its rows again), or exactly-once with option `idempotency_key` (and for
    streams, `QueuedStreamWriter`)."""

    def __init__(self, options: Any, schema: StructType, *, stream: bool = False) -> None:
        if not isinstance(options, Options):
            options = Options(options, WRITE_OPTIONS, "df.write")
        self.stream = stream
        self.servers = options.get("server")
        if not self.servers:
            raise QueuedDataSourceError(
                'the queued sink needs .option("server", "host:2229") (a comma list for several, '
                'or dns://NAME:2229 for every address of a DNS name)')
        try:
            parse_servers(self.servers)
        except ValueError as exc:
            raise QueuedDataSourceError(f"option server {self.servers!r}: {exc}") from None
        self.queue = options.get("queue") or None
        names = set(schema.fieldNames())
        if "data" not in names:
            raise QueuedDataSourceError(
                f"the queued sink needs a column `data` (binary or string); got {sorted(names)}")
        data_type = schema["data"].dataType
        if not isinstance(data_type, BinaryType | StringType):
            raise QueuedDataSourceError(
                f"the queued sink's column `data` must be binary or string, not "
                f"{data_type.simpleString()}")
        self.has_queue_column = "queue" in names
        if self.has_queue_column and not isinstance(schema["queue"].dataType, StringType):
            raise QueuedDataSourceError(
                f"the queued sink's column `queue` must be a string, not "
                f"{schema['queue'].dataType.simpleString()}")
        if not self.has_queue_column and not self.queue:
            raise QueuedDataSourceError(
                'the queued sink needs a `queue` column or .option("queue", name)')
        if self.queue and not jf.valid_name(self.queue):
            raise QueuedDataSourceError(f"bad queue name {self.queue!r} in option queue")
        self.has_delay_column = "delay" in names
        if self.has_delay_column and not isinstance(schema["delay"].dataType, _INTEGERS):
            raise QueuedDataSourceError(
                f"the queued sink's column `delay` must be an integer (ms), not "
                f"{schema['delay'].dataType.simpleString()}")
        self.has_headers_column = "headers" in names
        if self.has_headers_column:
            _check_headers_type(schema["headers"].dataType)
        self.batch = int_option(options, "batch_size", DEFAULT_WRITE_BATCH)
        self.batch_bytes = int_option(options, "batch_bytes", DEFAULT_WRITE_BATCH_BYTES)
        raw_expiration = options.get("expiration_ms") or "0"
        try:
            self.expiration_ms = int(raw_expiration)
        except ValueError:
            self.expiration_ms = -1
        if self.expiration_ms < 0:
            raise QueuedDataSourceError(
                f"option expiration_ms must be a whole number of ms >= 0 (0 = never), not "
                f"{raw_expiration!r}")
        raw_delay = options.get("delay_ms") or "0"
        try:
            self.delay_ms = int(raw_delay)
        except ValueError:
            self.delay_ms = -1
        if not 0 <= self.delay_ms <= jf.MAX_DELAY_MS:
            raise QueuedDataSourceError(
                f"option delay_ms must be a whole number of ms in [0, {jf.MAX_DELAY_MS}] "
                f"(0 = none; the rows' items stay invisible that long), not {raw_delay!r}")
        self.timeout = float_option(options, "timeout", 30.0)
        self.connect_timeout = float_option(options, "connect_timeout",
                                             DEFAULT_CONNECT_TIMEOUT)
        self.skip_null_data = bool_option(options, "skip_null_data")
        # TLS files are read by each task (on the executors), where the context is made:
        # an ssl.SSLContext does not pickle.
        self.tls_ca = options.get("tls_ca") or None
        self.tls_cert = options.get("tls_cert") or None
        self.tls_key = options.get("tls_key") or None
        self.tls = bool_option(options, "tls") or bool(self.tls_ca or self.tls_cert)
        if self.tls_key and not self.tls_cert:
            raise QueuedDataSourceError("option tls_key needs option tls_cert (the client "
                                        "certificate it belongs to)")
        self.user = options.get("user") or None
        self.password = options.get("password")
        if (self.user is None) != (self.password is None):
            raise QueuedDataSourceError("options user and password: give both (a login on "
                                        "servers with a users file) or neither")
        self.delivery_timeout = float_option(options, "delivery_timeout",
                                             DEFAULT_DELIVERY_TIMEOUT)
        self.idempotency_key = options.get("idempotency_key") or None
        if stream and self.idempotency_key:
            raise QueuedDataSourceError(
                "option idempotency_key is for df.write: a stream's puts are exactly-once "
                "by its query and micro-batch ids")
        if stream:  # exactly-once unless option exactly_once is false
            self.exactly_once = ("exactly_once" not in options
                                 or bool_option(options, "exactly_once"))
        else:
            self.exactly_once = self.idempotency_key is not None

    def layout(self) -> Layout:
        return Layout(self.servers, self.queue, self.has_queue_column, self.has_delay_column,
                      self.delay_ms, self.batch, self.batch_bytes, self.skip_null_data,
                      self.has_headers_column)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        from queued.client import Client

        tls = None
        if self.tls:
            try:
                tls = tls_files_context(self.tls_ca, self.tls_cert, self.tls_key)
            except ValueError as exc:
                raise QueuedDataSourceError(f"the queued sink's TLS options: {exc}") from None
        run = task_run_key(self.stream, self.idempotency_key) if self.exactly_once else None
        with Client(self.servers, connect_timeout=self.connect_timeout,
                    read_timeout=self.timeout, tls=tls, user=self.user,
                    password=self.password, delivery_timeout=self.delivery_timeout) as client:
            sender: Sender
            if run is None:
                sender = AtLeastOnceSender(client, self.expiration_ms)
                state = PartitionWrite(self.layout(), sender, lambda queue, delay: b"")
            else:
                sender = ExactlyOnceSender(client, run, self.expiration_ms)
                state = PartitionWrite(self.layout(), sender, run.group)
            end = InputEnd(iterator) if run is not None else None
            for batch in iterator:
                state.add_batch(batch)
            if end is not None and end.truncated():
                # Its last chunks would be cut shorter than the re-run's (stored twice).
                raise QueuedDataSourceError(
                    "the queued sink's input ended early (the task failed before the sink): "
                    "its last rows are not put; the task's re-run puts them")
            state.finish()
        return WriteCommit(sender.stored, sender.puts, state.skipped, sender.found,
                           sender.diverged)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows, puts, tasks, skipped, found, diverged = _summary(messages)
        log.info("queued sink: %d rows put in %d puts by %d tasks", rows, puts, tasks)
        if skipped:
            log.warning("queued sink: %d rows with a null data were skipped (skip_null_data)",
                        skipped)
        _report_rerun(f"the write with idempotency_key {self.idempotency_key!r}", found,
                      diverged)


def _report_rerun(what: str, found: int, diverged: int) -> None:
    if found:
        log.warning("queued sink: %s: %d rows were stored before (by an earlier run of it, "
                    "or by a put sent again after its server restarted) and were not stored "
                    "again", what, found)
    if diverged:
        log.warning("queued sink: %s had run before with other rows in %d chunks (a plan "
                    "whose re-run gives other rows, or the rows in another order: a shuffle, "
                    "a nondeterministic expression): this run's rows are stored, and rows of "
                    "the earlier run in those chunks may be there twice. Nothing is lost. A "
                    "sortWithinPartitions before the sink makes such a plan repeatable",
                    what, diverged)


class QueuedStreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("queued")`: each micro-batch's partitions are put as the batch
    writer puts them (same options), exactly-once: the producer ids of its puts come from
    the query's id, the micro-batch's id, the partition, the queue and the rows (see
    `queued.spark.exactly_once`), so a micro-batch run again (a failed task, a restart
    from the checkpoint) stores nothing its first run stored. `exactly_once` false:
    at-least-once puts that fail over between servers."""

    def __init__(self, options: Any, schema: StructType) -> None:
        self.sink = QueuedWriter(options, schema, stream=True)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        return self.sink.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rows, puts, tasks, _, found, diverged = _summary(messages)
        log.info("queued sink: micro-batch %d: %d rows put in %d puts by %d tasks", batchId,
                 rows, puts, tasks)
        _report_rerun(f"micro-batch {batchId}", found, diverged)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rows = _summary(messages)[0]
        if self.sink.exactly_once:
            log.warning("queued sink: micro-batch %d failed after %d rows were put; its re-run "
                        "stores only the rest", batchId, rows)
        else:
            log.warning("queued sink: micro-batch %d failed after %d rows were put; a restart "
                        "puts the whole micro-batch again (at-least-once)", batchId, rows)
