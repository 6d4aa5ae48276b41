"""The `queued` Spark sink: `df.write.format("queued").mode("append")` enqueues each row's
`data` into running servers over MessagePack-RPC.

Owns turning write partitions into batched puts through the blocking `queued.client.Client`
(one per partition, with the TLS and login options; its failover moves a put to the next
server when one fails): rows grouped by queue with Arrow compute (a queue's rows keep
their order within the partition), bad rows refused with a message that says what to
do, at-least-once delivery. The data source class that hands it out lives in `queued.spark.source`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType

from queued.client.common import (
    AuthFailed,
    ClientError,
    ConnectionFailed,
    ItemTooLarge,
    JournalFull,
    PermissionDenied,
    QueueFull,
    RpcCallError,
    TooLarge,
    Unauthenticated,
)
from queued.client.credentials import tls_files_context
from queued.client.servers import parse_servers
from queued.journal import format as jf
from queued.spark.options import (
    WRITE_OPTIONS,
    Options,
    QueuedDataSourceError,
    bool_option,
    float_option,
    int_option,
)

if TYPE_CHECKING:  # imported by the task itself: planning does not need the client
    from queued.client import Client

log = logging.getLogger("queued.spark")

#: Items per put. 5000 x 200 B puts make 1.2x the rows/s of 1000 (bench/spark_write_bench.py):
#: the server's cost per put (parse, fsync, reply) is then spread over more items.
DEFAULT_WRITE_BATCH = 5000
DEFAULT_WRITE_BATCH_BYTES = 8 << 20
DEFAULT_CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class WriteCommit(WriterCommitMessage):
    rows: int  #: rows put (acknowledged by a server)
    puts: int  #: put calls answered
    skipped: int = 0  #: rows with a null `data` skipped (option skip_null_data)


class PutFailed(QueuedDataSourceError):
    """A server refused a put (an item too large, a full queue, ...), or none answered."""


def _refused(queue: str, items: list[bytes], servers: str, exc: ClientError) -> PutFailed:
    """The error a task fails with when a put fails: what, where, and what to do."""
    where = f"a put of {len(items)} items into queue {queue!r}"
    if isinstance(exc, ConnectionFailed):
        return PutFailed(f"the queued sink cannot reach option server {servers!r} ({where}): "
                         f"{exc}")
    if isinstance(exc, ItemTooLarge):
        hint = (f"its largest item has {max(map(len, items), default=0)} bytes; raise the "
                "server's or the queue's max_item_size, or filter out the big rows")
    elif isinstance(exc, TooLarge):
        hint = (f"the request has {sum(map(len, items))} bytes of items, over the server's "
                "rpc_max_frame or rpc_max_batch: lower option batch_bytes or batch_size")
    elif isinstance(exc, QueueFull):
        hint = "the queue is at its max_items or max_size; consume it or raise the limit"
    elif isinstance(exc, JournalFull):
        hint = "the server's max_journal_size is reached"
    elif isinstance(exc, AuthFailed):
        hint = "check options user and password"
    elif isinstance(exc, Unauthenticated):
        hint = "the server has users: give options user and password"
    elif isinstance(exc, PermissionDenied):
        hint = "grant the user put on the queue in the server's users file"
    elif isinstance(exc, RpcCallError):
        hint = "see the server's log"
    else:
        return PutFailed(f"{where} on {servers} failed: {exc} (rows put before it are "
                         "stored; a retried task puts them again)")
    return PutFailed(f"{where} on {servers} was refused: {exc} ({hint})")


# -- the writer -------------------------------------------------------------------------------


def _as_binary(column: pa.Array) -> pa.Array:
    """The data column with bytes values (strings are their UTF-8, without a copy)."""
    t = column.type
    if pa.types.is_string(t):
        return column.cast(pa.binary())
    if pa.types.is_large_string(t):
        return column.cast(pa.large_binary())
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return column.cast(pa.binary())  # view types
    return column


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


def _headers_of(rows: list[Any]) -> list[dict[str, bytes | str] | None]:
    """The `headers` column's values as put takes them (a map or None per row)."""
    out: list[dict[str, bytes | str] | None] = []
    for pairs in rows:
        if not pairs:
            out.append(None)
            continue
        headers = {p["key"]: p["value"] for p in pairs}
        if len(headers) != len(pairs):
            raise QueuedDataSourceError("the queued sink's column `headers`: a row gives a "
                                        "key twice (an item's headers are a map)")
        out.append(headers)
    return out


