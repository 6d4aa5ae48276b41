"""The `queued` Spark data source: batch and streaming reads of journal directories,
and a writer that enqueues rows into a running server over MessagePack-RPC.

Owns the mapping between Spark's Python Data Source API and `queued.journal_scan`
(one input partition per segment, Arrow record batches out) and `queued.client`
(one connection and batched puts per write partition). Never writes a journal
file: reads are read-only scans, writes go through a server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (  # pyspark >= 4.2 (admission control)
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from queued import journal_format as jf
from queued import journal_scan as js
from queued.errors import QueuedError

#: The rows of every read. Timestamps come from the journal's milliseconds.
SCHEMA = ("queue string, id bigint, add_time timestamp, expire_time timestamp, "
          "error_count int, data binary")
_ARROW_SCHEMA = pa.schema([
    ("queue", pa.string()), ("id", pa.int64()), ("add_time", pa.timestamp("us", tz="UTC")),
    ("expire_time", pa.timestamp("us", tz="UTC")), ("error_count", pa.int32()),
    ("data", pa.binary()),
])
_MS = pa.timestamp("ms", tz="UTC")
_US = pa.timestamp("us", tz="UTC")

DEFAULT_WRITE_BATCH = 1000
DEFAULT_WRITE_BATCH_BYTES = 8 << 20


class QueuedDataSourceError(QueuedError):
    """A bad option, or a journal the source cannot read (the message says what to do)."""


def register(spark: Any) -> None:
    """`spark.dataSource.register(QueuedDataSource)`, for sessions without auto-registration."""
    spark.dataSource.register(QueuedDataSource)


# -- options -------------------------------------------------------------------------------


def _path(options: Any, key: str = "path") -> str:
    path = options.get(key)
    if not path:
        raise QueuedDataSourceError(
            f'the queued source needs a directory: .load("/path/to/data_dir") (option {key!r})')
    if not Path(path).is_dir():
        raise QueuedDataSourceError(f"{path}: not a directory")
    return str(path)


def _queues(options: Any) -> frozenset[str] | None:
    raw = options.get("queues") or options.get("queue")
    if not raw:
        return None
    names = frozenset(q.strip() for q in str(raw).split(",") if q.strip())
    bad = sorted(q for q in names if not jf.valid_name(q))
    if bad:
        raise QueuedDataSourceError(f"bad queue names in option queues: {bad}")
    return names


def _int_option(options: Any, key: str, default: int) -> int:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueuedDataSourceError(f"option {key} must be an integer, not {raw!r}") from None
    if value <= 0:
        raise QueuedDataSourceError(f"option {key} must be positive, not {value}")
    return value


def _pending_reader(options: Any) -> str | None:
    """The reader whose unconsumed items alone are read, or None (read everything)."""
    reader = options.get("reader")
    if reader is not None and reader != "":
        if not jf.valid_name(reader):
            raise QueuedDataSourceError(f"bad reader name {reader!r}")
        return str(reader)
    if str(options.get("pending", "false")).lower() in ("true", "1", "yes"):
        return ""
    return None


# -- Arrow ---------------------------------------------------------------------------------


def _to_arrow(queue: str, cols: js.PutColumns) -> pa.RecordBatch:
    n = len(cols)
    return pa.RecordBatch.from_arrays([
        pa.repeat(pa.scalar(queue, pa.string()), n),
        pa.array(cols.ids, pa.int64()),
        pa.array(cols.add_times, pa.int64()).cast(_MS).cast(_US),
        pa.array(cols.expire_times, pa.int64()).cast(_MS).cast(_US),
        pa.array(cols.error_counts, pa.int32()),
        pa.array(cols.data, pa.binary()),
    ], schema=_ARROW_SCHEMA)


@dataclass(frozen=True)
class SegmentPartition(InputPartition):
    """One segment file and the ids wanted from it."""

    queue: str
    path: str
    after: int = 0
    upto: int = 0
    skip: frozenset[int] = frozenset()


def _read_partition(partition: SegmentPartition) -> Iterator[pa.RecordBatch]:
    ids = js.IdFilter(partition.after, partition.upto, partition.skip)
    try:
        for cols in js.scan_segment(partition.path, ids):
            yield _to_arrow(partition.queue, cols)
    except FileNotFoundError:
        raise QueuedDataSourceError(
            f"{partition.path} was removed while the query ran (compaction retired it); "
            "read an archive_dir, or set archive_dir on the server so retired segments "
            "are kept") from None


# -- the data source -----------------------------------------------------------------------


class QueuedDataSource(DataSource):
    """`format("queued")`: see the README's Spark section for the options."""

    @classmethod
    def name(cls) -> str:
        return "queued"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return QueuedBatchReader(self.options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueuedStreamReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        if overwrite:
            raise QueuedDataSourceError(
                'the queued sink only appends: use .mode("append") (a queue cannot be '
                "overwritten)")
        return QueuedWriter(self.options, schema)


class QueuedBatchReader(DataSourceReader):
    """One partition per segment; `queues` and `reader`/`pending` narrow what is read."""

    def __init__(self, options: Any) -> None:
        self.path = _path(options)
        self.queues = _queues(options)
        self.reader = _pending_reader(options)

    def partitions(self) -> Sequence[InputPartition]:
        segments = js.list_segments(self.path, self.queues)
        checkpoints: dict[str, js.IdFilter] = {}
        parts: list[InputPartition] = []
        for seg in segments:
            ids = js.IdFilter()
            if self.reader is not None:
                if seg.queue not in checkpoints:
                    try:
                        cp = js.reader_checkpoint(self.path, seg.queue, self.reader)
                    except js.ScanError as exc:
                        raise QueuedDataSourceError(str(exc)) from exc
                    checkpoints[seg.queue] = js.IdFilter.pending(cp)
                ids = checkpoints[seg.queue]
            parts.append(SegmentPartition(seg.queue, seg.path, ids.after, ids.upto, ids.skip))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SegmentPartition):
            # No segment at all: PySpark still reads one partition (None). No rows.
            return iter(())
        return _read_partition(partition)


