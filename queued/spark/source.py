"""The `queued` Spark data source: batch and streaming reads of journal directories
(the sink is `queued.spark.writer`).

Owns the mapping between Spark's Python Data Source API and `queued.storage.journal_scan`:
whole segments as input partitions, Arrow record batches out. Never writes a journal
file: reads are read-only scans.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (  # pyspark >= 4.2 (admission control)
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from queued.spark.arrow import chunk_to_arrow
from queued.spark.options import (
    QueuedDataSourceError,
    archive_option,
    bool_option,
    int_option,
    path_option,
    pending_reader_option,
    queues_option,
)
from queued.spark.writer import QueuedWriter
from queued.storage import journal_scan as js

#: The rows of every read. Timestamps come from the journal's milliseconds.
SCHEMA = ("queue string, id bigint, add_time timestamp, expire_time timestamp, "
          "error_count int, data binary")
#: The same with the `include_flags` option: each item's memcache flags (u32) too.
SCHEMA_FLAGS = SCHEMA + ", flags bigint"

def register(spark: Any) -> None:
    """`spark.dataSource.register(QueuedDataSource)`, for sessions without auto-registration."""
    spark.dataSource.register(QueuedDataSource)


# -- partitions ----------------------------------------------------------------------------


#: Segment bytes per input partition, as Spark's own spark.sql.files.maxPartitionBytes:
#: PySpark spends tens of ms on each Python data source task (measured here: 64 one-segment
#: tasks of 16 MiB read a 1 GiB journal at half the rows/s of 8 packed ones), so small
#: segments are read several to a task.
DEFAULT_PARTITION_BYTES = 128 << 20


@dataclass(frozen=True)
class SegmentRead:
    """One segment file of a queue and the ids wanted from it."""

    queue: str
    path: str
    ids: js.IdFilter = js.ALL_IDS
    #: Where the segment is once the server retires it (archive_dir), if anywhere.
    archived_path: str = ""


@dataclass(frozen=True)
class SegmentPartition(InputPartition):
    """Whole segments read by one task, in order; with `live_at_ms`, only the items not
    expired at that time."""

    segments: tuple[SegmentRead, ...]
    live_at_ms: int = 0
    flags: bool = False  # a flags column too (include_flags)


def _segment_read(seg: js.SegmentRef, archive: str | None,
                  ids: js.IdFilter = js.ALL_IDS) -> SegmentRead:
    archived = str(Path(archive) / Path(seg.path).name) if archive else ""
    return SegmentRead(seg.queue, seg.path, ids, "" if archived == seg.path else archived)


def _pack(reads: list[tuple[SegmentRead, int]], max_bytes: int,
          live_at_ms: int = 0, flags: bool = False) -> list[InputPartition]:
    """(segment, size) pairs, in order, as partitions of up to `max_bytes` (at least one
    segment each)."""
    parts: list[InputPartition] = []
    group: list[SegmentRead] = []
    size = 0
    for read, nbytes in reads:
        if group and size + nbytes > max_bytes:
            parts.append(SegmentPartition(tuple(group), live_at_ms, flags))
            group, size = [], 0
        group.append(read)
        size += nbytes
    if group:
        parts.append(SegmentPartition(tuple(group), live_at_ms, flags))
    return parts


def _read_partition(partition: SegmentPartition) -> Iterator[pa.RecordBatch]:
    for seg in partition.segments:
        yield from _read_segment(seg, partition.live_at_ms, partition.flags)


def _read_segment(seg: SegmentRead, live_at_ms: int,
                  flags: bool = False) -> Iterator[pa.RecordBatch]:
    for path in (seg.path, seg.archived_path):
        if not path:
            continue
        try:
            chunks = js.scan_segment(path, seg.ids)
            first = next(chunks, None)  # opens the file: a retired one is not found
        except FileNotFoundError:
            continue
        for chunk in itertools.chain([first] if first else [], chunks):
            batch = chunk_to_arrow(seg.queue, chunk, live_at_ms, flags)
            if batch.num_rows:
                yield batch
        return
    raise QueuedDataSourceError(
        f"{seg.path} was removed while the query ran (compaction retired it)"
        + (f", and is not in {Path(seg.archived_path).parent} either"
           if seg.archived_path else
           "; set archive_dir on the server so retired segments are kept, and pass it "
           "with .option('archive_dir', ...)"))


def _prune(segments: list[js.SegmentRef], ids: js.IdFilter) -> list[js.SegmentRef]:
    """The segments of one queue (in number order) that may hold ids `ids` wants, from
    their first ids (ids ascend through a queue's segments): a segment ends below the
    next known first id. A first id may be unknown (no PUT yet in the newest segment);
    nothing is pruned when the known ones are out of order."""
    if ids.after <= 0 and ids.upto <= 0:
        return segments
    firsts = [js.first_id(seg.path) for seg in segments]
    known = [f for f in firsts if f is not None]
    if known != sorted(set(known)):
        return segments
    keep = []
    for k, seg in enumerate(segments):
        after_this = next((f for f in firsts[k + 1:] if f is not None), None)
        if after_this is not None and after_this - 1 <= ids.after:
            continue  # every id here is below the next segment's first, so <= after
        first = firsts[k]
        if ids.upto > 0 and first is not None and first > ids.upto:
            break
        keep.append(seg)
    return keep


# -- the data source -----------------------------------------------------------------------


class QueuedDataSource(DataSource):
    """`format("queued")`: see the README's Spark section for the options."""

    @classmethod
    def name(cls) -> str:
        return "queued"

    def schema(self) -> str:
        return SCHEMA_FLAGS if bool_option(self.options, "include_flags") else SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return QueuedBatchReader(self.options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueuedStreamReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> QueuedWriter:
        if overwrite:
            raise QueuedDataSourceError(
                'the queued sink only appends: use .mode("append") (a queue cannot be '
                "overwritten)")
        return QueuedWriter(self.options, schema)


class QueuedBatchReader(DataSourceReader):
    """The segments that may hold wanted rows, whole, packed into partitions of up to
    `max_partition_bytes` (128 MiB; 1 gives one segment per partition); `queues`,
    `min_id`/`max_id` and `reader`/`pending` narrow what is read.

    No `pushFilters`: PySpark 4.3 keeps the read planned during filter pushdown on the
    relation, shared by every query on the same DataFrame, so a later query without
    pushable conditions reads with an earlier query's narrowed plan (seen here: wrong
    row counts). The options above are part of the relation and safe."""

    def __init__(self, options: Any) -> None:
        self.path = path_option(options)
        self.archive = archive_option(options)
        self.queues = queues_option(options)
        self.reader = pending_reader_option(options)
        self.id_after = int_option(options, "min_id", 1) - 1  # ids wanted: (after, upto]
        self.id_upto = int_option(options, "max_id", 0)  # 0: no bound
        self.partition_bytes = int_option(options, "max_partition_bytes",
                                          DEFAULT_PARTITION_BYTES)
        self.flags = bool_option(options, "include_flags")

    def partitions(self) -> Sequence[InputPartition]:
        if 0 < self.id_upto <= self.id_after:
            return []  # min_id > max_id: nothing
        by_queue: dict[str, list[js.SegmentRef]] = {}
        for seg in js.list_segments_with_archive(self.path, self.archive, self.queues):
            by_queue.setdefault(seg.queue, []).append(seg)
        reads: list[tuple[SegmentRead, int]] = []
        # Pending reads leave out what has expired by now: the server discards it.
        live_at = int(time.time() * 1000) if self.reader is not None else 0
        for queue, segments in by_queue.items():
            after, upto, skip = self.id_after, self.id_upto, frozenset[int]()
            if self.reader is not None:
                try:
                    cp = js.reader_checkpoint(self.path, queue, self.reader)
                except js.ScanError as exc:
                    raise QueuedDataSourceError(str(exc)) from exc
                pending = js.IdFilter.pending(cp)
                after, skip = max(after, pending.after), pending.skip
            ids = js.IdFilter(after, upto, skip)
            reads += [(_segment_read(seg, self.archive, ids), seg.size)
                      for seg in _prune(segments, ids)]
        return _pack(reads, self.partition_bytes, live_at, self.flags)
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SegmentPartition):
            # No segment at all: PySpark still reads one partition (None). No rows.
            return iter(())
        return _read_partition(partition)


# -- streaming -----------------------------------------------------------------------------


class QueuedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are `{queue: last id read}`; a micro-batch reads ids in (start, end].

    Options: `queues`, `max_items_per_trigger`, `starting` ("earliest" or "latest"),
    `archive_dir` (also read retired segments from there), `include_flags`.
    """

    def __init__(self, options: Any) -> None:
        self.path = path_option(options)
        self.archive = archive_option(options)
        self.queues = queues_option(options)
        self.max_items = int_option(options, "max_items_per_trigger", 0) if options.get(
            "max_items_per_trigger") else 0
        self.partition_bytes = int_option(options, "max_partition_bytes",
                                          DEFAULT_PARTITION_BYTES)
        self.flags = bool_option(options, "include_flags")
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
        """Per queue, its segments with items, oldest first (the archive's originals in
        place of the compaction outputs that replaced them)."""
        found: dict[str, list[tuple[js.SegmentRef, js.SegmentSummary]]] = {}
        for seg in js.list_segments_with_archive(self.path, self.archive, self.queues):
            summary = self._summary(seg)
            if summary is not None and summary.count:
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
        reads: list[tuple[SegmentRead, int]] = []
        for q in sorted(end):
            after, upto = start.get(q, 0), end[q]
            if upto <= after:
                continue
            segs = segments.get(q, [])
            self._check_continuity(q, after, upto, segs)
            reads += [(_segment_read(seg, self.archive, js.IdFilter(after, upto)), seg.size)
                      for seg, summary in segs
                      if summary.last_id > after and summary.first_id <= upto]
        return _pack(reads, self.partition_bytes, flags=self.flags)

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


def offsets_json(offsets: dict[str, int]) -> str:
    """How an offset looks in a Spark checkpoint (for docs and tests)."""
    return json.dumps(offsets, sort_keys=True)