class QueuedWriter(DataSourceArrowWriter):
    """Each partition opens a client and puts its rows in batches (at-least-once: a
    retried task puts its rows again)."""

    def __init__(self, options: Any, schema: StructType) -> None:
        if not isinstance(options, Options):
            options = Options(options, WRITE_OPTIONS, "df.write")
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

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        from queued.client import Client

        tls = None
        if self.tls:
            try:
                tls = tls_files_context(self.tls_ca, self.tls_cert, self.tls_key)
            except ValueError as exc:
                raise QueuedDataSourceError(f"the queued sink's TLS options: {exc}") from None
        with Client(self.servers, connect_timeout=self.connect_timeout,
                    read_timeout=self.timeout, tls=tls, user=self.user,
                    password=self.password) as client:
            state = _PartitionWrite(self, client)
            for batch in iterator:
                state.add_batch(batch)
            state.finish()
        return WriteCommit(state.stored, state.puts, state.skipped)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, WriteCommit)]
        rows, skipped = sum(m.rows for m in done), sum(m.skipped for m in done)
        log.info("queued sink: %d rows put in %d puts by %d tasks", rows,
                 sum(m.puts for m in done), len(done))
        if skipped:
            log.warning("queued sink: %d rows with a null data were skipped (skip_null_data)",
                        skipped)


class QueuedStreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("queued")`: each micro-batch's partitions are put as the batch
    writer puts them (same options). Delivery is at-least-once: a micro-batch that did not
    finish (a killed query, a failed task) is run again whole after a restart, and puts
    again the rows its first run had put. A micro-batch Spark committed is not run again."""

    def __init__(self, options: Any, schema: StructType) -> None:
        self.sink = QueuedWriter(options, schema)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        return self.sink.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, WriteCommit)]
        log.info("queued sink: micro-batch %d: %d rows put in %d puts by %d tasks", batchId,
                 sum(m.rows for m in done), sum(m.puts for m in done), len(done))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, WriteCommit)]
        log.warning("queued sink: micro-batch %d failed after %d rows were put; a restart "
                    "puts the whole micro-batch again (at-least-once)", batchId,
                    sum(m.rows for m in done))


class _PartitionWrite:
    """One task's rows on their way to the server: per queue, items waiting for a full put."""

    def __init__(self, writer: QueuedWriter, client: Client) -> None:
        self.w = writer
        self.client = client
        self.stored = 0  # items the servers acknowledged
        self.puts = 0
        self.pending: dict[str, list[bytes]] = {}
        self.pending_bytes: dict[str, int] = {}
        #: with a `headers` column: each pending item's headers (None: none)
        self.pending_headers: dict[str, list[dict[str, bytes | str] | None]] = {}
        self.checked: set[str] = set()  # queue names of the queue column found valid
        self.skipped = 0
        self.rows = 0  # rows seen (for error messages)

    def add_batch(self, batch: pa.RecordBatch) -> None:
        w = self.w
        n = batch.num_rows
        if not n:
            return
        data = _as_binary(batch.column("data"))
        queues = batch.column("queue") if w.has_queue_column else None
        headers = batch.column("headers") if w.has_headers_column else None
        if data.null_count:
            if not w.skip_null_data:
                first = self.rows + data.is_null().to_pylist().index(True)
                raise QueuedDataSourceError(
                    f"the queued sink got {data.null_count} rows with a null `data` in a batch "
                    f"of {n} (the first is row {first} of this partition; rows before it may "
                    "already be stored): filter them out, or set "
                    '.option("skip_null_data", "true") to skip them')
            valid = data.is_valid()
            self.skipped += data.null_count
            data = data.filter(valid)
            if queues is not None:
                queues = queues.filter(valid)
            if headers is not None:
                headers = headers.filter(valid)
        self.rows += n
        if queues is None:
            assert w.queue is not None
            self._add(w.queue, data, headers)
            return
        if queues.null_count:
            if not w.queue:
                raise QueuedDataSourceError(
                    f"the queued sink got {queues.null_count} rows with a null `queue` and "
                    "there is no .option('queue', ...) default for them")
            queues = pc.fill_null(queues, w.queue)
        encoded = queues.dictionary_encode()
        names: list[str] = encoded.dictionary.to_pylist()
        for name in names:
            if name not in self.checked:
                if not jf.valid_name(name):
                    raise QueuedDataSourceError(f"bad queue name {name!r} in column `queue`")
                self.checked.add(name)
        if len(names) == 1:
            self._add(names[0], data, headers)
            return
        # A stable sort by queue keeps each queue's rows in their order.
        order = pc.array_sort_indices(encoded.indices)
        grouped = data.take(order)
        grouped_headers = None if headers is None else headers.take(order)
        counts = pc.value_counts(encoded.indices)
        per_index = dict(zip(counts.field("values").to_pylist(),
                             counts.field("counts").to_pylist(), strict=True))
        start = 0
        for k, name in enumerate(names):
            count = per_index[k]
            self._add(name, grouped.slice(start, count),
                      None if grouped_headers is None else grouped_headers.slice(start, count))
            start += count

    def _add(self, queue: str, data: pa.Array, headers: pa.Array | None = None) -> None:
        """Queue rows' items, sending every full put."""
        w = self.w
        if headers is not None:  # (each pending item's headers beside it, in a list apart)
            self.pending_headers.setdefault(queue, []).extend(_headers_of(headers.to_pylist()))
        items: list[bytes] = data.to_pylist()
        nbytes = pc.sum(pc.binary_length(data)).as_py() or 0
        pending = self.pending.setdefault(queue, [])
        size = self.pending_bytes.get(queue, 0)
        if size + nbytes < w.batch_bytes:  # the common case: cut by count only
            cut = False
            while len(pending) + len(items) >= w.batch:
                take = w.batch - len(pending)
                pending.extend(items[:take])
                items = items[take:]
                self._send(queue, pending)
                pending = self.pending[queue] = []
                cut = True
            pending.extend(items)
            self.pending_bytes[queue] = sum(map(len, pending)) if cut else size + nbytes
            return
        for item in items:  # big items: cut by bytes too
            pending.append(item)
            size += len(item)
            if len(pending) >= w.batch or size >= w.batch_bytes:
                self._send(queue, pending)
                pending = self.pending[queue] = []
                size = 0
        self.pending_bytes[queue] = size

    def _send(self, queue: str, items: list[bytes]) -> None:
        if items:
            headers = None
            if queue in self.pending_headers:  # the first len(items) are these items'
                waiting = self.pending_headers[queue]
                headers, waiting[:len(items)] = waiting[:len(items)], []
            try:
                self.stored += self.client.put(queue, items, self.w.expiration_ms,
                                               delay_ms=self.w.delay_ms, headers=headers)
            except ValueError as exc:  # (headers the client refuses before sending)
                raise QueuedDataSourceError(f"the queued sink's column `headers`: {exc}") from exc
            except ClientError as exc:
                raise _refused(queue, items, self.w.servers, exc) from exc
            self.puts += 1

    def finish(self) -> None:
        for queue, items in self.pending.items():
            self._send(queue, items)
        self.pending.clear()
        self.pending_bytes.clear()
