"""One reader's view of a queue: items in memory, read-behind, open reads, its checkpoint.

PURE: no sockets, files, clocks or trio. The broker feeds it durable items (`add`),
items read back from the journal (`load`), and the time (`now_ms` arguments); it
answers with items and with the checkpoint to write. Items are `journal_format.Put`
records, shared between readers and never mutated (an abort makes a copy).

Ordering. `front` holds aborted items (delivered first, Kestrel's "back to the
head"); `unpacked`, `packed` and `mem` hold the next items in id order (`_held`); ids
from `behind` to `tail` are on disk only (read-behind) and come back through `load`.
Every id in `front` or in `open` is lower than every held id, and every held id is
lower than `behind`: that is what makes the checkpoint cheap to compute.

Packing. New items join `mem`, a deque of objects; once `pack_at` wait there, its
oldest go to `packed` (PackedItems), `pack_block` at a time: ~84 B of RSS a 64 B item
instead of ~237 B. Takes unpack a whole block into `unpacked` (equal copies, newest
first, so that taking one is a list's `pop()`). Consumers that keep the backlog under
`pack_at` never meet a packed block. Each reader packs its own copies, where objects
are shared by a queue's readers: a fanout queue's readers pack only the sizes that
saves memory on (`pack_max_for`, set by the queue as it hands them items).

Delays. Delayed items (`delayed`, `parked`, `due`, `delays`) and their methods are the
`DelayedItems` mixin's (reader/delays.py): due items are delivered after `front` and
before the held items; read-behind (`load`) skips delayed items, which the heap owns.

Checkpoint. Every id <= head is consumed; ids in `done` above head are consumed
too. head is one below the lowest outstanding id (available, open, or being moved
to another queue), or `tail` when nothing is outstanding; `done` only has to hold
ids consumed while a lower id was still outstanding. `errors` holds the error count of
every outstanding item an abort raised above its PUT record's (the journal keeps
those in the reader's file); items read back from the journal get theirs from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice, repeat
from operator import attrgetter
from typing import Any, Final

from queued.journal.format import DelayedPut, HeadedPut, Put
from queued.reader import shared
from queued.reader.delays import DUE_SHIFT, DelayedItems
from queued.reader.packed_items import BLOCK_ITEMS, SMALL_MAX, PackedItems
from queued.reader.shared import (
    NO_ENTRIES,
    NO_IDS,
    NO_LIST,
    ReaderCounters,
    ReaderLimits,
)

Item = Put
#: items the bulk add takes (a DelayedPut is a Put subclass: not in it)
_PUT_ONLY: Final = frozenset({Put, HeadedPut})
_DATA: Final = attrgetter("data")
_HEADERS: Final = attrgetter("headers")
#: (C statics compiled, not look-ups in the module's globals at each use)
NO_ITEMS: Final[Any] = shared.NO_ITEMS
_new_deque: Final = deque

#: Most ids a flush lists in `done` while a lower id is still open (see Reader.flush).
FLUSH_DONE_CAP = 100_000

#: `mem` packs its oldest PACK_BLOCK items (into `packed`) once it holds PACK_AT. Packing
#: and unpacking cost ~0.5 us a 64 B item, 3% of a put and a get: the backlog of a steady
#: flow (a few hundred items with 32 puts in flight) stays objects, at most ~300 KiB of
#: them a reader over what packed items would take.
PACK_BLOCK = BLOCK_ITEMS
PACK_AT = 16 * BLOCK_ITEMS


def pack_max_for(readers: int) -> int:
    """The longest data worth packing for one of `readers` readers sharing the items they
    are handed (-1: none). A shared item costs ~145 B beyond its data, once, and a slot of
    8 B a reader; packed, each reader holds its own copy, ~30 B beyond the data. Measured
    (tracemalloc, 20,000 items held): packing saves memory up to SMALL_MAX with one
    reader, below ~100 B with two, ~40 B with three, never from seven."""
    if readers <= 1:
        return SMALL_MAX
    return max(-1, (145 - 22 * readers) // (readers - 1))


def _count_within(items: Iterator[Item], limit: int, max_bytes: int) -> int:
    """How many of `items` (at most `limit`) a get takes: with `max_bytes`, it stops
    once that much data is reached (one item at least)."""
    if not max_bytes:
        return limit
    total = k = 0
    for it in items:
        if k == limit or total >= max_bytes:
            break
        total += len(it.data) + len(it.headers)
        k += 1
    return k


class Reader(DelayedItems):
    """See the module docstring."""

    #: PACK_AT and PACK_BLOCK (class attributes, so a test can pack in small blocks)
    pack_at = PACK_AT
    pack_block = PACK_BLOCK
    #: data longer than this stays an object (the queue lowers it for a fanout queue's
    #: readers, which share the objects they are handed: see pack_max_for)
    pack_max = SMALL_MAX
    #: True once the reader held an item with headers: the bulk take counts their bytes
    #: from then on (a class default: a reader that never held one pays nothing)
    headed = False

    def __init__(
        self,
        queue: str,
        name: str,
        limits: ReaderLimits,
        *,
        head: int = 0,
        done: Iterable[int] = (),
        tail: int = 0,
        create_time_ms: int = 0,
        errors: Iterable[tuple[int, int]] = (),
        delays: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.queue = queue
        self.name = name
        self.limits = limits
        # Unused, the deques hold NO_ITEMS, `unpacked` NO_LIST and `packed` None (see
        # queued.reader.shared); a container is made on first use.
        self.front: deque[Item] = NO_ITEMS
        self.unpacked: list[Item] = NO_LIST  # the oldest packed block, made again, newest first
        self.packed: PackedItems | None = None  # items older than `mem`'s, packed
        self.mem: deque[Item] = NO_ITEMS
        self.mem_bytes = 0
        self.behind: int | None = None
        self.tail = tail
        self.items = 0  # available: front + mem + on disk; not open, not moving
        self.bytes = 0
        # Unused, the dicts hold NO_ENTRIES, `done` NO_IDS and `delayed` NO_ITEMS (see
        # there); each is made its own on first write.
        self.open: dict[int, Item] = NO_ENTRIES
        self.moving: dict[int, Item] = NO_ENTRIES  # on their way to expire_to_queue /
        # error_queue
        self.done: set[int] = {i for i in done if i > head} or NO_IDS
        self.head = head
        #: id -> error count, for outstanding items whose count an abort raised
        self.errors: dict[int, int] = {i: n for i, n in errors
                                       if i > head and i not in self.done} or NO_ENTRIES
        self.start_delays(delays)
        self.dirty = False  # consumed something since the last checkpoint
        self.flush_overflow = 0  # flushed ids a crash could bring back (see flush)
        self.create_time_ms = create_time_ms
        self.counters = ReaderCounters()

    def held_size(self, it: Item) -> int:
        """The bytes `it` adds to `mem_bytes`: its data and headers (max_memory_size
        counts both: an item may carry 16 KiB of headers with no data)."""
        h = len(it.headers)
        if h:
            self.headed = True
        return len(it.data) + h

    def _mem(self) -> deque[Item]:
        """`mem`, made a deque on first use."""
        mem = self.mem
        if mem is NO_ITEMS:
            mem = self.mem = _new_deque()
        return mem

    def _held(self) -> Iterator[Item]:
        """The items of `unpacked`, `packed` and `mem`, in delivery order."""
        yield from reversed(self.unpacked)
        if self.packed is not None:
            yield from self.packed
        yield from self.mem

    def _unpack(self) -> None:
        """`unpacked` is empty and `packed` is not: its oldest block moves to `unpacked`."""
        assert self.packed is not None
        self.unpacked = self.packed.unpack_next()
        if not self.packed:
            self.packed = None  # (its truth test is a call; None's is not)

    def _next_held(self) -> Item | None:
        """The first item `_held` gives (None if none), left in place."""
        if self.unpacked:
            return self.unpacked[-1]
        if self.packed:
            self._unpack()
            return self.unpacked[-1]
        return self.mem[0] if self.mem else None

    def _pack(self) -> None:
        """`mem` holds pack_at items or more: its oldest go to `packed`, a block at a time."""
        mem, packed = self.mem, self.packed
        if packed is None:
            packed = self.packed = PackedItems()
        take, block = mem.popleft, range(self.pack_block)
        while len(mem) >= self.pack_at:
            packed.pack([take() for _ in block], self.pack_max)

    # -- filling ---------------------------------------------------------------------

    def restore(self, mem: Iterable[Item], behind: int | None, items: int, nbytes: int) -> None:
        """After recovery: `items` unconsumed items (`nbytes` of data); the first ones
        are `mem`, the rest wait on disk from id `behind`."""
        for it in mem:
            if self.errors and it.id in self.errors:
                it = it.with_error_count(self.errors[it.id])
            held = self._mem()
            held.append(it)
            self.mem_bytes += self.held_size(it)
            if len(held) >= self.pack_at:
                self._pack()
        self.behind = behind
        self.items += items
        self.bytes += nbytes

    def drop_through(self, last_id: int, on_disk: int, on_disk_bytes: int) -> None:
        """The journal dropped every id <= last_id (max_journal_size, drop_oldest).

        `on_disk` items (`on_disk_bytes` of data) of those were only on disk: the
        caller counts them from the dropped segment. Open reads stay open (their
        data is in memory).
        """
        if self.front:
            keep = [it for it in self.front if it.id > last_id]
            for it in self.front:
                if it.id <= last_id:
                    self._drop(it)
            self.front.clear()
            self.front.extend(keep)
        # Held items are in id order: the dropped ones are a prefix, taken one block at a
        # time (unpacking the whole backlog would cost O(held) objects on every segment).
        while (first := self._next_held()) is not None and first.id <= last_id:
            self._drop(self.unpacked.pop() if self.unpacked else self.mem.popleft())
        if self.delayed or self.due:
            self.drop_delayed(lambda i: i <= last_id)
        if self.behind is not None and self.behind <= last_id:
            self.items -= on_disk
            self.bytes -= on_disk_bytes
            self.counters.discarded += on_disk
            self.behind = last_id + 1 if last_id < self.tail else None
        if self.errors:
            self.errors = {i: n for i, n in self.errors.items()
                           if i > last_id or i in self.open or i in self.moving}
        self.dirty = True

    def _drop(self, it: Item) -> None:
        """A held or aborted item `drop_through` removed: counted discarded."""
        n = len(it.data)
        self.mem_bytes -= n + len(it.headers)
        self.items -= 1
        self.bytes -= n
        self.counters.discarded += 1

    def add(self, items: Iterable[Item]) -> None:
        """Durable items, in id order; ids at or below `tail` are ignored."""
        cap = self.limits.max_memory_size
        # (a list-typed name: compiled, its items are read as Puts, not looked up by name)
        puts: list[Item] = items if type(items) is list else list(items)
        first = puts[0] if len(puts) == 1 else None
        if type(first) is Put and self.behind is None and first.id > self.tail:
            # One plain put, new (a client with one request in flight, a pass fanning in
            # to many queues): the bulk case below without its type set and sums.
            bulk, nbytes = True, len(first.data)
            held = nbytes
        else:
            types = set(map(type, puts)) if self.behind is None else None
            bulk, nbytes = False, 0
            if types is not None and puts and puts[0].id > self.tail and types <= _PUT_ONLY:
                bulk, nbytes = True, sum(map(len, map(_DATA, puts)))
            held = nbytes
            if bulk and types is not None and HeadedPut in types:  # (their headers are held)
                held += sum(map(len, map(_HEADERS, puts)))
                self.headed = True
        if bulk and self.mem_bytes + held <= cap:
            # The usual case (one append's plain puts, all new, all fitting in memory) in bulk.
            k = len(puts)
            self.tail = puts[-1].id
            self.items += k
            self.bytes += nbytes
            self.counters.total_items += k
            mem = self._mem()
            mem.extend(puts)
            self.mem_bytes += held
            if len(mem) >= self.pack_at:
                self._pack()
            return
        mem = self.mem
        for it in puts:
            if it.id <= self.tail:
                continue
            self.tail = it.id
            n = len(it.data)
            self.items += 1
            self.bytes += n
            self.counters.total_items += 1
            if type(it) is DelayedPut:
                self.delay(it, it.due_ms)
            elif self.behind is None and (self.mem_bytes + n + len(it.headers) <= cap
                                          or not self.mem_bytes):
                if mem is NO_ITEMS:
                    mem = self._mem()
                mem.append(it)
                self.mem_bytes += self.held_size(it)
                if len(mem) >= self.pack_at:
                    self._pack()
            elif self.behind is None:
                self.behind = it.id

    def wants_refill(self) -> bool:
        """On-disk items wait and memory is at most half full (or empty)."""
        return self.behind is not None and (
            not (self.front or self.unpacked or self.packed or self.mem)
            or self.mem_bytes <= self.limits.max_memory_size // 2
        )

    def refill_budget(self) -> int:
        return max(self.limits.max_memory_size - self.mem_bytes, 1)

    def load(self, from_id: int, items: Iterable[Item], next_id: int) -> bool:
        """Items read back from the journal for ids [from_id, next_id).

        Ignored unless `from_id` is still where read-behind stands (a flush may have
        moved it while the read was in flight). Ids in `done` were consumed already.
        True when read-behind then stands at `next_id` (a read of the next ids goes on),
        False when the tail is reached or the items were ignored.
        """
        if self.behind != from_id:
            return False
        errors = self.errors
        for it in items:
            if it.id >= next_id or it.id > self.tail:
                break
            if it.id in self.done or (type(it) is DelayedPut or it.id in self.delays):
                continue
            if errors and it.id in errors:
                it = it.with_error_count(errors[it.id])
            held = self._mem()
            held.append(it)
            self.mem_bytes += self.held_size(it)
            if len(held) >= self.pack_at:
                self._pack()
        self.behind = next_id if next_id <= self.tail else None
        return self.behind is not None

    # -- taking -------------------------------------------------------------------------

    def _pop(self) -> Item | None:
        if self.front:
            it = self.front.popleft()
        elif self.due and type(self.due[0]) is not int:
            it = self.due.popleft()  # type: ignore[assignment]
            if it.id == self.delay_low:
                self.low_exact = False
        elif self.unpacked:
            it = self.unpacked.pop()
        elif self.packed:
            self._unpack()
            it = self.unpacked.pop()
        elif self.mem:
            it = self.mem.popleft()
        else:
            return None
        n = len(it.data)
        self.mem_bytes -= n + len(it.headers)
        self.items -= 1
        self.bytes -= n
        return it

    def _expired(self, it: Item, now_ms: int) -> bool:
        return it.expire_time_ms is not None and it.expire_time_ms <= now_ms

    def take(self, now_ms: int, expired: list[Item]) -> Item | None:
        """The next live item, removed; expired ones met on the way go to `expired`.

        The caller must `consume` or `start_move` each expired item. Returns None
        when memory holds nothing (check `behind`: items may wait on disk).
        """
        if self.delayed and self.delayed[0] >> DUE_SHIFT <= now_ms:
            self.promote(now_ms)
        while True:
            it = self._pop()
            if it is None:
                return None
            if self._expired(it, now_ms):
                self.counters.expired += 1
                expired.append(it)
                continue
            self.counters.age_ms = max(0, now_ms - it.add_time_ms)
            self.counters.taken += 1
            return it

    def take_held(self, now_ms: int, limit: int, max_bytes: int = 0) -> list[Item]:
        """`take` then `hold`, up to `limit` items (stopping once `max_bytes` of data is
        reached, 0: no cap), in one go: the plain case of a batch get, where the next
        items are held ones without an expiry and nothing returned, delayed or due comes
        first. [] when that is not the case: `take` them one at a time then."""
        if (self.front or self.due or limit <= 0
                or (self.delayed and self.delayed[0] >> DUE_SHIFT <= now_ms)):
            return []
        if not self.unpacked and self.packed:
            self._unpack()
        run = self.unpacked  # newest first
        if run:
            k = _count_within(reversed(run), min(limit, len(run)), max_bytes)
            items = run[-k:]
            items.reverse()
        elif self.mem:  # (nothing packed: it would come first)
            k = _count_within(iter(self.mem), min(limit, len(self.mem)), max_bytes)
            items = list(islice(self.mem, k))
        else:
            return []
        if any([it.expire_time_ms is not None for it in items]):
            return []
        if run:
            del run[-k:]
        else:
            take = self.mem.popleft
            for _ in range(k):
                take()
        n = sum([len(it.data) for it in items])
        self.mem_bytes -= n + (sum(map(len, map(_HEADERS, items))) if self.headed else 0)
        self.items -= k
        self.bytes -= n
        counters = self.counters
        counters.age_ms = max(0, now_ms - items[-1].add_time_ms)
        counters.taken += k
        if self.open is NO_ENTRIES:
            self.open = {}
        self.open.update([(it.id, it) for it in items])
        return items

    def oldest_add_time_ms(self) -> int | None:
        """When the oldest item waiting in memory was put (None if memory holds none).

        Held items are in id order, so the first is the oldest; aborted items
        (`front`) are few and in no particular order. Items waiting only on disk
        (`behind`) are newer than all of these. For scrapes, not the hot path.
        """
        times = [it.add_time_ms for it in self.front]
        first = self._next_held()
        if first is not None:
            times.append(first.add_time_ms)
        return min(times, default=None)

    def peek(self, now_ms: int, expired: list[Item]) -> Item | None:
        """The next live item, left in place (expired ones are removed as in take)."""
        if self.delayed and self.delayed[0] >> DUE_SHIFT <= now_ms:
            self.promote(now_ms)
        while True:
            it = self._head()
            if it is None or not self._expired(it, now_ms):
                return it
            self._pop()
            self.counters.expired += 1
            expired.append(it)

    def first_items(self, now_ms: int, limit: int) -> list[Item]:
        """Up to `limit` live items in the order gets would take them, from memory only
        (items read behind on disk are not read for it, nor are due items whose data
        waits on disk; delayed items not yet due are not live). Changes nothing: an
        expired item is skipped, not removed (for the console's look at a queue's head)."""
        return list(islice(self._live(now_ms), limit))

    def _live(self, now_ms: int) -> Iterator[Item]:
        """Live items in memory in the order gets would take them (see `first_items`)."""
        queues: tuple[Iterable[Item | int], ...] = (self.front, self.due, self._held())
        for dq in queues:
            for it in dq:
                if not isinstance(it, int) and not self._expired(it, now_ms):  # int: on disk
                    yield it

    def browse(self, now_ms: int, after_id: int, n: int) -> list[Item]:
        """Up to `n` live items in memory in delivery order after the item `after_id`
        (0: from the head; an id not among them: those with higher ids). Changes nothing."""
        live = self._live(now_ms)
        if after_id:
            if any(it.id == after_id for it in self._live(now_ms)):
                for it in live:
                    if it.id == after_id:
                        break
            else:
                live = (it for it in live if it.id > after_id)
        return list(islice(live, n))

    def expire_head(self, now_ms: int, limit: int, expired: list[Item]) -> None:
        """Remove expired items from the head (Kestrel's sweep), at most `limit` (0 = all)."""
        while not limit or len(expired) < limit:
            it = self._head()
            if it is None or not self._expired(it, now_ms):
                return
            self._pop()
            self.counters.expired += 1
            expired.append(it)

    def _head(self) -> Item | None:
        if self.front:
            return self.front[0]
        if self.due and type(self.due[0]) is not int:
            return self.due[0]  # type: ignore[return-value]
        return self._next_held()

    def consume(self, item_id: int) -> None:
        """`item_id` is gone for good (taken, confirmed, expired, discarded, moved)."""
        self.dirty = True
        if self.errors:
            self.errors.pop(item_id, None)
        # (`delays` keeps consumed ids until the next checkpoint prunes them: not popped
        # here, so a put without a delay pays nothing for it)
        if self.open or self.front or self.moving or self.delay_low is not None:
            # A lower id may still be outstanding: remember this one explicitly.
            if self.done is NO_IDS:
                self.done = set()
            self.done.add(item_id)
        elif item_id > self.head:
            if self._waits_below(item_id):  # (a due item came before lower ids)
                if self.done is NO_IDS:
                    self.done = set()
                self.done.add(item_id)
            else:
                self.head = item_id

    def _waits_below(self, item_id: int) -> bool:
        """An available item (held or on disk) has a lower id than `item_id`: so it is
        when a due item was delivered ahead of them and a checkpoint since found nothing
        delayed (`delay_low` None) -- its consume must not move the head past them."""
        first = self._next_held()
        if first is not None:
            return first.id < item_id
        return self.behind is not None and self.behind < item_id

    # -- reliable reads ----------------------------------------------------------------

    def open_read(self, it: Item) -> None:
        self.hold(it)
        self.counters.transactions += 1

    def hold(self, it: Item) -> None:
        """Keep a taken item outstanding (like an open read, not counted as one) until
        the get that took it has answered; then `confirm` or `abort` it."""
        if self.open is NO_ENTRIES:
            self.open = {}
        self.open[it.id] = it

    def confirm(self, item_id: int) -> bool:
        if self.open.pop(item_id, None) is None:
            return False
        if not self.open:
            self.open = NO_ENTRIES  # (a dict that held entries keeps its table)
        self.consume(item_id)
        return True

    def confirm_many(self, ids: Iterable[int]) -> list[Item]:
        """`confirm` each of `ids` (distinct); the items of those that were open, in order."""
        items = [it for it in map(self.open.pop, ids, repeat(None)) if it is not None]
        if not items:
            return items
        done = [it.id for it in items]
        if not self.open:
            self.open = NO_ENTRIES
        self.dirty = True
        if self.errors:
            for i in done:
                self.errors.pop(i, None)
        top = max(done)
        if (self.open or self.front or self.moving or self.delay_low is not None
                or (top > self.head and self._waits_below(top))):
            if self.done is NO_IDS:
                self.done = set()
            self.done.update(done)
        else:
            # As `consume` does for the last of them: nothing lower is outstanding.
            self.head = max(self.head, top)
        return items

    def reopen(self, it: Item) -> None:
        """Undo `confirm` of `it`: its confirm could not be made durable, so it is open
        again (with its error count), not done. The head may stay past it meanwhile:
        while a read is open, the head is recomputed from it (see `checkpoint`)."""
        if self.open is NO_ENTRIES:
            self.open = {}
        self.open[it.id] = it
        if it.id in self.done:
            self.done.discard(it.id)
        if it.error_count:
            if self.errors is NO_ENTRIES:
                self.errors = {}
            self.errors[it.id] = it.error_count
        self.dirty = True

    def abort(self, item_id: int, *, count_error: bool) -> Item | None:
        """Return an open read to the head of the queue; None if it is not open.

        Returns the item as put back (with its error count raised if `count_error`).
        """
        it = self.open.pop(item_id, None)
        if it is None:
            return None
        self.counters.canceled_transactions += 1
        if count_error:
            it = it.with_error_count(it.error_count + 1)
            if self.errors is NO_ENTRIES:
                self.errors = {}
            self.errors[item_id] = it.error_count
        return it

    def unhold(self, item_id: int) -> bool:
        """A held item goes back to the head unharmed: the get that took it was cancelled
        before it answered (no error counted, no transaction canceled). False if not held."""
        it = self.open.pop(item_id, None)
        if it is None:
            return False
        self.put_back(it)
        return True

    def put_back(self, it: Item) -> None:
        """An item this reader had handed out goes back to the head."""
        if self.front is NO_ITEMS:
            self.front = _new_deque()
        self.front.appendleft(it)
        n = len(it.data)
        self.mem_bytes += self.held_size(it)
        self.items += 1
        self.bytes += n

    def start_move(self, it: Item) -> None:
        if self.moving is NO_ENTRIES:
            self.moving = {}
        self.moving[it.id] = it

    def end_move(self, item_id: int, *, moved: bool) -> None:
        """The item reached its new queue (consume it here) or could not (put it back)."""
        it = self.moving.pop(item_id, None)
        if it is None:
            return
        if moved:
            self.consume(item_id)
        else:
            self.put_back(it)

    # -- limits and flushes ---------------------------------------------------------------

    def over_limits(self, incoming: int, incoming_bytes: int) -> bool:
        lim = self.limits
        return bool(
            (lim.max_items and self.items + incoming > lim.max_items)
            or (lim.max_size and self.bytes + incoming_bytes > lim.max_size)
        )

    def discard_oldest(self) -> Item | None:
        """Drop the oldest item in memory to make room; None if memory holds none."""
        it = self._pop()
        if it is not None:
            self.counters.discarded += 1
            self.consume(it.id)
        return it

    def flush(self) -> int:
        """Discard every available item (open reads stay open). Returns how many."""
        n = self.items
        ids: list[int] = []
        listing = bool(self.open or self.moving)  # the flushed ids are listed only then
        if listing:
            ids = [it.id for it in self.front] + [it.id for it in reversed(self.unpacked)]
            ids += self.packed.ids() if self.packed else []
            ids += [it.id for it in self.mem]
            ids += self.delayed_ids()
        self.clear_delays()
        if listing and self.behind is not None:
            ids.extend(range(self.behind, self.tail + 1))
        self.front = NO_ITEMS
        self.unpacked = NO_LIST
        self.packed = None
        self.mem = NO_ITEMS
        self.mem_bytes = 0
        self.behind = None
        self.items = 0
        self.bytes = 0
        self.counters.flushes += 1
        self.dirty = True
        if self.errors:
            self.errors = {i: n for i, n in self.errors.items()
                           if i in self.open or i in self.moving}
        if listing:
            # A lower id is still open: the flushed ids must be listed one by one
            # (READ_DONE). Past FLUSH_DONE_CAP ids that list would cost more memory
            # than the backlog it describes; they are left out, so a crash before
            # the open reads end may deliver those flushed items again (logged).
            if len(ids) > FLUSH_DONE_CAP:
                self.flush_overflow = len(ids) - FLUSH_DONE_CAP
                ids = ids[:FLUSH_DONE_CAP]
            if self.done is NO_IDS:
                self.done = set()
            self.done.update(ids)
        elif self.tail > self.head:
            self.head = self.tail
        return n

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint(self) -> tuple[int, list[int]]:
        """(head, done) to write now; forgets done ids at or below the new head."""
        lows = []
        if self.open:
            lows.append(min(self.open))
        if self.moving:
            lows.append(min(self.moving))
        if self.front:
            lows.append(min(it.id for it in self.front))
        first = self._next_held()
        if first is not None:
            lows.append(first.id)
        if self.behind is not None:
            lows.append(self.behind)
        if self.delay_low is not None and (low := self.delay_low_id()) is not None:
            lows.append(low)
        head = min(lows) - 1 if lows else max(self.tail, self.head)
        self.head = head
        if self.done:
            self.done = {i for i in self.done if i > head} or NO_IDS
        self.dirty = False
        return head, sorted(self.done)

    def error_counts(self) -> list[tuple[int, int]]:
        """(id, count) of outstanding items whose error count an abort raised, for the
        checkpoint; drops ids at or below the head (call after `checkpoint`)."""
        if self.errors:
            self.errors = {i: n for i, n in self.errors.items()
                           if i > self.head and i not in self.done}
        return sorted(self.errors.items())

    @property
    def mem_count(self) -> int:
        """Items available in memory, in delivery order (aborted, packed, newest)."""
        return (len(self.front) + len(self.unpacked) + (len(self.packed) if self.packed else 0)
                + len(self.mem))

    @property
    def open_count(self) -> int:
        return len(self.open)