# -- streaming -----------------------------------------------------------------------------


class QueuedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are `{queue: last id read}`; a micro-batch reads ids in (start, end].

    Options: `queues`, `max_items_per_trigger`, `starting` ("earliest" or "latest"),
    `archive_dir` (also read retired segments from there).
    """

    def __init__(self, options: Any) -> None:
        self.path = _path(options)
        self.archive = _path(options, "archive_dir") if options.get("archive_dir") else None
        self.queues = _queues(options)
        self.max_items = _int_option(options, "max_items_per_trigger", 0) if options.get(
            "max_items_per_trigger") else 0
        self.starting = str(options.get("starting", "earliest")).lower()
        if self.starting not in ("earliest", "latest"):
            raise QueuedDataSourceError('option starting must be "earliest" or "latest"')
        self._summaries: dict[str, tuple[tuple[int, int, int], js.SegmentSummary]] = {}
        self._available_now: dict[str, int] | None = None

    # What is there now.

    def _summary(self, seg: js.SegmentRef) -> js.SegmentSummary | None:
        try:
            st = Path(seg.path).stat()
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._summaries.get(seg.path)
        if cached is None or cached[0] != key:
            try:
                cached = (key, js.summarize_segment(seg.path))
            except FileNotFoundError:
                return None
            except js.ScanError as exc:
                raise QueuedDataSourceError(str(exc)) from exc
            self._summaries[seg.path] = cached
        return cached[1]

    def _segments(self) -> dict[str, list[tuple[js.SegmentRef, js.SegmentSummary]]]:
        """Per queue, its segments with items, oldest first: archived originals first,
        then the data directory's (whose compaction outputs the archive covers)."""
        found: dict[str, list[tuple[js.SegmentRef, js.SegmentSummary]]] = {}
        archived: dict[str, int] = {}
        if self.archive is not None:
            for seg in js.list_segments(self.archive, self.queues):
                summary = self._summary(seg)
                if summary is not None and summary.count:
                    found.setdefault(seg.queue, []).append((seg, summary))
                    archived[seg.queue] = max(archived.get(seg.queue, 0), summary.last_id)
        for seg in js.list_segments(self.path, self.queues):
            summary = self._summary(seg)
            if summary is None or not summary.count:
                continue
            if summary.last_id <= archived.get(seg.queue, 0):
                continue  # its items are in the archive (a copy, or a compaction's originals)
            found.setdefault(seg.queue, []).append((seg, summary))
        return found

    def _latest(self) -> dict[str, int]:
        return {q: segs[-1][1].last_id for q, segs in self._segments().items()}

    # The DataSourceStreamReader API.

    def initialOffset(self) -> dict[str, int]:
        if self.starting == "latest":
            return self._latest()
        return {}  # every queue from its first id

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_items:
            return ReadMaxRows(self.max_items)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = self._latest()

    def latestOffset(self, start: dict[str, int] | None = None,
                     limit: ReadLimit | None = None) -> dict[str, int]:
        start = dict(start or {})
        segments = self._segments()
        latest = {q: segs[-1][1].last_id for q, segs in segments.items()}
        if self._available_now is not None:
            latest = {q: min(v, self._available_now.get(q, 0)) for q, v in latest.items()}
        end = dict(start)
        for q, last in latest.items():
            end[q] = max(start.get(q, 0), last)
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else 0
        if budget > 0:
            end = self._admit(start, end, segments, budget)
        return end

    def _admit(self, start: dict[str, int], end: dict[str, int],
               segments: dict[str, list[tuple[js.SegmentRef, js.SegmentSummary]]],
               budget: int) -> dict[str, int]:
        """End offsets holding at most `budget` items, shared fairly between queues."""
        out = dict(start)
        pending = sorted(q for q in end if end[q] > start.get(q, 0))
        while budget > 0 and pending:
            share = max(1, budget // len(pending))
            still: list[str] = []
            for q in pending:
                if budget <= 0:
                    break
                took, new_end = self._advance(segments[q], out.get(q, 0), end[q],
                                              min(share, budget))
                out[q] = new_end
                budget -= took
                if took and new_end < end[q]:
                    still.append(q)
            pending = still
        return out

    @staticmethod
    def _advance(segs: list[tuple[js.SegmentRef, js.SegmentSummary]], after: int, upto: int,
                 n: int) -> tuple[int, int]:
        """(items taken, new end): up to n items of ids in (after, upto]."""
        taken, pos = 0, after
        for seg, summary in segs:
            if summary.last_id <= pos:
                continue
            if summary.first_id > upto:
                break
            xid, k = js.nth_id_after(seg.path, summary, pos, n - taken)
            if k:
                xid = min(xid, upto)
                taken += k
                pos = xid
            if taken >= n or pos >= upto:
                break
        return taken, pos

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        segments = self._segments()
        parts: list[InputPartition] = []
        for q in sorted(end):
            after, upto = start.get(q, 0), end[q]
            if upto <= after:
                continue
            segs = segments.get(q, [])
            self._check_continuity(q, after, upto, segs)
            for seg, summary in segs:
                if summary.last_id > after and summary.first_id <= upto:
                    parts.append(SegmentPartition(q, seg.path, after, upto))
        return parts

    def _check_continuity(self, queue: str, after: int, upto: int,
                          segs: list[tuple[js.SegmentRef, js.SegmentSummary]]) -> None:
        """Refuse to skip items silently: the segments that held ids just above `after`
        must still be there (compaction deletes or rewrites segments every server
        reader is past; the stream is not one of the server's readers)."""
        needed = [pair for pair in segs if pair[1].last_id > after]
        problem = ""
        if not needed:
            problem = f"no segment of queue {queue!r} holds ids in ({after}, {upto}]"
        elif after > 0 and needed[0][1].first_id > after + 1 and needed[0] is segs[0]:
            problem = (f"the oldest segment of queue {queue!r} starts at id "
                       f"{needed[0][1].first_id}, but the stream's offset is {after}")
        else:
            compacted = [seg.path for seg, s in needed if s.compacted and s.first_id <= upto]
            if compacted:
                problem = (f"{compacted[0]} was rewritten by compaction and holds only some "
                           f"of the ids the stream needs after {after}")
        if problem:
            raise QueuedDataSourceError(
                f"{problem}: segments the stream's offset needs were removed by compaction. "
                "Set archive_dir in the server's config (retired segments are moved there) "
                "and pass it to the stream with .option('archive_dir', ...); or restart the "
                "query from a new checkpoint to skip the lost items.")

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SegmentPartition):
            return iter(())  # nothing in (start, end]: PySpark reads one empty partition
        return _read_partition(partition)

    def commit(self, end: dict[str, int]) -> None:
        live = {seg.path for segs in self._segments().values() for seg, _ in segs}
        for path in [p for p in self._summaries if p not in live]:
            del self._summaries[path]


# -- writer --------------------------------------------------------------------------------


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
        self.batch = _int_option(options, "batch_size", DEFAULT_WRITE_BATCH)
        self.batch_bytes = _int_option(options, "batch_bytes", DEFAULT_WRITE_BATCH_BYTES)
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


def offsets_json(offsets: dict[str, int]) -> str:
    """How an offset looks in a Spark checkpoint (for docs and tests)."""
    return json.dumps(offsets, sort_keys=True)
