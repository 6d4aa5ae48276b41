"""Open reads: which connection holds which reliable read, and when each one times out.

PURE: no trio, sockets, files or clocks. Deadlines are plain numbers on the caller's
clock (the broker uses trio time) and `now` is always passed in. `OpenReads` is one
connection's ledger; `TimeoutHeap` orders the deadlines of every connection's reads.
The heap never owns a read: an entry is live only while its ledger still holds that
read with that deadline, so a confirm or abort touches the ledger alone and the
heap skips (or compacts away) what it finds already gone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Final

#: The timeout heap is compacted when it holds twice as many reads as are still open,
#: and never below this many (a fast get/confirm loop would grow it without bound).
TIMEOUT_HEAP_MIN = 4096

#: (queue, reader name the read was taken under)
Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class OpenReadsStatistics:
    id: int
    name: str
    open_total: int
    readers: int  # (queue, reader) pairs with a read open


#: Ledger ids, one sequence for the process (module state, not a class attribute: a class
#: compiled by mypyc would make each instance a counter of its own).
_LEDGER_IDS: Final = itertools.count(1)


class OpenReads:
    """One connection's reliable reads: (queue, reader) -> {item id: deadline or None}."""

    def __init__(self, name: str = "") -> None:
        self.id = next(_LEDGER_IDS)
        self.name = name or f"client-{self.id}"
        self.open: dict[Key, dict[int, float | None]] = {}
        self.open_total = 0

    def open_ids(self, queue: str, reader: str) -> list[int]:
        """Ids open on queue/reader, oldest first."""
        return list(self.open.get((queue, reader), ()))

    def open_keys(self) -> list[Key]:
        """Every (queue, reader) with a read open."""
        return list(self.open)

    def holds(self, queue: str, reader: str, item_id: int, deadline: float | None) -> bool:
        """Whether `item_id` is open on queue/reader with exactly this deadline."""
        ids = self.open.get((queue, reader))
        return ids is not None and item_id in ids and ids[item_id] == deadline

    def choose(
        self, queue: str, reader: str, count: int | None, ids: Sequence[int] | None
    ) -> list[int]:
        """Open ids on queue/reader among `ids` (None: all, oldest first), the first `count`."""
        if ids is not None:
            mine = self.open.get((queue, reader), {})
            held = [i for i in dict.fromkeys(ids) if i in mine]
        else:
            held = self.open_ids(queue, reader)
        return held if count is None else held[:count]

    def take(
        self, queue: str, reader: str, count: int | None, ids: Sequence[int] | None
    ) -> dict[int, float | None]:
        """`choose` and `remove_many` in one go (a confirm's or an abort's): the chosen
        reads, closed, each with its deadline, in `choose`'s order."""
        key = (queue, reader)
        mine = self.open.get(key)
        if not mine:
            return {}
        pop = mine.pop
        if ids is None:
            chosen: Iterable[int] = list(mine) if count is None else list(mine)[:count]
            taken = {i: pop(i) for i in chosen}
        elif count is None:  # (a repeated id is not in `mine` once popped)
            taken = {i: pop(i) for i in ids if i in mine}
        else:
            chosen = [i for i in dict.fromkeys(ids) if i in mine][:count]
            taken = {i: pop(i) for i in chosen}
        if not mine:
            del self.open[key]
        self.open_total -= len(taken)
        return taken

    def add(self, queue: str, reader: str, item_id: int, deadline: float | None) -> None:
        """`item_id` is open until `deadline` (None: no deadline). Adding an id that is
        open already only moves its deadline."""
        ids = self.open.setdefault((queue, reader), {})
        if item_id not in ids:
            self.open_total += 1
        ids[item_id] = deadline

    def add_many(self, queue: str, reader: str, ids: Iterable[int],
                 deadline: float | None) -> None:
        """`add` for each of `ids` (one get's batch) with one deadline."""
        mine = self.open.get((queue, reader))
        if mine is None:
            mine = self.open[(queue, reader)] = {}
        before = len(mine)
        mine.update(zip(ids, repeat(deadline)))
        self.open_total += len(mine) - before

    def held_with(self, queue: str, reader: str, ids: Iterable[int],
                  deadline: float) -> list[int]:
        """Those of `ids` open on queue/reader with exactly this deadline."""
        mine = self.open.get((queue, reader))
        if mine is None:
            return []
        get = mine.get
        return [i for i in ids if get(i) == deadline]

    def remove(self, queue: str, reader: str, item_id: int) -> bool:
        """Close one read; False if it was not open."""
        ids = self.open.get((queue, reader))
        if ids is None or item_id not in ids:
            return False
        del ids[item_id]
        if not ids:
            del self.open[(queue, reader)]
        self.open_total -= 1
        return True

    def remove_many(self, queue: str, reader: str, ids: Iterable[int]) -> None:
        """Close these reads (each open: as `choose` returned them)."""
        mine = self.open[(queue, reader)]
        before = len(mine)
        for i in ids:
            del mine[i]
        if not mine:
            del self.open[(queue, reader)]
        self.open_total -= before - len(mine)

    def forget(self, queue: str, reader: str | None = None) -> int:
        """Drop every read on `queue` (reader None) or on queue/reader: they were deleted.
        Returns how many."""
        dropped = 0
        for key in [k for k in self.open if k[0] == queue and reader in (None, k[1])]:
            dropped += len(self.open.pop(key))
        self.open_total -= dropped
        return dropped

    def statistics(self) -> OpenReadsStatistics:
        return OpenReadsStatistics(self.id, self.name, self.open_total, len(self.open))


