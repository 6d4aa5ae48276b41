"""The `queued` Spark sink: `df.write.format("queued").mode("append")` enqueues each row's
`data` into a running server over MessagePack-RPC.

Owns turning write partitions into batched, pipelined puts: one connection per partition,
rows grouped by queue with Arrow compute (a queue's rows keep their order within the
partition), up to `max_inflight` puts sent before the oldest is answered (the server runs
the puts of one connection in the order they arrive), bad rows refused with a message
that says what to do, at-least-once delivery. The data source class that hands it out
lives in `queued.spark.source`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from queued import journal_format as jf
from queued.client_common import (
    FAILOVER,
    RECV,
    BadResponse,
    ClientError,
    ConnectionFailed,
    ItemTooLarge,
    JournalFull,
    Msgids,
    QueueFull,
    RpcCallError,
    Timeout,
    TooLarge,
    call_error,
    make_parser,
    parse_servers,
)
from queued.rpc_protocol import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    ConnectionClosed,
    Notification,
    Response,
    RpcError,
    encode_request,
)
from queued.spark.options import QueuedDataSourceError, int_option

log = logging.getLogger("queued.spark")

#: Items per put. 5000 x 200 B puts make 1.2x the rows/s of 1000 (bench/spark_write_bench.py):
#: the server's cost per put (parse, fsync, reply) is then spread over more items.
DEFAULT_WRITE_BATCH = 5000
DEFAULT_WRITE_BATCH_BYTES = 8 << 20
#: Puts sent on a connection before the oldest is answered.
DEFAULT_MAX_INFLIGHT = 4
#: Bytes of unanswered puts kept for a re-send (the window shrinks below max_inflight
#: puts when they are this big).
MAX_INFLIGHT_BYTES = 32 << 20
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Reconnections of one task in all (each re-sends every unanswered put).
MAX_RECONNECTS = 10


@dataclass(frozen=True)
class WriteCommit(WriterCommitMessage):
    rows: int  #: rows put (acknowledged by a server)
    puts: int  #: put calls answered
    skipped: int = 0  #: rows with a null `data` skipped (option skip_null_data)
    resent: int = 0  #: puts re-sent after a broken connection (each may be stored twice)


class PutFailed(QueuedDataSourceError):
    """A server refused a put (an item too large, a full queue, ...): not retried."""


class Unreachable(QueuedDataSourceError):
    """No server could be reached, or the connection kept breaking."""


# -- the pipelined connection ------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Put:
    msgid: int
    queue: str
    frame: bytes
    count: int
    sends: int = 0
    done: bool = False

    def largest(self) -> int:
        """The largest item's bytes (decoded again: only error messages need it)."""
        items = msgpack.unpackb(self.frame)[3][1]
        return max(map(len, items), default=0)


