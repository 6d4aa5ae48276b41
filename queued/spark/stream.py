"""The `queued` source's streaming reads: offsets, admission, lost-data checks and lag.

Owns what a micro-batch reads. An offset is, per queue, `{"id": last id read,
"incarnation": the queue's life, "segment": the segment holding that id}`; a queue
deleted and created again is a new incarnation (its segments' heads say so), so its
restarted ids are never mistaken for the old ones. Never writes a journal file.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (  # pyspark >= 4.2 (admission control)
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from queued.spark import scan
from queued.spark.options import (
    EARLIEST,
    LATEST,
    STREAM_OPTIONS,
    Options,
    QueuedDataSourceError,
    duration_option,
    optional_int,
)
from queued.spark.scan import SegmentRead
from queued.storage import journal_scan as js

Summarized = tuple[js.SegmentRef, js.SegmentSummary]


@dataclass(frozen=True)
class Position:
    """One queue's offset: the last id read, in which incarnation and segment."""

    id: int
    incarnation: int = 0
    segment: int = 0

    @classmethod
    def parse(cls, raw: Any) -> Position:
        if isinstance(raw, int):  # offsets written before incarnations: {"q": id}
            return cls(raw)
        try:
            return cls(int(raw["id"]), int(raw.get("incarnation", 0)),
                       int(raw.get("segment", 0)))
        except (TypeError, KeyError, ValueError):
            raise QueuedDataSourceError(f"not a queued stream offset: {raw!r}") from None

    def json(self) -> dict[str, int]:
        return {"id": self.id, "incarnation": self.incarnation, "segment": self.segment}


@dataclass
class QueueNow:
    """A queue's segments of its current incarnation that hold items, oldest first."""

    incarnation: int
    segs: list[Summarized] = field(default_factory=list)

    @property
    def first(self) -> int:
        return self.segs[0][1].first_id

    @property
    def last(self) -> int:
        return self.segs[-1][1].last_id

    def segment_of(self, xid: int) -> int:
        """The number of the newest segment whose first id is <= xid (0 if none)."""
        found = 0
        for seg, summary in self.segs:
            if summary.first_id <= xid:
                found = seg.number
        return found

    def position(self, xid: int) -> Position:
        return Position(xid, self.incarnation, self.segment_of(xid))


class QueuedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A micro-batch reads ids in (start, end] of each queue, from the journal files.

    Options (docs/spark.md): subscribe / subscribePattern, startingOffsets (alias
    starting), startingTimestamp, startingOffsetsByTimestamp, maxOffsetsPerTrigger (alias
    max_items_per_trigger), minOffsetsPerTrigger with maxTriggerDelay, failOnDataLoss,
    minPartitions, archive_dir, max_partition_bytes, include_flags, includeHeaders.
    """

    def __init__(self, options: Any) -> None:
        if not isinstance(options, Options):
            options = Options(options, STREAM_OPTIONS, "spark.readStream")
        self.o = o = scan.ReadOptions(options)
        self.selection, self.loss = o.selection, o.loss
        self.max_items = optional_int(options, "maxOffsetsPerTrigger")
        self.min_items = optional_int(options, "minOffsetsPerTrigger")
        self.max_delay = duration_option(options, "maxTriggerDelay", 15 * 60.0)
        self._summaries: dict[str, tuple[tuple[int, int, int], js.SegmentSummary]] = {}
        self._available_now: dict[str, Position] | None = None
        self._last_trigger = time.monotonic()
        self._latest: dict[str, Position] = {}
        self._end: dict[str, Position] = {}

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

    def _queues(self) -> dict[str, QueueNow]:
        """Per wanted queue with items, its current incarnation's segments (the newest
        segment's); older incarnations' segments (an archive's, say) are left out."""
        found: dict[str, QueueNow] = {}
        for queue, segments in self.selection.segments(self.o.path, self.o.archive).items():
            # A segment naming no incarnation (one from before incarnations, or whose header
            # recovery rewrote) belongs to the life of the one before it, if any.
            life, lives = 0, []
            for seg in segments:  # by number: oldest first
                summary = self._summary(seg)
                if summary is not None:
                    life = summary.incarnation or life
                    lives.append((seg, summary, life))
            if not lives:
                continue
            now = QueueNow(lives[-1][2])
            now.segs = [(seg, s) for seg, s, k in lives if s.count and k == now.incarnation]
            if now.segs:
                found[queue] = now
        return found

    def _resume(self, queue: str, start: Position | None, now: QueueNow) -> int:
        """The last id read of `queue` to go on from, after checking that nothing the
        stream has not read is gone (failOnDataLoss)."""
        if start is None:
            return now.first - 1  # a queue new to the stream: from its earliest item
        if start.incarnation != now.incarnation:
            self.loss(f"queue {queue!r} was deleted and created again (incarnation "
                      f"{start.incarnation} -> {now.incarnation}): items of the old queue "
                      f"after id {start.id} that the stream had not read are lost, and the "
                      f"new queue's ids start again (at {now.first})")
            return now.first - 1
        if start.id + 1 < now.first and not any(
                seg.number == start.segment for seg, _ in now.segs):
            self.loss(f"ids {start.id + 1}..{now.first - 1} of queue {queue!r} are gone "
                      "(their segments were retired by compaction)")
            return now.first - 1
        return start.id

    def _check_compacted(self, queue: str, after: int, upto: int, now: QueueNow) -> None:
        compacted = [seg.path for seg, s in now.segs
                     if s.compacted and s.last_id > after and s.first_id <= upto]
        if compacted:
            self.loss(f"{compacted[0]} (queue {queue!r}) was rewritten by compaction and "
                      f"holds only some of the ids the stream needs after {after}")

    # The DataSourceStreamReader API.

    def initialOffset(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for queue, now in self._queues().items():
            start_ms = self.o.start_time(queue)
            if start_ms is not None:
                first = scan.first_id_at([seg for seg, _ in now.segs], start_ms)
                xid = now.last if first is None else first - 1
            else:
                spec = self.o.starting
                choice = spec.get(queue, EARLIEST) if isinstance(spec, dict) else (
                    LATEST if spec == "latest" else EARLIEST)
                xid = {EARLIEST: now.first - 1, LATEST: now.last}.get(choice, choice - 1)
            out[queue] = now.position(min(xid, now.last)).json()
        return out

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_items:
            return ReadMaxRows(self.max_items)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = {q: now.position(now.last) for q, now in self._queues().items()}

    def latestOffset(self, start: dict[str, Any] | None = None,
                     limit: ReadLimit | None = None) -> dict[str, Any]:
        starts = {q: Position.parse(v) for q, v in (start or {}).items()}
        queues = self._queues()
        afters: dict[str, int] = {}
        ends: dict[str, int] = {}
        for q, now in queues.items():
            after = afters[q] = self._resume(q, starts.get(q), now)
            last = now.last
            cap = None if self._available_now is None else self._available_now.get(q)
            if self._available_now is not None:
                last = min(last, cap.id) if cap and cap.incarnation == now.incarnation else after
            ends[q] = max(after, last)
        self._latest = {q: now.position(now.last) for q, now in queues.items()}
        if self.min_items and self._available_now is None:
            waiting = self._admit(afters, ends, queues, self.min_items)
            have = sum(waiting[q] - afters[q] for q in waiting)
            if have < self.min_items and time.monotonic() - self._last_trigger < self.max_delay:
                ends = afters  # minOffsetsPerTrigger: wait for more, up to maxTriggerDelay
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else 0
        if budget > 0:
            ends = self._admit(afters, ends, queues, budget)
        out = {q: v.json() for q, v in starts.items() if q not in queues}  # gone for now
        self._end = {q: queues[q].position(x) for q, x in ends.items()}
        out.update({q: p.json() for q, p in self._end.items()})
        if any(ends[q] > afters[q] for q in ends):
            self._last_trigger = time.monotonic()
        return out

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """Per queue the newest id there is, and how far the stream's end offset is
        behind it (`offsetsBehindLatest`, Kafka's lag): shown as the source's
        `latestOffset` in the query's progress."""
        if not self._latest:
            return None
        return {q: p.json() | {"offsetsBehindLatest": max(0, p.id - self._end[q].id)
                                if q in self._end and
                                self._end[q].incarnation == p.incarnation else p.id}
                for q, p in self._latest.items()}

    def _admit(self, start: dict[str, int], end: dict[str, int],
               queues: dict[str, QueueNow], budget: int) -> dict[str, int]:
        """End offsets holding at most `budget` items, shared fairly between queues."""
        out = dict(start)
        pending = sorted(q for q in end if end[q] > start[q])
        while budget > 0 and pending:
            share = max(1, budget // len(pending))
            still: list[str] = []
            for q in pending:
                if budget <= 0:
                    break
                took, new_end = self._advance(queues[q].segs, out[q], end[q],
                                              min(share, budget))
                out[q] = new_end
                budget -= took
                if took and new_end < end[q]:
                    still.append(q)
            pending = still
        return out

    @staticmethod
    def _advance(segs: list[Summarized], after: int, upto: int, n: int) -> tuple[int, int]:
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

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        starts = {q: Position.parse(v) for q, v in start.items()}
        queues = self._queues()
        reads: list[tuple[SegmentRead, js.SegmentSummary]] = []
        sizes: list[int] = []
        for q in sorted(end):
            stop = Position.parse(end[q])
            now = queues.get(q)
            begin = starts.get(q)
            if now is None or now.incarnation != stop.incarnation:
                if stop.id > (begin.id if begin else 0):
                    self.loss(f"the items of queue {q!r} up to id {stop.id} that this "
                              "micro-batch was to read are gone (the queue was deleted)")
                continue
            after = self._resume(q, begin, now)
            if stop.id <= after:
                continue
            self._check_compacted(q, after, stop.id, now)
            ids = js.IdFilter(after, stop.id)
            for k, (seg, summary) in enumerate(now.segs):
                if summary.last_id > after and summary.first_id <= stop.id:
                    settled = k + 1 < len(now.segs)  # (not the newest: see SegmentRead)
                    reads.append((scan.segment_read(seg, self.o.archive, ids, settled),
                                  summary))
                    sizes.append(seg.size)
        o = self.o
        parts = scan.pack([(r, n) for (r, _), n in zip(reads, sizes, strict=True)],
                          o.partition_bytes, flags=o.flags, headers=o.headers)
        if len(parts) < o.min_partitions:
            return scan.split(reads, o.min_partitions, flags=o.flags, headers=o.headers)
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return scan.read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        live = {seg.path for now in self._queues().values() for seg, _ in now.segs}
        for path in [p for p in self._summaries if p not in live]:
            del self._summaries[path]