@dataclass(frozen=True, slots=True)
class TimedOut:
    """A read whose deadline passed, already removed from its ledger."""

    reads: OpenReads
    queue: str
    reader: str
    item_id: int
    deadline: float


@dataclass(frozen=True, slots=True)
class TimeoutHeapStatistics:
    entries: int  # reads, open or not: closed ones go at their deadline or a compaction
    limit: int  # the size that triggers the next compaction
    compactions: int


#: deadline, push order, then the reads pushed together (one get's batch)
_Entry = tuple[float, int, OpenReads, str, str, list[int]]


class TimeoutHeap:
    """The deadlines of open reads, earliest first (in push order among equals).

    One entry per push (a get's batch shares one deadline); sizes count reads, not
    entries, so the bound on what closed reads may leave behind is in reads."""

    def __init__(self, min_size: int = TIMEOUT_HEAP_MIN) -> None:
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._min = min_size
        self._limit = min_size
        self._size = 0  # reads in the entries, open or closed since
        self._compactions = 0

    def __len__(self) -> int:
        return self._size

    def push(
        self, deadline: float, reads: OpenReads, queue: str, reader: str, ids: Iterable[int]
    ) -> bool:
        """Entries for reads just opened in `reads` with `deadline`.

        True if the earliest deadline moved earlier: whoever sleeps until it must wake.
        """
        ids = list(ids)
        if not ids:
            return False
        if self._size + len(ids) > self._limit:
            self.compact()
        wake = not self._heap or deadline < self._heap[0][0]
        heapq.heappush(self._heap, (deadline, next(self._seq), reads, queue, reader, ids))
        self._size += len(ids)
        return wake

    def next_deadline(self) -> float | None:
        """The earliest deadline (perhaps of a read closed since), or None when empty."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[TimedOut]:
        """Every read still open whose deadline is <= now, earliest first, each removed
        from its ledger; entries of reads closed meanwhile are dropped."""
        due: list[TimedOut] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, reads, queue, reader, ids = heapq.heappop(self._heap)
            self._size -= len(ids)
            for item_id in reads.held_with(queue, reader, ids, deadline):
                reads.remove(queue, reader, item_id)
                due.append(TimedOut(reads, queue, reader, item_id, deadline))
        return due

    def compact(self) -> int:
        """Drop the entries of reads already closed; returns how many went."""
        before = self._size
        kept: list[_Entry] = []
        for deadline, seq, reads, queue, reader, ids in self._heap:
            live = reads.held_with(queue, reader, ids, deadline)
            if live:
                kept.append((deadline, seq, reads, queue, reader, live))
        heapq.heapify(kept)
        self._heap = kept
        self._size = sum(len(e[5]) for e in kept)
        self._limit = max(self._min, 2 * self._size)
        self._compactions += 1
        return before - self._size

    def statistics(self) -> TimeoutHeapStatistics:
        return TimeoutHeapStatistics(self._size, self._limit, self._compactions)
