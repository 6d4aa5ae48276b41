"""Parked queues: what stays in memory of a queue nobody used for `park_after`.

A parked queue's journal is closed and dropped from the data directory and its state
and readers from the registry, as a clean shutdown would leave that one queue; what
remains is its name and a `ParkedQueue` summary packed into a few dozen bytes of
MessagePack: what `stats`, /metrics and max_queues need, and the names of its files
(so loading it lists no directory). The registry parks and loads; this module decides
whether a queue may park and what its summary holds. It never touches a file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from queued.broker.live_readers import stats_fields
from queued.reader.shared import ReaderCounters
from queued.storage.journal import JournalStats

if TYPE_CHECKING:
    from queued.broker.queues import QueueState

#: A queue parks only when every reader holds at most this many items and bytes, and its
#: journal at most PARK_MAX_JOURNAL_BYTES in PARK_MAX_SEGMENTS segments: loading it again
#: (recovery of its files and reading its backlog) happens synchronously, on first use.
PARK_MAX_ITEMS = 64
PARK_MAX_BYTES = 64 << 10
PARK_MAX_JOURNAL_BYTES = 1 << 20
PARK_MAX_SEGMENTS = 4
#: Queues the parker looks at per tick (a bounded slice: not all 10,000 every tick).
PARK_SCAN = 1000

_COUNTERS = tuple(f.name for f in dataclasses.fields(ReaderCounters))


@dataclass(frozen=True, slots=True)
class ParkedReader:
    name: str
    create_time_ms: int
    items: int
    bytes: int
    oldest_add_ms: int  # when the oldest waiting item was put; 0: none waits
    counters: ReaderCounters


@dataclass(frozen=True, slots=True)
class ParkedQueue:
    create_time_ms: int
    last_id: int  # ids stay above it once loaded
    logsize: int  # journal bytes
    segments: tuple[int, ...]  # numbers of its segment files
    fsyncs: int
    write_errors: int
    readers: tuple[ParkedReader, ...]

    def journal_stats(self, name: str) -> JournalStats:
        """The journal figures /metrics exports, as they were when it parked."""
        return JournalStats(queue=name, segments=len(self.segments), bytes=self.logsize,
                            pending_bytes=0, last_id=self.last_id, appends=0,
                            items_appended=0, batches_written=0, fsyncs=self.fsyncs,
                            write_errors=self.write_errors, failed=False,
                            readers=len(self.readers))

    @property
    def empty(self) -> bool:
        return not any(r.items for r in self.readers)


def pack(p: ParkedQueue) -> bytes:
    """`p` as a few dozen bytes (a tuple of these fields is ~4x that). Times are kept
    as offsets from the queue's create time: small numbers take one to five bytes where
    a unix time in ms takes nine."""
    t = p.create_time_ms
    data: bytes = msgpack.packb([
        t, p.last_id, p.logsize, [n - t for n in p.segments], p.fsyncs, p.write_errors,
        [[r.name, r.create_time_ms - t, r.items, r.bytes,
          r.oldest_add_ms - t if r.oldest_add_ms else None,
          *dataclasses.astuple(r.counters)] for r in p.readers],
    ])
    return data


def unpack(data: bytes) -> ParkedQueue:
    t, last_id, logsize, segments, fsyncs, write_errors, readers = msgpack.unpackb(data)
    n = len(_COUNTERS)
    parked = tuple(ParkedReader(r[0], t + r[1], r[2], r[3], 0 if r[4] is None else t + r[4],
                                ReaderCounters(*r[5:5 + n])) for r in readers)
    return ParkedQueue(t, last_id, logsize, tuple(t + s for s in segments), fsyncs,
                       write_errors, parked)


def summarize(qs: QueueState) -> ParkedQueue:
    """The summary of `qs`, which `parkable` allowed to park."""
    j = qs.journal
    files = j.files()
    readers = []
    for rname, h in sorted(qs.readers.items()):
        r = h.reader
        readers.append(ParkedReader(rname, r.create_time_ms, r.items, r.bytes,
                                    r.oldest_add_time_ms() or 0,
                                    dataclasses.replace(r.counters)))
    return ParkedQueue(qs.create_time_ms, j.last_id, j.total_bytes,
                       tuple(s.number for s in j.segments),
                       sum(f.fsyncs for f in files), sum(f.write_errors for f in files),
                       tuple(readers))


def parkable(qs: QueueState) -> bool:
    """Nothing moving and a small backlog: no puts in flight or being begun, no reader
    or journal lock held (a takeover, refill, compaction, drop), no failed checkpoint;
    each reader with no waiter, open read, move, refill or delayed item, and at most
    PARK_MAX_ITEMS / PARK_MAX_BYTES waiting (all of them in memory). Checkpoints may
    still be due: parking writes them first, then asks again."""
    if (qs.deleted or qs.inflight or qs.busy or qs.unsaved_checkpoints or not qs.readers
            or qs.reader_busy):
        return False
    j = qs.journal
    if (j.maintenance_busy or len(j.segments) > PARK_MAX_SEGMENTS
            or j.total_bytes > PARK_MAX_JOURNAL_BYTES):
        return False
    for h in qs.readers.values():
        r = h.reader
        if (h.waiters or h.refilling or h.closed or h.refill_busy or r.open or r.moving
                or r.delays or r.delayed_count or r.due or r.behind is not None
                or r.flush_overflow or r.items > PARK_MAX_ITEMS or r.bytes > PARK_MAX_BYTES):
            return False
    return True


def park_tick(park_after_ms: int) -> float:
    """Seconds between the parker's looks (a tenth of park_after, 10 ms to 1 s; 1 s
    while parking is off)."""
    if not park_after_ms:
        return 1.0
    return min(1.0, max(0.01, park_after_ms / 10_000))


def reader_fields(p: ParkedQueue, r: ParkedReader, now_ms: int,
                  paused: bool = False) -> dict[str, int]:
    """The `stats` fields of parked reader `r` of `p`: what they were when it parked, but
    memory (it holds none now) and the oldest item's age (it goes on ageing)."""
    return stats_fields(r.items, r.bytes, r.counters, p.logsize, 0, 0, 0, 0, r.create_time_ms,
                        max(0, now_ms - r.oldest_add_ms) if r.oldest_add_ms else 0, 0, paused)
