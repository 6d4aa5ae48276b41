"""Reading a queue's items back from its journal: the blocking half of read-behind,
startup counts and drop_oldest, each run in a worker thread by its caller.

Only plain functions over the journal's public reads (`segments`, `iter_segment`,
`iter_puts`); no trio and no reader state here: callers apply what comes back.
"""

from __future__ import annotations

import bisect

from queued.core.queue import Item
from queued.storage.journal import QueueJournal
from queued.storage.recovery import SegmentInfo

#: Items read back from the journal per worker-thread call, at most.
REFILL_MAX_ITEMS = 50_000


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


def segment_sizes(journal: QueueJournal, seg: SegmentInfo) -> list[tuple[int, int]]:
    """(id, data size) of every item in one segment."""
    return [(p.id, len(p.data)) for p in journal.iter_segment(seg, 1, None)]


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
