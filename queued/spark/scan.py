"""What the `queued` source's batch and stream readers share: which queues a query reads,
segments as input partitions (packed, or split by id ranges for `minPartitions`), reading
a partition into Arrow batches, finding the first item added at or after a time, and
reporting lost data (`failOnDataLoss`).

Never writes a journal file: reads are read-only scans.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition

from queued.spark.arrow import chunk_to_arrow
from queued.spark.options import (
    DataLossError,
    Options,
    QueuedDataSourceError,
    archive_option,
    bool_option,
    int_option,
    offsets_option,
    optional_int,
    path_option,
    pattern_option,
    queues_option,
    timestamp_option,
    timestamps_option,
)
from queued.storage import journal_scan as js

log = logging.getLogger("queued.spark")

#: Segment bytes per input partition, as Spark's own spark.sql.files.maxPartitionBytes:
#: PySpark spends tens of ms on each Python data source task (measured here: 64 one-segment
#: tasks of 16 MiB read a 1 GiB journal at half the rows/s of 8 packed ones), so small
#: segments are read several to a task.
DEFAULT_PARTITION_BYTES = 128 << 20

#: Segment numbers above this are creation times in ms (after 2001), as ours are.
_MS_NUMBERS = 10**12


@dataclass(frozen=True)
class Selection:
    """The queues a query reads: `subscribe` names, a `subscribePattern`, or all."""

    names: frozenset[str] | None = None
    pattern: re.Pattern[str] | None = None

    def wants(self, queue: str) -> bool:
        return (self.names is None or queue in self.names) and (
            self.pattern is None or self.pattern.fullmatch(queue) is not None)

    def segments(self, path: str, archive: str | None) -> dict[str, list[js.SegmentRef]]:
        """Per wanted queue, its segments (the archive's merged in), by number."""
        by_queue: dict[str, list[js.SegmentRef]] = {}
        for seg in js.list_segments_with_archive(path, archive, self.names):
            if self.wants(seg.queue):
                by_queue.setdefault(seg.queue, []).append(seg)
        return by_queue


@dataclass(frozen=True)
class SegmentRead:
    """One segment file of a queue and the ids wanted from it."""

    queue: str
    path: str
    ids: js.IdFilter = js.ALL_IDS
    #: Where the segment is once the server retires it (archive_dir), if anywhere.
    archived_path: str = ""
    #: A later segment of the queue existed when the query was planned: the server writes
    #: to this one no more, so it is mapped into memory rather than read (as an archived
    #: copy always is); the newest segment is read (a live server appends to it, and may
    #: cut a torn tail off it, which a mapping would not survive).
    settled: bool = False


@dataclass(frozen=True)
class SegmentPartition(InputPartition):
    """Whole segments (or id ranges of them) read by one task, in order; with
    `live_at_ms`, only the items not expired at that time."""

    segments: tuple[SegmentRead, ...]
    live_at_ms: int = 0
    flags: bool = False  # a flags column too (include_flags)
    headers: bool = False  # a headers column too (includeHeaders)


def segment_read(seg: js.SegmentRef, archive: str | None,
                 ids: js.IdFilter = js.ALL_IDS, settled: bool = False) -> SegmentRead:
    """Reading `seg` (`settled`: not the newest segment of its queue)."""
    archived = str(Path(archive) / Path(seg.path).name) if archive else ""
    return SegmentRead(seg.queue, seg.path, ids, "" if archived == seg.path else archived,
                       settled)


def pack(reads: list[tuple[SegmentRead, int]], max_bytes: int,
         live_at_ms: int = 0, flags: bool = False, headers: bool = False,
         ) -> list[InputPartition]:
    """(segment, size) pairs, in order, as partitions of up to `max_bytes` (at least one
    segment each)."""
    parts: list[InputPartition] = []
    group: list[SegmentRead] = []
    size = 0
    for read, nbytes in reads:
        if group and size + nbytes > max_bytes:
            parts.append(SegmentPartition(tuple(group), live_at_ms, flags, headers))
            group, size = [], 0
        group.append(read)
        size += nbytes
    if group:
        parts.append(SegmentPartition(tuple(group), live_at_ms, flags, headers))
    return parts


def split(reads: list[tuple[SegmentRead, js.SegmentSummary]], min_partitions: int,
          live_at_ms: int = 0, flags: bool = False, headers: bool = False,
          ) -> list[InputPartition]:
    """`minPartitions`: the reads cut at batch boundaries into about `min_partitions`
    partitions of similar item counts (a batch is never cut)."""
    def wanted(read: SegmentRead, batches: list[tuple[int, int, int]]) -> int:
        return sum(c for f, last, c in batches if read.ids.wants_range(f, last))

    total = sum(wanted(r, s.batches) for r, s in reads)
    target = max(1, math.ceil(total / min_partitions))
    parts: list[InputPartition] = []
    for read, summary in reads:
        after, acc = read.ids.after, 0
        for first, last, count in summary.batches:
            if not read.ids.wants_range(first, last) or last <= after:
                continue
            acc += count
            end = last if read.ids.upto <= 0 else min(last, read.ids.upto)
            if acc >= target and end > after:
                ids = replace(read.ids, after=after, upto=end)
                parts.append(SegmentPartition((replace(read, ids=ids),), live_at_ms, flags,
                                              headers))
                after, acc = end, 0
        if acc:
            ids = replace(read.ids, after=after)
            parts.append(SegmentPartition((replace(read, ids=ids),), live_at_ms, flags,
                                              headers))
    return parts


def read_partition(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    if not isinstance(partition, SegmentPartition):
        # No segment at all: PySpark still reads one partition (None). No rows.
        return iter(())
    return _read_partition(partition)


def _read_partition(partition: SegmentPartition) -> Iterator[pa.RecordBatch]:
    for seg in partition.segments:
        yield from _read_segment(seg, partition.live_at_ms, partition.flags,
                                 partition.headers)


def _read_segment(seg: SegmentRead, live_at_ms: int,
                  flags: bool = False, headers: bool = False) -> Iterator[pa.RecordBatch]:
    for path, mapped in ((seg.path, seg.settled), (seg.archived_path, True)):
        if not path:
            continue
        try:
            chunks = js.scan_segment(path, seg.ids, mapped=mapped)
            first = next(chunks, None)  # opens the file: a retired one is not found
        except FileNotFoundError:
            continue
        for chunk in itertools.chain([first] if first else [], chunks):
            batch = chunk_to_arrow(seg.queue, chunk, live_at_ms, flags, headers)
            if batch.num_rows:
                yield batch
        return
    raise QueuedDataSourceError(
        f"{seg.path} was removed while the query ran (compaction retired it)"
        + (f", and is not in {Path(seg.archived_path).parent} either"
           if seg.archived_path else
           "; set archive_dir on the server so retired segments are kept, and pass it "
           "with .option('archive_dir', ...)"))


def first_id_at(segments: list[js.SegmentRef], ms: int) -> int | None:
    """The first id of a queue (its segments in number order) whose add_time is >= `ms`,
    or None. A segment whose next one was created before `ms` is skipped unread: a
    segment's items were all added before the next segment was created (its number)."""
    for k, seg in enumerate(segments):
        later = segments[k + 1].number if k + 1 < len(segments) else 0
        if _MS_NUMBERS < later < ms:
            continue
        try:
            for chunk in js.scan_segment(seg.path):
                batch = chunk_to_arrow(seg.queue, chunk)
                added = batch.column("add_time").cast(pa.int64())  # microseconds
                at = pc.index(pc.greater_equal(added, ms * 1000), True).as_py()
                if at >= 0:
                    return int(batch.column("id")[at].as_py())
        except FileNotFoundError:
            continue
        except js.ScanError as exc:
            raise QueuedDataSourceError(str(exc)) from exc
    return None


class ReadOptions:
    """The options batch and stream reads share, parsed once (see docs/spark.md's table)."""

    def __init__(self, options: Options) -> None:
        self.path = path_option(options)
        self.archive = archive_option(options)
        self.selection = Selection(queues_option(options), pattern_option(options))
        self.starting = offsets_option(options, "startingOffsets", "earliest")
        self.start_ms = timestamp_option(options, "startingTimestamp")
        self.start_ms_by = timestamps_option(options, "startingOffsetsByTimestamp")
        self.min_partitions = optional_int(options, "minPartitions")
        self.partition_bytes = int_option(options, "max_partition_bytes",
                                          DEFAULT_PARTITION_BYTES)
        self.flags = bool_option(options, "include_flags")
        self.headers = bool_option(options, "includeHeaders")
        self.loss = LossReporter(
            bool_option(options, "failOnDataLoss") if "failOnDataLoss" in options else True)

    def start_time(self, queue: str) -> int | None:
        """The startingOffsetsByTimestamp of `queue`, else startingTimestamp (or None)."""
        return self.start_ms_by.get(queue) if self.start_ms_by is not None else self.start_ms


LOSS_HINT = (
    ". Set archive_dir in the server's config (retired segments are moved there) and pass "
    "it with .option('archive_dir', ...); or set .option('failOnDataLoss', 'false') to log "
    "a warning and go on from the earliest item there is.")


class LossReporter:
    """failOnDataLoss: raise DataLossError, or log each problem once and go on."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self._warned: set[str] = set()

    def __call__(self, problem: str) -> None:
        if self.fail:
            raise DataLossError(problem + LOSS_HINT)
        if problem not in self._warned:
            self._warned.add(problem)
            log.warning("queued source (failOnDataLoss=false): %s; going on", problem)