class PipelinedPutter:
    """Puts on one connection to one server, up to `window` unanswered at a time.

    The server runs the calls of one connection in the order they arrive, so the items of
    a queue are stored in the order of the put calls. Replies are matched by msgid.

    When the connection fails (refused, reset, closed, no reply within `timeout`
    seconds, or a SHUTTING_DOWN or BUSY reply), every put not yet answered is sent again,
    in order, on a fresh connection to the next server of the list (the same one when
    there is one): at-least-once, as a put whose reply was lost may be stored twice.
    Each server is tried once per failure before giving up (Unreachable), and a task
    reconnects at most MAX_RECONNECTS times. Any other error reply (ITEM_TOO_LARGE,
    QUEUE_FULL, ...) raises PutFailed at once; puts sent after it may have been stored.
    """

    def __init__(self, servers: str, *, timeout: float = 30.0,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 window: int = DEFAULT_MAX_INFLIGHT, window_bytes: int = MAX_INFLIGHT_BYTES,
                 first: int = 0) -> None:
        try:
            self.servers = parse_servers(servers)
        except ValueError as exc:
            raise QueuedDataSourceError(f"option server {servers!r}: {exc}") from None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.window = max(1, window)
        self.window_bytes = window_bytes
        self.index = first % len(self.servers)
        self.sock: socket.socket | None = None
        self.parser = make_parser(DEFAULT_MAX_FRAME, DEFAULT_MAX_BATCH)
        self.msgids = Msgids()
        self.unanswered: dict[int, _Put] = {}
        self.sent: deque[_Put] = deque()  # in sending order, until answered from the left
        self.sent_bytes = 0
        self.stored = 0  # items the servers acknowledged
        self.answered = 0  # puts answered
        self.resent = 0  # puts sent again on a fresh connection
        self.connects = 0
        self.errors: list[ClientError] = []  # failures since the last answer

    @property
    def address(self) -> str:
        return self.servers[self.index][0]

    def __enter__(self) -> PipelinedPutter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def put(self, queue: str, items: list[bytes], expiration_ms: int) -> None:
        """Send one put (items are bytes); waits only while the window is full."""
        msgid = self.msgids.next()
        frame = encode_request(msgid, "put", [queue, items, expiration_ms])
        while self.unanswered and (len(self.unanswered) >= self.window
                                   or self.sent_bytes + len(frame) > self.window_bytes):
            self._receive()
        p = _Put(msgid, queue, frame, len(items))
        self.unanswered[msgid] = p
        self.sent.append(p)
        self.sent_bytes += len(frame)
        if self.sock is None:
            self._reconnect(None)  # sends it too
            return
        try:
            p.sends += 1
            self.sock.settimeout(self.timeout)
            self.sock.sendall(frame)
        except OSError as exc:
            self._reconnect(self._broken("sending a put", exc))

    def drain(self) -> None:
        """Wait until every put is answered."""
        while self.unanswered:
            self._receive()

    # -- plumbing

    def _broken(self, during: str, exc: OSError) -> ClientError:
        if isinstance(exc, TimeoutError):
            return Timeout(f"{self.address}: no progress {during} within {self.timeout:.3g} s",
                           self.address)
        return ConnectionFailed(f"{self.address}: connection broke {during}: {exc}",
                                self.address)

    def _connect(self) -> None:
        address, host, port = self.servers[self.index]
        try:
            sock = socket.create_connection((host, port), self.connect_timeout)
        except OSError as exc:
            raise ConnectionFailed(f"{address}: cannot connect: {exc}", address) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.parser = make_parser(DEFAULT_MAX_FRAME, DEFAULT_MAX_BATCH)

    def _reconnect(self, failure: ClientError | None) -> None:
        """Open a connection (after `failure`: to the next server, after a short pause) and
        send every unanswered put on it, in order."""
        if failure is not None:
            self.close()
            self.errors.append(failure)
        while True:
            if len(self.errors) > len(self.servers) or self.connects > MAX_RECONNECTS:
                raise self._unreachable()
            if self.errors:
                self.index = (self.index + 1) % len(self.servers)
                time.sleep(min(0.05 * len(self.errors), 0.5))
            try:
                self._connect()
            except ConnectionFailed as exc:
                self.errors.append(exc)
                continue
            self.connects += 1
            assert self.sock is not None
            try:
                self.sock.settimeout(self.timeout)
                for p in self.sent:
                    if not p.done:
                        self.resent += p.sends > 0
                        p.sends += 1
                        self.sock.sendall(p.frame)
                return
            except OSError as exc:
                self.close()
                self.errors.append(self._broken("re-sending puts", exc))

    def _unreachable(self) -> Unreachable:
        addresses = ",".join(a for a, _, _ in self.servers)
        detail = "; ".join(str(e) for e in self.errors[-len(self.servers) - 1:])
        if self.answered == 0 and all(isinstance(e, ConnectionFailed) for e in self.errors):
            message = f"the queued sink cannot reach option server {addresses!r}: {detail}"
        else:
            message = (f"the queued sink lost its connection to {addresses!r} and could not "
                       f"re-send {len(self.unanswered)} unanswered puts "
                       f"({self.connects} connections opened): {detail}")
        exc = Unreachable(message)
        if self.errors:
            exc.__cause__ = self.errors[-1]
        return exc

    def _receive(self) -> None:
        """Handle the next reply (or a failure: then everything unanswered was re-sent)."""
        if self.sock is None:
            self._reconnect(None)
        sock = self.sock
        assert sock is not None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                event = self.parser.next_event()
            except RpcError as exc:
                self.close()
                raise BadResponse(f"{self.address}: {exc}") from None
            if event is NEED_DATA:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    sock.settimeout(remaining)
                    data = sock.recv(RECV)
                except OSError as exc:
                    self._reconnect(self._broken("waiting for a reply", exc))
                    return
                self.parser.receive_data(data)
            elif isinstance(event, ConnectionClosed):
                self._reconnect(ConnectionFailed(
                    f"{self.address}: the server closed the connection", self.address))
                return
            elif isinstance(event, Response):
                self._answer(event)
                return
            elif isinstance(event, Notification):
                if event.method == "error" and event.params:
                    self._refused(None, call_error(event.params[0], self.address))
                    return
            else:
                self.close()
                raise BadResponse(f"{self.address}: the server sent a request")

    def _answer(self, response: Response) -> None:
        p = self.unanswered.get(response.msgid)
        if p is None:
            return  # not ours (cannot happen on a fresh connection per re-send)
        if response.error is not None:
            self._refused(p, call_error(response.error, self.address))
            return
        if type(response.result) is not int:
            self.close()
            raise BadResponse(f"{self.address}: put answered {response.result!r:.80}")
        del self.unanswered[response.msgid]
        p.done = True
        self.stored += response.result
        self.answered += 1
        self.errors.clear()
        while self.sent and self.sent[0].done:
            self.sent_bytes -= len(self.sent.popleft().frame)

    def _refused(self, p: _Put | None, exc: RpcCallError) -> None:
        if isinstance(exc, FAILOVER):
            self._reconnect(exc)
            return
        self.close()
        if p is None:
            raise PutFailed(f"the queued sink's connection to {self.address} failed: {exc}")
        where = f"a put of {p.count} items into queue {p.queue!r} on {self.address}"
        if isinstance(exc, ItemTooLarge):
            hint = (f"its largest item has {p.largest()} bytes; raise the server's or the "
                    "queue's max_item_size, or filter out the big rows")
        elif isinstance(exc, TooLarge):
            hint = (f"the request has {len(p.frame)} bytes, over the server's rpc_max_frame "
                    "or rpc_max_batch: lower option batch_bytes or batch_size")
        elif isinstance(exc, QueueFull):
            hint = "the queue is at its max_items or max_size; consume it or raise the limit"
        elif isinstance(exc, JournalFull):
            hint = "the server's max_journal_size is reached"
        else:
            hint = "see the server's log"
        raise PutFailed(f"{where} was refused: {exc} ({hint})") from exc


