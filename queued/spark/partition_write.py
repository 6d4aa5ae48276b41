"""One write task of the `queued` sink: its rows grouped, cut into chunks, and put.

Owns turning a partition's Arrow batches into puts: rows grouped by queue (the `queue`
column or option) and delay (the `delay` column or the `delay_ms` option), each row's
`headers` (a column, optional) going along with it, with Arrow
compute and numpy, each group keeping the partition's row order; every group cut into
chunks of `batch_size` rows or `batch_bytes` bytes where the rows alone say (never where a
batch of Arrow happens to end, so that a re-run cuts the same chunks); bad rows refused
with what to do; a put's failure said in the sink's words. Which puts a chunk is belongs
to the sender: `AtLeastOnceSender` here, `exactly_once.ExactlyOnceSender`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from queued.client.common import (
    AmbiguousPut,
    AuthFailed,
    ClientError,
    ConnectionFailed,
    ItemTooLarge,
    JournalFull,
    PermissionDenied,
    ProducerGap,
    QueueFull,
    RpcCallError,
    TooLarge,
    Unauthenticated,
)
from queued.journal import format as jf
from queued.spark.options import QueuedDataSourceError

if TYPE_CHECKING:
    from queued.client import Client


class PutFailed(QueuedDataSourceError):
    """A server refused a put (an item too large, a full queue, ...), or none answered."""


def refused(queue: str, items: list[bytes], servers: str, exc: ClientError) -> PutFailed:
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
    elif isinstance(exc, ProducerGap):
        hint = "a producer id of the sink met another writer's; see the server's log"
    elif isinstance(exc, RpcCallError):
        hint = "see the server's log"
    elif isinstance(exc, AmbiguousPut):
        return PutFailed(f"{where}: {exc} (option delivery_timeout; a retried task puts "
                         "it again, and the server stores it once)")
    else:
        return PutFailed(f"{where} on {servers} failed: {exc} (rows put before it are "
                         "stored; a retried task puts them again)")
    return PutFailed(f"{where} on {servers} was refused: {exc} ({hint})")


#: One row's headers as put takes them (None: none).
RowHeaders = dict[str, bytes | str] | None


def headers_of(rows: list[Any]) -> list[RowHeaders]:
    """The `headers` column's values as put takes them (a map or None per row)."""
    out: list[RowHeaders] = []
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


class Sender(Protocol):
    """Puts one chunk of a group's rows (and their headers, if any); counts what it did."""

    stored: int  # rows stored
    found: int  # rows an earlier run of the write had stored (exactly-once only)
    puts: int
    diverged: int  # chunks an earlier run stored with other rows (exactly-once only)

    def send(self, queue: str, delay_ms: int, group: bytes, number: int,
             items: list[bytes], headers: list[RowHeaders] | None = None,
             arrow: list[pa.Array] | None = None) -> None: ...


class AtLeastOnceSender:
    """One plain put per chunk: with several servers the puts rotate and fail over, as
    the client does; a retried task puts its rows again."""

    def __init__(self, client: Client, expiration_ms: int) -> None:
        self.client = client
        self.expiration_ms = expiration_ms
        self.stored = self.found = self.puts = self.diverged = 0

    def send(self, queue: str, delay_ms: int, group: bytes, number: int,
             items: list[bytes], headers: list[RowHeaders] | None = None,
             arrow: list[pa.Array] | None = None) -> None:
        self.stored += self.client.put(queue, items, self.expiration_ms, delay_ms=delay_ms,
                                       headers=headers)
        self.puts += 1


@dataclass(frozen=True, slots=True)
class Layout:
    """What a write task needs to know of the options and columns."""

    servers: str
    queue: str | None  # the queue option (rows without a queue column, or a null one)
    has_queue_column: bool
    has_delay_column: bool
    delay_ms: int  # the delay_ms option (rows without a delay column, or a null one)
    batch: int
    batch_bytes: int
    skip_null_data: bool
    has_headers_column: bool = False


@dataclass(slots=True)
class _Group:
    """Rows of one (queue, delay) waiting for a full chunk."""

    seed: bytes  # the sender's name for the group (producer ids)
    parts: list[tuple[pa.Array, pa.Array | None]] = field(default_factory=list)  # (data, headers)
    rows: int = 0
    nbytes: int = 0
    chunks: int = 0  # chunks sent


