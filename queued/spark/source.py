"""The `queued` Spark data source: batch reads of journal directories here, streaming reads
in `queued.spark.stream`, the sink (batch and streaming) in `queued.spark.sink`.

Owns the mapping between Spark's Python Data Source API and `queued.storage.journal_scan`
for batch reads: which segments and ids a query reads, from the options (Kafka's names
where the meaning is the same). Never writes a journal file: reads are read-only scans.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from queued.spark import scan
from queued.spark.options import (
    EARLIEST,
    LATEST,
    READ_OPTIONS,
    STREAM_OPTIONS,
    WRITE_OPTIONS,
    WRITE_STREAM_OPTIONS,
    Options,
    QueuedDataSourceError,
    bool_option,
    int_option,
    offsets_option,
    pending_reader_option,
    timestamp_option,
    timestamps_option,
)
from queued.spark.scan import DEFAULT_PARTITION_BYTES, SegmentPartition, SegmentRead
from queued.spark.sink import QueuedStreamWriter, QueuedWriter
from queued.spark.stream import QueuedStreamReader
from queued.storage import journal_scan as js

__all__ = [
    "DEFAULT_PARTITION_BYTES",
    "SCHEMA",
    "SCHEMA_FLAGS",
    "QueuedBatchReader",
    "QueuedDataSource",
    "QueuedStreamReader",
    "SegmentPartition",
    "SegmentRead",
    "register",
]

#: The rows of every read. Timestamps come from the journal's milliseconds.
SCHEMA = ("queue string, id bigint, add_time timestamp, expire_time timestamp, "
          "error_count int, data binary")
#: The same with the `include_flags` option: each item's memcache flags (u32) too.
SCHEMA_FLAGS = SCHEMA + ", flags bigint"
#: What `includeHeaders` adds (last): each item's headers, as the Kafka source's column.
HEADERS_COLUMN = ", headers array<struct<key: string, value: binary>>"


def register(spark: Any) -> None:
    """`spark.dataSource.register(QueuedDataSource)`, for sessions without auto-registration."""
    spark.dataSource.register(QueuedDataSource)


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
    """`format("queued")`: see docs/spark.md for the options."""

    @classmethod
    def name(cls) -> str:
        return "queued"

    def schema(self) -> str:
        schema = SCHEMA_FLAGS if bool_option(self.options, "include_flags") else SCHEMA
        return schema + HEADERS_COLUMN if bool_option(self.options, "includeHeaders") else schema

    def reader(self, schema: StructType) -> DataSourceReader:
        return QueuedBatchReader(Options(self.options, READ_OPTIONS, "spark.read"))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueuedStreamReader(Options(self.options, STREAM_OPTIONS, "spark.readStream"))

    def writer(self, schema: StructType, overwrite: bool) -> QueuedWriter:
        _append_only(overwrite)
        return QueuedWriter(Options(self.options, WRITE_OPTIONS, "df.write"), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        _append_only(overwrite)
        return QueuedStreamWriter(
            Options(self.options, WRITE_STREAM_OPTIONS, "df.writeStream"), schema)


def _append_only(overwrite: bool) -> None:
    if overwrite:
        raise QueuedDataSourceError(
            'the queued sink only appends: use .mode("append") / .outputMode("append") '
            "(a queue cannot be overwritten)")


class QueuedBatchReader(DataSourceReader):
    """The segments that may hold wanted rows, whole, packed into partitions of up to
    `max_partition_bytes` (128 MiB; 1 gives one segment per partition), or cut by id
    ranges into `minPartitions`; `subscribe`/`subscribePattern`, the starting and ending
    offsets and timestamps, `min_id`/`max_id` and `reader`/`pending` narrow what is read.

    No `pushFilters`: PySpark 4.3 keeps the read planned during filter pushdown on the
    relation, shared by every query on the same DataFrame, so a later query without
    pushable conditions reads with an earlier query's narrowed plan (seen here: wrong
    row counts). The options above are part of the relation and safe."""

    def __init__(self, options: Any) -> None:
        if not isinstance(options, Options):
            options = Options(options, READ_OPTIONS, "spark.read")
        self.o = o = scan.ReadOptions(options)
        self.path, self.archive, self.selection = o.path, o.archive, o.selection
        self.reader = pending_reader_option(options)
        self.id_after = int_option(options, "min_id", 1) - 1  # ids wanted: (after, upto]
        self.id_upto = int_option(options, "max_id", 0)  # 0: no bound
        self.ending = offsets_option(options, "endingOffsets", "latest")
        if o.starting == "latest" or (
                isinstance(o.starting, dict) and LATEST in o.starting.values()):
            raise QueuedDataSourceError(
                "startingOffsets latest (-1) is for streams: a batch query would read nothing")
        if self.ending == "earliest" or (
                isinstance(self.ending, dict) and EARLIEST in self.ending.values()):
            raise QueuedDataSourceError(
                "endingOffsets earliest (-2) is for nothing: a batch query would read nothing")
        self.end_ms = timestamp_option(options, "endingTimestamp")
        self.end_ms_by = timestamps_option(options, "endingOffsetsByTimestamp")

    def _bounds(self, queue: str, segments: list[js.SegmentRef]) -> tuple[int, int] | None:
        """The ids (after, upto] to read from a queue (upto 0: no bound), or None."""
        after, upto = self.id_after, self.id_upto or None
        start_ms = self.o.start_time(queue)
        if start_ms is not None:
            first = scan.first_id_at(segments, start_ms)
            if first is None:
                return None  # nothing added at or after that time
            after = max(after, first - 1)
        elif isinstance(self.o.starting, dict) and self.o.starting.get(queue, EARLIEST) > 0:
            wanted = self.o.starting[queue]
            oldest = js.first_id(segments[0].path) if segments else None
            if oldest is not None and oldest > wanted:
                self.o.loss(f"startingOffsets asks for queue {queue!r} from id {wanted}, but "
                          f"ids {wanted}..{oldest - 1} are gone (the oldest segment starts "
                          f"at {oldest})")
            after = max(after, wanted - 1)
        end_ms = self.end_ms_by.get(queue) if self.end_ms_by is not None else self.end_ms
        end: int | None = None
        if end_ms is not None:
            first = scan.first_id_at(segments, end_ms)
            end = None if first is None else first - 1
        elif isinstance(self.ending, dict) and self.ending.get(queue, LATEST) > 0:
            end = self.ending[queue] - 1  # exclusive, as the Kafka source's
        if end is not None:
            upto = end if upto is None else min(upto, end)
        if upto is not None and upto <= after:
            return None
        return after, upto or 0

    def partitions(self) -> Sequence[InputPartition]:
        if 0 < self.id_upto <= self.id_after:
            return []  # min_id > max_id: nothing
        reads: list[tuple[SegmentRead, int]] = []
        # Pending reads leave out what has expired by now: the server discards it.
        live_at = int(time.time() * 1000) if self.reader is not None else 0
        for queue, segments in self.selection.segments(self.path, self.archive).items():
            bounds = self._bounds(queue, segments)
            if bounds is None:
                continue
            (after, upto), skip = bounds, frozenset[int]()
            if self.reader is not None:
                try:
                    cp = js.reader_checkpoint(self.path, queue, self.reader)
                except js.ScanError as exc:
                    raise QueuedDataSourceError(str(exc)) from exc
                pending = js.IdFilter.pending(cp)
                after, skip = max(after, pending.after), pending.skip
            ids = js.IdFilter(after, upto, skip)
            newest = segments[-1].number
            reads += [(scan.segment_read(seg, self.archive, ids, seg.number != newest),
                       seg.size) for seg in _prune(segments, ids)]
        o = self.o
        parts = scan.pack(reads, o.partition_bytes, live_at, o.flags, o.headers)
        if len(parts) < o.min_partitions:
            try:
                summaries = [(r, js.summarize_segment(r.path)) for r, _ in reads]
            except (FileNotFoundError, js.ScanError):
                return parts  # retired meanwhile: the packed plan reads the archive
            return scan.split(summaries, o.min_partitions, live_at, o.flags, o.headers)
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return scan.read_partition(partition)


def offsets_json(offsets: dict[str, Any]) -> str:
    """How an offset looks in a Spark checkpoint (for docs and tests)."""
    return json.dumps(offsets, sort_keys=True)
