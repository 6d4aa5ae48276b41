"""Reading a queue's items back from its journal: the blocking half of read-behind,
startup counts and drop_oldest, each run in a worker thread by its caller.

Only plain functions over the journal's public reads (`segments`, `iter_segment`,
`iter_puts`); no trio and no reader state here: callers apply what comes back.
"""

from __future__ import annotations

import bisect

from queued.journal.format import DelayedPut
from queued.reader.state import Item
from queued.storage.journal import QueueJournal
from queued.storage.recovery import SegmentInfo

#: Items read back from the journal per worker-thread call, at most.
REFILL_MAX_ITEMS = 50_000
#: Items read back that go into a reader's memory in one step of the event loop (the
#: rest after other work has run): ~3 ms compiled.
LOAD_SLICE = 4_096


def count_unconsumed(journal: QueueJournal, head: int, done: frozenset[int]) -> tuple[int, int]:
    """(items, bytes) a reader has not consumed: ids above `head` and not in `done`.

    A segment without a `done` id inside is counted from what recovery learnt while
    verifying it (count and data bytes); only the others are decoded again.
    """
    count = nbytes = 0
    done_sorted = sorted(done)
    for seg in list(journal.segments):
        if not seg.count or seg.last_id <= head:
            continue
        lo = bisect.bisect_left(done_sorted, seg.first_id)
        clean = lo == len(done_sorted) or done_sorted[lo] > seg.last_id
        if seg.first_id > head and clean and seg.data_bytes is not None:
            count += seg.count
            nbytes += seg.data_bytes
            continue
        for put in journal.iter_segment(seg, head + 1, None):
            if put.id not in done:
                count += 1
                nbytes += len(put.data)
    return count, nbytes


def segment_sizes(journal: QueueJournal, seg: SegmentInfo) -> list[tuple[int, int, bool]]:
    """(id, data size, delayed) of every item in one segment."""
    return [(p.id, len(p.data), type(p) is DelayedPut)
            for p in journal.iter_segment(seg, 1, None)]


#: Due items read back from the journal per worker-thread call, at most.
FETCH_MAX_ITEMS = 10_000


def read_ids(journal: QueueJournal, ids: list[int]) -> list[Item]:
    """The items with these ids (any order) that the journal still holds.

    Each segment holding some is read from its index entry before the lowest wanted id
    up to the highest (delayed items put together sit together; scattered ones cost
    the reading of what lies between them in a segment)."""
    wanted = set(ids)
    out: list[Item] = []
    ordered = sorted(wanted)
    k = 0
    for seg in list(journal.segments):
        if k >= len(ordered):
            break
        if not seg.count or seg.last_id < ordered[k]:
            continue
        hi = bisect.bisect_right(ordered, seg.last_id)
        if hi > k:
            for put in journal.iter_segment(seg, ordered[k], ordered[hi - 1]):
                if put.id in wanted:
                    out.append(put)
        k = hi
    return out


def find_delayed(
    journal: QueueJournal, head: int, done: frozenset[int], delays: dict[int, int],
) -> list[tuple[int, int, int]]:
    """(due ms, id, size) of every delayed item a reader has not consumed: PUTs led by a
    DELAY record (only segments recovery saw one in are read) and the ids its
    checkpoint lists with an abort's due time (the later of the two wins)."""
    out: dict[int, tuple[int, int, int]] = {}
    for seg in list(journal.segments):
        if not seg.count or seg.last_id <= head or not seg.delayed:
            continue
        for put in journal.iter_segment(seg, head + 1, None):
            if type(put) is DelayedPut and put.id not in done:
                out[put.id] = (max(put.due_ms, delays.get(put.id, 0)), put.id, len(put.data))
    rest = sorted(i for i in delays if i not in out and i > head and i not in done)
    for put in read_ids(journal, rest) if rest else ():
        out[put.id] = (delays[put.id], put.id, len(put.data))
    return list(out.values())


def read_live(journal: QueueJournal, start: int, end: int, n: int, skip: frozenset[int],
              now_ms: int) -> list[Item]:
    """Up to `n` items with ids in [start, end], in id order, but those in `skip`
    (consumed, or delayed by an abort), delayed puts and expired items (for browse)."""
    out: list[Item] = []
    for put in journal.iter_puts(start, end):
        if put.id in skip or type(put) is DelayedPut or (
                put.expire_time_ms is not None and put.expire_time_ms <= now_ms):
            continue
        out.append(put)
        if len(out) >= n:
            break
    return out


def read_range(
    journal: QueueJournal, start: int, end: int, budget: int
) -> tuple[list[Item], int]:
    """Items with ids in [start, end] up to `budget` bytes; and the id to continue from."""
    items: list[Item] = []
    nbytes = 0
    for put in journal.iter_puts(start, end):
        if items and (nbytes + len(put.data) > budget or len(items) >= REFILL_MAX_ITEMS):
            return items, put.id
        items.append(put)
        nbytes += len(put.data)
    return items, end + 1