class PartitionWrite:
    """One task's rows on their way to the servers."""

    def __init__(self, layout: Layout, sender: Sender,
                 seed: Callable[[str, int], bytes]) -> None:
        self.w = layout
        self.sender = sender
        self.seed = seed
        self.groups: dict[tuple[str, int], _Group] = {}
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
        delays = batch.column("delay") if w.has_delay_column else None
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
            queues = None if queues is None else queues.filter(valid)
            delays = None if delays is None else delays.filter(valid)
            headers = None if headers is None else headers.filter(valid)
        self.rows += n
        names, queue_of = self._queues(queues)
        delay_of = self._delays(delays)
        if queue_of is None and delay_of is None:
            self._add((names[0], w.delay_ms), data, headers)
            return
        # Group numbers: queue index, then delay; a stable sort keeps each group's rows in
        # their order.
        qi = np.zeros(len(data), np.int64) if queue_of is None else queue_of
        di = np.full(len(data), w.delay_ms, np.int64) if delay_of is None else delay_of
        keys, key_of = np.unique(np.stack([qi, di], axis=1), axis=0, return_inverse=True)
        if len(keys) == 1:
            self._add((names[int(keys[0][0])], int(keys[0][1])), data, headers)
            return
        key_of = key_of.reshape(-1)
        order = pa.array(np.argsort(key_of, kind="stable"))
        grouped = data.take(order)
        grouped_headers = None if headers is None else headers.take(order)
        start = 0
        for k, count in enumerate(np.bincount(key_of, minlength=len(keys)).tolist()):
            self._add((names[int(keys[k][0])], int(keys[k][1])), grouped.slice(start, count),
                      None if grouped_headers is None else grouped_headers.slice(start, count))
            start += count

    def _queues(self, queues: pa.Array | None) -> tuple[list[str], np.ndarray | None]:
        """The queue names of the rows and each row's index among them (None: one queue)."""
        w = self.w
        if queues is None:
            assert w.queue is not None
            return [w.queue], None
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
            return names, None
        return names, encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)

    def _delays(self, delays: pa.Array | None) -> np.ndarray | None:
        """Each row's delay in ms (a null one: option delay_ms), or None (all the option's)."""
        if delays is None:
            return None
        if delays.null_count == len(delays):
            return None
        if delays.null_count:
            delays = pc.fill_null(delays, self.w.delay_ms)
        out: np.ndarray = delays.to_numpy(zero_copy_only=False).astype(np.int64)
        bad = (out < 0) | (out > jf.MAX_DELAY_MS)
        if bad.any():
            raise QueuedDataSourceError(
                f"the queued sink's column `delay` holds {int(out[bad][0])}: a delay is a "
                f"whole number of ms in [0, {jf.MAX_DELAY_MS}] (null: option delay_ms)")
        return out

    def _add(self, key: tuple[str, int], data: pa.Array,
             headers: pa.Array | None = None) -> None:
        """A group's rows; every full chunk is sent. A chunk ends at its `batch_size`-th
        row, or at the row that brings it to `batch_bytes` bytes."""
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(self.seed(*key))
        w = self.w
        n = len(data)
        room = w.batch - group.rows  # rows until a cut by count (>= 1)
        ends = np.cumsum(pc.binary_length(data).to_numpy(zero_copy_only=False),
                         dtype=np.int64)  # bytes of rows 0..i
        start, before = 0, 0
        while start < n:
            by_bytes = int(np.searchsorted(ends, w.batch_bytes - group.nbytes + before))
            last = min(start + room - 1, by_bytes)  # the chunk's last row, if here
            if last >= n:
                group.parts.append((data.slice(start),
                                    None if headers is None else headers.slice(start)))
                group.rows += n - start
                group.nbytes += int(ends[-1]) - before
                return
            count = last + 1 - start
            group.parts.append((data.slice(start, count),
                                None if headers is None else headers.slice(start, count)))
            self._send(key, group)
            before = int(ends[last])
            start, room = last + 1, w.batch

    def _send(self, key: tuple[str, int], group: _Group) -> None:
        items: list[bytes] = []
        headers: list[RowHeaders] | None = [] if self.w.has_headers_column else None
        arrow = [part for part, _ in group.parts]
        for part, part_headers in group.parts:
            items += part.to_pylist()
            if headers is not None and part_headers is not None:
                headers += headers_of(part_headers.to_pylist())
        group.parts, group.rows, group.nbytes = [], 0, 0
        if not items:
            return
        group.chunks += 1
        queue, delay = key
        try:
            self.sender.send(queue, delay, group.seed, group.chunks, items,
                             headers if headers and any(headers) else None, arrow)
        except ValueError as exc:  # (headers the client refuses before sending)
            raise QueuedDataSourceError(f"the queued sink's column `headers`: {exc}") from exc
        except ClientError as exc:
            raise refused(queue, items, self.w.servers, exc) from exc

    def finish(self) -> None:
        for key, group in self.groups.items():
            if group.rows:
                self._send(key, group)


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