# -- the writer -------------------------------------------------------------------------------


def _bool_option(options: Any, key: str) -> bool:
    raw = str(options.get(key, "false") or "false").strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise QueuedDataSourceError(f"option {key} must be true or false, not {raw!r}")


def _float_option(options: Any, key: str, default: float) -> float:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise QueuedDataSourceError(f"option {key} must be a number, not {raw!r}") from None
    if not value > 0:
        raise QueuedDataSourceError(f"option {key} must be positive, not {raw!r}")
    return value


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


class QueuedWriter(DataSourceArrowWriter):
    """Each partition opens one connection and pipelines its rows' puts in batches
    (at-least-once: a retried task puts its rows again)."""

    def __init__(self, options: Any, schema: StructType) -> None:
        self.servers = options.get("server") or options.get("servers")
        if not self.servers:
            raise QueuedDataSourceError(
                'the queued sink needs .option("server", "host:2229") (a comma list for several)')
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
        self.batch = int_option(options, "batch_size", DEFAULT_WRITE_BATCH)
        self.batch_bytes = int_option(options, "batch_bytes", DEFAULT_WRITE_BATCH_BYTES)
        self.max_inflight = int_option(options, "max_inflight", DEFAULT_MAX_INFLIGHT)
        raw_expiration = options.get("expiration_ms") or "0"
        try:
            self.expiration_ms = int(raw_expiration)
        except ValueError:
            self.expiration_ms = -1
        if self.expiration_ms < 0:
            raise QueuedDataSourceError(
                f"option expiration_ms must be a whole number of ms >= 0 (0 = never), not "
                f"{raw_expiration!r}")
        self.timeout = _float_option(options, "timeout", 30.0)
        self.connect_timeout = _float_option(options, "connect_timeout",
                                             DEFAULT_CONNECT_TIMEOUT)
        self.skip_null_data = _bool_option(options, "skip_null_data")

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        state = _PartitionWrite(self, PipelinedPutter(
            self.servers, timeout=self.timeout, connect_timeout=self.connect_timeout,
            window=self.max_inflight, first=partition))
        with state.putter:
            for batch in iterator:
                state.add_batch(batch)
            state.finish()
        p = state.putter
        return WriteCommit(p.stored, p.answered, state.skipped, p.resent)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, WriteCommit)]
        rows, skipped = sum(m.rows for m in done), sum(m.skipped for m in done)
        resent = sum(m.resent for m in done)
        log.info("queued sink: %d rows put in %d puts by %d tasks", rows,
                 sum(m.puts for m in done), len(done))
        if skipped:
            log.warning("queued sink: %d rows with a null data were skipped (skip_null_data)",
                        skipped)
        if resent:
            log.warning("queued sink: %d puts were re-sent after a broken connection; their "
                        "items may be stored twice", resent)


class _PartitionWrite:
    """One task's rows on their way to the putter: per queue, items waiting for a full put."""

    def __init__(self, writer: QueuedWriter, putter: PipelinedPutter) -> None:
        self.w = writer
        self.putter = putter
        self.pending: dict[str, list[bytes]] = {}
        self.pending_bytes: dict[str, int] = {}
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
        self.rows += n
        if queues is None:
            assert w.queue is not None
            self._add(w.queue, data)
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
            self._add(names[0], data)
            return
        # A stable sort by queue keeps each queue's rows in their order.
        order = pc.array_sort_indices(encoded.indices)
        grouped = data.take(order)
        counts = pc.value_counts(encoded.indices)
        per_index = dict(zip(counts.field("values").to_pylist(),
                             counts.field("counts").to_pylist(), strict=True))
        start = 0
        for k, name in enumerate(names):
            count = per_index[k]
            self._add(name, grouped.slice(start, count))
            start += count

    def _add(self, queue: str, data: pa.Array) -> None:
        """Queue rows' items, sending every full put."""
        w = self.w
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
            self.putter.put(queue, items, self.w.expiration_ms)

    def finish(self) -> None:
        for queue, items in self.pending.items():
            self._send(queue, items)
        self.pending.clear()
        self.pending_bytes.clear()
        self.putter.drain()
