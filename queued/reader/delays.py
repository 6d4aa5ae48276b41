"""A reader's delayed items: the heap of due times, the data it keeps for them, and the
due items waiting to be delivered.

PURE: no sockets, files, clocks or trio; the time comes in as `now_ms` arguments. It is
a mixin of `Reader` (reader/state.py), not an object of its own: a reader's hot path reads
`delayed` and `due` as its own attributes (one test per take, no call), and a delayed item
is counted in the reader's `items`, `bytes` and `mem_bytes` like any other.

A delayed item (a `DelayedPut`, or an item an abort gave a delay) waits in `delayed`, a
heap of int keys (due ms, id, data size) -- about 56 bytes per item -- with its data in
`parked` while memory is under half full (`max_memory_size`, shared with the reader's
`mem`); the rest of the data stays on disk. Once due (`promote`), it joins `due`,
delivered after the reader's `front` and before its `mem`, in due-time order (ties in id
order); a due item whose data is on disk waits there as its key until the broker reads
it back (`fetch_ids`, `fetched`). Read-behind skips delayed items (`skips`): the heap
owns them. `delay_low` keeps the lowest id delayed or due for the checkpoint.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable

from queued.journal.format import DelayedPut, Put
from queued.reader.shared import NO_ENTRIES, NO_ITEMS, NO_LIST, ReaderCounters, ReaderLimits

#: Delay heap keys: due ms << DUE_SHIFT | id << SIZE_BITS | data size.
SIZE_BITS = 32
DUE_SHIFT = 96
ID_MASK = (1 << 64) - 1
SIZE_MASK = (1 << SIZE_BITS) - 1


def delay_key(due_ms: int, item_id: int, size: int) -> int:
    return (due_ms << DUE_SHIFT) | (item_id << SIZE_BITS) | size


def key_id(key: int) -> int:
    return (key >> SIZE_BITS) & ID_MASK


def key_size(key: int) -> int:
    return key & SIZE_MASK


def key_due(key: int) -> int:
    return key >> DUE_SHIFT


class DelayedItems:
    """The delay half of a `Reader` (see the module docstring)."""

    # The reader's own state, which delayed items are counted in (set by Reader.__init__).
    limits: ReaderLimits
    counters: ReaderCounters
    items: int
    bytes: int
    mem_bytes: int
    head: int
    done: set[int]
    errors: dict[int, int]

    # The reader's, which a delayed item's data is held and read by: methods here (not
    # declared under TYPE_CHECKING, which a compiled class body cannot hold), Reader's
    # override them.
    def held_size(self, it: Put) -> int:
        raise NotImplementedError

    def refill_budget(self) -> int:
        raise NotImplementedError

    def start_delays(self, delays: Iterable[tuple[int, int]]) -> None:
        """Empty delay state; `delays`: (id, due ms) of items an abort delayed, from the
        reader's checkpoint (call once `head` and `done` are set)."""
        #: id -> due ms, for outstanding items an abort gave a delay (journaled in the
        #: reader's file: the PUT record does not know it)
        self.delays: dict[int, int] = {i: d for i, d in delays
                                       if i > self.head and i not in self.done} or NO_ENTRIES
        self.delayed: list[int] = NO_LIST  # heap of delay_key(due, id, size), not due yet
        self.parked: dict[int, Put] = NO_ENTRIES  # data of delayed items held in memory
        self.due: deque[Put | int] = NO_ITEMS  # due: items, or keys whose data is on disk
        #: lowest id delayed or due, or lower (exact while `low_exact`); None: none since
        #: the last checkpoint (then consume may move the head itself)
        self.delay_low: int | None = None
        self.low_exact = True

    def delay(self, it: Put, due_ms: int, *, keep: bool = True) -> None:
        """`it` (counted in items/bytes already) waits until `due_ms`; its data stays in
        memory if `keep` and memory is under half full with it, else on disk (read back
        once due): the other half stays for read-behind of the items that flow."""
        n = len(it.data)
        if self.delayed is NO_LIST:
            self.delayed = []
        heapq.heappush(self.delayed, delay_key(due_ms, it.id, n))
        if keep and (self.mem_bytes + n + len(it.headers) <= self.limits.max_memory_size // 2
                     or not self.mem_bytes):
            if self.parked is NO_ENTRIES:
                self.parked = {}
            self.parked[it.id] = it
            self.mem_bytes += self.held_size(it)
        low = self.delay_low
        if low is None or it.id < low:
            self.delay_low = it.id
            if low is None:
                self.low_exact = True

    def delay_back(self, it: Put, due_ms: int) -> None:
        """An item this reader had handed out waits again, until `due_ms` (an abort with
        a delay); `delays` keeps the due time for the checkpoint."""
        n = len(it.data)
        self.items += 1
        self.bytes += n
        if self.delays is NO_ENTRIES:
            self.delays = {}
        self.delays[it.id] = due_ms
        self.delay(it, due_ms)

    def restore_delayed(self, entries: Iterable[tuple[int, int, int]]) -> None:
        """After recovery: (due ms, id, size) of delayed items on disk (already counted
        by `restore`)."""
        if self.delayed is NO_LIST:
            self.delayed = []
        for due_ms, item_id, size in entries:
            self.delayed.append(delay_key(due_ms, item_id, size))
            if self.delay_low is None or item_id < self.delay_low:
                if self.delay_low is None:
                    self.low_exact = True
                self.delay_low = item_id
        heapq.heapify(self.delayed)

    def next_due_ms(self) -> int | None:
        return self.delayed[0] >> DUE_SHIFT if self.delayed else None

    def promote(self, now_ms: int) -> int:
        """Delayed items due at `now_ms` join `due`, in due order; how many."""
        heap, parked = self.delayed, self.parked
        if not heap or heap[0] >> DUE_SHIFT > now_ms:
            return 0
        due = self.due
        if due is NO_ITEMS:
            due = self.due = deque()
        n = 0
        while heap and heap[0] >> DUE_SHIFT <= now_ms:
            key = heapq.heappop(heap)
            it = parked.pop(key_id(key), None)
            due.append(key if it is None else it)
            n += 1
        return n

    def fetch_ids(self, limit: int) -> list[int]:
        """Ids of the due items at the head of `due` whose data is on disk (at most
        `limit`, and no more bytes than read-behind's memory budget allows, one at
        least): the broker reads them back and hands them to `fetched`."""
        out: list[int] = []
        budget = self.refill_budget()
        for entry in self.due:
            if type(entry) is not int or len(out) >= limit:
                break
            budget -= key_size(entry)
            if budget < 0 and out:
                break
            out.append(key_id(entry))
        return out

    def wants_fetch(self) -> bool:
        return bool(self.due) and type(self.due[0]) is int

    def fetched(self, items: Iterable[Put], asked: Iterable[int]) -> int:
        """Due items read back from disk for the ids `asked` (from `fetch_ids`); an asked
        id the journal no longer held leaves (counted discarded). How many left so."""
        got = {it.id: it for it in items}
        asked_ids = set(asked)
        due = self.due
        lost = 0
        for k, entry in enumerate(due):
            if not isinstance(entry, int) or key_id(entry) not in asked_ids:
                continue
            it = got.get(key_id(entry))
            if it is None:
                lost += 1
                continue
            if self.errors and it.id in self.errors:
                it = it.with_error_count(self.errors[it.id])
            due[k] = it
            self.mem_bytes += self.held_size(it)
        if lost:
            gone = asked_ids - got.keys()
            self.drop_delayed(lambda i: i in gone)
        return lost

    def skips(self, it: Put) -> bool:
        """Read-behind leaves this item alone: the delay heap owns it."""
        return type(it) is DelayedPut or it.id in self.delays

    @property
    def delayed_count(self) -> int:
        return len(self.delayed)

    # -- leaving -----------------------------------------------------------------------

    def drop_delayed(self, drop: Callable[[int], bool]) -> list[int]:
        """Delayed and due items whose id `drop` picks leave (counted discarded); their ids."""
        gone: list[int] = []
        keep: list[int] = []
        for key in self.delayed:
            if drop(key_id(key)):
                gone.append(key_id(key))
                self.forget_delayed(key_id(key), key_size(key),
                                    self.parked.pop(key_id(key), None))
            else:
                keep.append(key)
        if len(keep) != len(self.delayed):
            heapq.heapify(keep)
            self.delayed = keep
        kept: deque[Put | int] = deque()
        for entry in self.due:
            if isinstance(entry, int):
                i, size, held = key_id(entry), key_size(entry), None
            else:
                i, size, held = entry.id, len(entry.data), entry
            if drop(i):
                gone.append(i)
                self.forget_delayed(i, size, held)
            else:
                kept.append(entry)
        self.due = kept or NO_ITEMS
        return gone

    def forget_delayed(self, item_id: int, size: int, held: Put | None) -> None:
        """A delayed or due item (`size` bytes of data, `held` if its data is in memory)
        leaves uncounted by a take: counted discarded."""
        if item_id == self.delay_low:
            self.low_exact = False
        self.items -= 1
        self.bytes -= size
        self.counters.discarded += 1
        if held is not None:
            self.mem_bytes -= size + len(held.headers)
        self.delays.pop(item_id, None)

    def delayed_ids(self) -> list[int]:
        """Ids of every delayed and due item (for a flush's list of consumed ids)."""
        ids = [key_id(k) for k in self.delayed]
        ids += [key_id(e) if isinstance(e, int) else e.id for e in self.due]
        return ids

    def clear_delays(self) -> None:
        """Every delayed and due item is gone (a flush; the reader recounts itself)."""
        self.delayed = NO_LIST
        self.parked.clear()
        self.due = NO_ITEMS
        self.delays.clear()
        self.delay_low = None

    # -- checkpoints -------------------------------------------------------------------

    def delay_low_id(self) -> int | None:
        """The lowest id delayed or due, for the checkpoint (None: none); exact."""
        if self.delay_low is None:
            return None
        return self.delay_low if self.low_exact else self.delayed_low_id()

    def delayed_low_id(self) -> int | None:
        """The lowest id delayed or due (exact; O(delayed items)); also resets
        `delay_low` to it, or to None when nothing is delayed. The checkpoint calls it
        only once the lowest one has left since it last did."""
        low = min(((k >> SIZE_BITS) & ID_MASK for k in self.delayed), default=None)
        for e in self.due:
            i = key_id(e) if isinstance(e, int) else e.id
            if low is None or i < low:
                low = i
        self.delay_low = low
        self.low_exact = True
        return low

    def delay_entries(self) -> list[tuple[int, int]]:
        """(id, due ms) of outstanding items an abort delayed, for the checkpoint; drops
        ids at or below the head (call after `checkpoint`)."""
        if self.delays:
            self.delays = {i: d for i, d in self.delays.items()
                           if i > self.head and i not in self.done}
        return sorted(self.delays.items())
