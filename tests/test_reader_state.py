"""The pure per-reader state machine (queued.reader.state.Reader): ordering, read-behind,
checkpoints, expiry, limits, drop_through, and a hypothesis state machine checking that a
checkpoint (head, done) always describes exactly the outstanding items, with lease
timeouts and their extension (core.open_reads), the retry back-off and reject."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reader_util import (
    T0,
    Limits,
    abort_ids,
    held,
    item,
    items,
    read_range,
    reader,
    recovered,
    refill,
    replay,
    small_pack_reader,
    take_all,
    take_consume,
    take_id,
    take_open,
)

from queued.journal.format import DelayedPut, HeadedPut, Put
from queued.reader.delays import key_id
from queued.reader.open_reads import OpenReads, TimeoutHeap
from queued.reader.packed_items import BLOCK_ITEMS
from queued.reader.state import PACK_AT, Reader

# -- add / take order ------------------------------------------------------------------


def test_take_returns_items_in_id_order_then_none() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    assert [take_id(r) for _ in range(6)] == [1, 2, 3, 4, 5, None]
    assert r.items == 0 and r.bytes == 0 and r.mem_bytes == 0


def test_add_ignores_ids_at_or_below_tail() -> None:
    r = reader()
    r.add(items([1, 2, 3]))
    r.add(items([2, 3, 4]))
    assert r.tail == 4 and r.items == 4
    assert [take_id(r) for _ in range(5)] == [1, 2, 3, 4, None]
    assert r.counters.total_items == 4


def test_counts_and_bytes_follow_add_take_abort() -> None:
    r = reader()
    r.add([item(1, 5), item(2, 7), item(3, 11)])
    assert (r.items, r.bytes, r.mem_bytes) == (3, 23, 23)
    a = take_open(r)
    assert (r.items, r.bytes, r.mem_bytes, r.open_count) == (2, 18, 18, 1)
    abort_ids(r, [a.id])
    assert (r.items, r.bytes, r.mem_bytes, r.open_count) == (3, 23, 23, 0)


def test_oldest_add_time_and_taken_count() -> None:
    r = reader()
    assert r.oldest_add_time_ms() is None
    # Add times need not follow ids (items moved in from another queue keep theirs).
    r.add([item(1, add=T0 + 30), item(2, add=T0 + 10), item(3, add=T0 + 20)])
    assert r.oldest_add_time_ms() == T0 + 30  # mem's first item
    a, b = take_open(r), take_open(r)
    assert r.oldest_add_time_ms() == T0 + 20
    abort_ids(r, [a.id, b.id])
    assert r.oldest_add_time_ms() == T0 + 10  # any aborted item, not only the first
    assert r.counters.taken == 2
    assert [take_id(r) for _ in range(3)] == [1, 2, 3]
    assert r.counters.taken == 5 and r.oldest_add_time_ms() is None


def test_abort_goes_to_the_head() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    take_open(r)
    b = take_open(r)
    abort_ids(r, [b.id])
    assert take_id(r) == 2
    assert take_id(r) == 3


def test_several_aborts_in_a_row_keep_lowest_id_first() -> None:
    r = reader()
    r.add(items(range(1, 8)))
    opened = [take_open(r).id for _ in range(4)]
    abort_ids(r, [opened[2], opened[0], opened[3]])  # any order: the lowest comes first
    assert [take_id(r) for _ in range(5)] == [1, 3, 4, 5, 6]
    assert r.open_count == 1 and 2 in r.open


def test_unhold_puts_a_held_item_back_unharmed() -> None:
    r = reader()
    r.add(items(range(1, 4)))
    expired: list[Put] = []
    a, b = r.take(T0, expired), r.take(T0, expired)
    assert a is not None and b is not None
    r.hold(a)
    r.hold(b)
    assert r.unhold(b.id) and r.unhold(a.id)  # in reverse: the lowest id ends up first
    assert not r.unhold(a.id)  # not held any more
    assert (r.items, r.counters.canceled_transactions, r.open_count) == (3, 0, 0)
    got = [r.take(T0, expired) for _ in range(3)]
    assert got[:2] == [a, b] and a.error_count == 0


def test_abort_counts_errors_on_a_copy() -> None:
    r = reader()
    orig = item(1)
    r.add([orig])
    take_open(r)
    it = r.abort(1, count_error=True)
    assert it is not None and it.error_count == 1 and orig.error_count == 0
    r.put_back(it)
    take_open(r)
    again = r.abort(1, count_error=False)
    assert again is not None and again.error_count == 1
    assert r.abort(1, count_error=True) is None  # not open any more
    assert r.counters.canceled_transactions == 2


def test_confirm_of_an_unknown_id_is_refused() -> None:
    r = reader()
    r.add(items([1]))
    assert not r.confirm(1)
    take_open(r)
    assert r.confirm(1)
    assert not r.confirm(1)


# -- read-behind ---------------------------------------------------------------------------


def test_add_beyond_max_memory_goes_behind() -> None:
    r = reader(max_memory_size=250)
    journal = {p.id: p for p in items(range(1, 11), 100)}
    r.add(journal.values())
    assert [p.id for p in r.mem] == [1, 2]
    assert r.mem_bytes == 200 and r.behind == 3
    assert r.items == 10 and r.bytes == 1000
    assert not r.wants_refill()  # memory more than half full
    take_consume(r)
    assert r.wants_refill()
    assert r.refill_budget() == 150
    refill(r, journal)
    assert [p.id for p in r.mem] == [2, 3] and r.behind == 4


def test_read_behind_delivers_everything_in_order() -> None:
    r = reader(max_memory_size=250)
    journal = {p.id: p for p in items(range(1, 21), 100)}
    r.add(journal.values())
    assert take_all(r, journal, max_mem=250) == list(range(1, 21))
    assert r.items == 0 and r.checkpoint() == (20, [])


def test_first_item_is_kept_in_memory_even_if_bigger_than_the_cap() -> None:
    r = reader(max_memory_size=50)
    r.add([item(1, 100), item(2, 10)])
    assert [p.id for p in r.mem] == [1] and r.behind == 2


def test_items_added_while_behind_stay_on_disk() -> None:
    r = reader(max_memory_size=250)
    r.add(items(range(1, 4), 100))
    assert r.behind == 3
    take_consume(r)
    take_consume(r)
    r.add(items([4], 10))  # memory is empty but older items wait on disk
    assert not r.mem and r.behind == 3 and r.tail == 4


def test_load_skips_done_ids() -> None:
    journal = {p.id: p for p in items(range(1, 11), 100)}
    r = Reader("q", "", Limits(max_memory_size=250), head=0, done=[3, 4, 7], tail=10)
    r.restore([journal[1], journal[2]], 5, 7, 700)
    got = []
    while (it := r.take(T0, [])) is not None or r.behind is not None:
        if it is None:
            refill(r, journal)
            continue
        r.open_read(it)
        r.confirm(it.id)
        got.append(it.id)
    assert got == [1, 2, 5, 6, 8, 9, 10]
    assert r.checkpoint() == (10, [])


def test_load_stops_at_next_id_and_at_tail() -> None:
    r = reader(max_memory_size=150)
    r.add(items(range(1, 6), 100))
    assert r.behind == 2
    take_consume(r)
    r.load(2, items(range(2, 6), 100), 4)
    assert [p.id for p in r.mem] == [2, 3] and r.behind == 4
    take_consume(r)
    take_consume(r)
    r.load(4, items(range(4, 9), 100), 9)  # ids past tail are not ours yet
    assert [p.id for p in r.mem] == [4, 5] and r.behind is None


def test_stale_load_after_flush_is_ignored() -> None:
    r = reader(max_memory_size=250)
    journal = {p.id: p for p in items(range(1, 11), 100)}
    r.add(journal.values())
    take_consume(r)
    start = r.behind
    assert start == 3
    got, next_id = read_range(journal, start, r.tail, r.refill_budget())
    assert r.flush() == 9
    r.load(start, got, next_id)
    assert not r.mem and r.behind is None and r.items == 0
    assert r.take(T0, []) is None
    assert r.checkpoint() == (10, [])


def test_stale_load_after_refill_moved_on_is_ignored() -> None:
    r = reader(max_memory_size=250)
    journal = {p.id: p for p in items(range(1, 11), 100)}
    r.add(journal.values())
    take_consume(r)
    take_consume(r)
    start = r.behind
    assert start is not None
    got, next_id = read_range(journal, start, r.tail, r.refill_budget())
    r.load(start, got, next_id)
    before = [p.id for p in r.mem]
    r.load(start, got, next_id)  # the same answer twice: the second is stale
    assert [p.id for p in r.mem] == before


def test_flush_with_items_behind_counts_them() -> None:
    r = reader(max_memory_size=250)
    r.add(items(range(1, 11), 100))
    assert r.flush() == 10
    assert r.items == 0 and r.bytes == 0 and r.mem_bytes == 0 and r.behind is None
    assert r.checkpoint() == (10, [])
    r.add(items([11]))
    assert take_id(r) == 11


# -- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_of_an_empty_reader_is_the_tail() -> None:
    r = reader()
    assert r.checkpoint() == (0, [])
    r.add(items([1, 2]))
    assert r.checkpoint() == (0, [])
    take_consume(r)
    assert r.checkpoint() == (1, [])
    take_consume(r)
    assert r.checkpoint() == (2, [])


def test_checkpoint_clears_dirty() -> None:
    r = reader()
    r.add(items([1]))
    assert not r.dirty
    take_consume(r)
    assert r.dirty
    r.checkpoint()
    assert not r.dirty


def test_open_read_pins_the_head() -> None:
    r = reader()
    r.add(items(range(1, 5)))
    take_open(r)
    take_consume(r)
    take_consume(r)
    assert r.checkpoint() == (0, [2, 3])
    assert r.confirm(1)
    assert r.checkpoint() == (3, [])


def test_out_of_order_confirms_produce_done() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    for _ in range(4):
        take_open(r)
    assert r.confirm(4)
    assert r.confirm(2)
    assert r.checkpoint() == (0, [2, 4])
    assert r.confirm(1)
    assert r.checkpoint() == (2, [4])  # 3 is the lowest still open
    assert r.confirm(3)
    assert r.checkpoint() == (4, [])


def test_abort_of_the_lowest_open_read_keeps_head_below_it() -> None:
    r = reader()
    r.add(items(range(1, 5)))
    take_open(r)
    take_open(r)
    r.confirm(2)
    abort_ids(r, [1])
    assert r.checkpoint() == (0, [2])
    assert take_id(r) == 1
    r.consume(1)  # taken without an open read: gone for good
    assert r.checkpoint() == (2, [])


def test_confirm_after_abort_and_retake_in_any_order() -> None:
    r = reader()
    r.add(items(range(1, 7)))
    a, b, c = take_open(r), take_open(r), take_open(r)
    abort_ids(r, [b.id])
    r.confirm(c.id)
    assert r.checkpoint() == (0, [3])
    b2 = take_open(r)
    assert b2.id == b.id
    r.confirm(a.id)
    assert r.checkpoint() == (1, [3])
    r.confirm(b2.id)
    assert r.checkpoint() == (3, [])


def test_flush_with_open_reads_marks_flushed_ids_done() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    take_open(r)
    assert r.flush() == 4
    assert r.checkpoint() == (0, [2, 3, 4, 5])
    assert r.confirm(1)
    assert r.checkpoint() == (5, [])


def test_flush_with_open_reads_then_abort_delivers_only_the_open_item() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    take_open(r)
    r.flush()
    abort_ids(r, [1])
    assert r.checkpoint() == (0, [2, 3, 4, 5])
    assert take_id(r) == 1
    assert take_id(r) is None


def test_flush_with_open_reads_and_read_behind_marks_disk_ids_done() -> None:
    journal = {p.id: p for p in items(range(1, 11), 100)}
    r = reader(max_memory_size=250)
    r.add(journal.values())
    take_open(r)
    assert r.flush() == 9
    head, done = r.checkpoint()
    assert head == 0 and done == list(range(2, 11))
    assert replay(journal, head, done) == {1}


def test_moving_items_pin_the_head() -> None:
    r = reader()
    r.add(items(range(1, 5)))
    it = r.take(T0, [])
    assert it is not None
    r.start_move(it)
    take_consume(r)
    assert r.checkpoint() == (0, [2])
    r.end_move(1, moved=True)
    assert r.checkpoint() == (2, [])
    it = r.take(T0, [])
    assert it is not None
    r.start_move(it)
    assert r.checkpoint() == (2, [])
    r.end_move(3, moved=False)  # could not move: back to the head
    assert r.checkpoint() == (2, [])
    assert take_id(r) == 3
    r.end_move(3, moved=True)  # not moving any more: ignored
    assert r.items == 1


def test_checkpoint_with_front_below_mem() -> None:
    r = reader()
    r.add(items(range(1, 6)))
    a, b = take_open(r), take_open(r)
    r.confirm(a.id)
    abort_ids(r, [b.id])
    assert r.checkpoint() == (1, [])
    take_consume(r)  # 2
    take_consume(r)  # 3
    assert r.checkpoint() == (3, [])


def test_checkpoint_forgets_done_ids_below_the_new_head() -> None:
    r = Reader("q", "", Limits(), head=5, done=[2, 5, 7, 9], tail=10)
    assert r.done == {7, 9}
    r.restore(items([6, 8, 10]), None, 3, 30)
    assert r.checkpoint() == (5, [7, 9])
    take_consume(r)
    assert r.checkpoint() == (7, [9])
    take_consume(r)
    take_consume(r)
    assert r.checkpoint() == (10, [])


# -- expiry ----------------------------------------------------------------------------------


def test_take_skips_expired_items() -> None:
    r = reader()
    r.add([item(1, expire=T0 + 5), item(2), item(3, expire=T0 + 5), item(4, expire=T0 + 50)])
    expired: list[Put] = []
    it = r.take(T0 + 10, expired)
    assert it is not None and it.id == 2 and [p.id for p in expired] == [1]
    expired.clear()
    it = r.take(T0 + 10, expired)
    assert it is not None and it.id == 4 and [p.id for p in expired] == [3]
    assert r.counters.expired == 2
    assert r.counters.age_ms == 10


def test_expiry_is_inclusive() -> None:
    r = reader()
    r.add([item(1, expire=T0 + 5)])
    assert take_id(r, T0 + 4) == 1
    r.add([item(2, expire=T0 + 5)])
    expired: list[Put] = []
    assert r.take(T0 + 5, expired) is None and [p.id for p in expired] == [2]


def test_peek_removes_expired_but_leaves_the_live_item() -> None:
    r = reader()
    r.add([item(1, expire=T0), item(2)])
    expired: list[Put] = []
    it = r.peek(T0 + 1, expired)
    assert it is not None and it.id == 2 and [p.id for p in expired] == [1]
    assert r.items == 1
    assert take_id(r, T0 + 1) == 2


def test_expired_item_in_front_is_skipped() -> None:
    r = reader()
    r.add([item(1, expire=T0 + 5), item(2)])
    take_open(r)
    abort_ids(r, [1])
    expired: list[Put] = []
    it = r.take(T0 + 10, expired)
    assert it is not None and it.id == 2 and [p.id for p in expired] == [1]


def test_expire_head_honours_the_limit_and_stops_at_a_live_item() -> None:
    r = reader()
    r.add([item(i, expire=T0) for i in range(1, 6)] + [item(6), item(7, expire=T0)])
    expired: list[Put] = []
    r.expire_head(T0 + 1, 2, expired)
    assert [p.id for p in expired] == [1, 2]
    expired = []
    r.expire_head(T0 + 1, 0, expired)
    assert [p.id for p in expired] == [3, 4, 5]
    assert r.items == 2
    expired = []
    r.expire_head(T0 + 1, 0, expired)
    assert expired == []


def test_expired_items_consumed_advance_the_checkpoint() -> None:
    r = reader()
    r.add([item(1, expire=T0), item(2, expire=T0), item(3)])
    expired: list[Put] = []
    r.expire_head(T0 + 1, 0, expired)
    for p in expired:
        r.consume(p.id)
    assert r.checkpoint() == (2, [])


# -- limits ----------------------------------------------------------------------------------


def test_over_limits_items_and_bytes() -> None:
    r = reader(max_items=3, max_size=100)
    r.add(items([1, 2], 30))
    assert not r.over_limits(1, 30)
    assert r.over_limits(2, 10)
    assert r.over_limits(1, 41)
    assert not reader().over_limits(10**6, 10**9)


def test_open_reads_do_not_count_against_max_items() -> None:
    r = reader(max_items=2)
    r.add(items([1, 2]))
    assert r.over_limits(1, 0)
    take_open(r)
    assert not r.over_limits(1, 0)


def test_discard_oldest_takes_front_first_and_consumes() -> None:
    r = reader(max_items=3)
    r.add(items(range(1, 5)))
    take_open(r)
    take_open(r)
    abort_ids(r, [2])
    dropped = r.discard_oldest()
    assert dropped is not None and dropped.id == 2
    assert r.counters.discarded == 1
    assert r.checkpoint() == (0, [2])
    r.confirm(1)
    assert r.checkpoint() == (2, [])
    dropped = r.discard_oldest()
    assert dropped is not None and dropped.id == 3
    assert r.checkpoint() == (3, [])


def test_discard_oldest_with_everything_on_disk_returns_none() -> None:
    r = reader(max_memory_size=150)
    r.add(items(range(1, 4), 100))
    take_consume(r)
    assert r.discard_oldest() is None
    assert r.behind == 2 and r.items == 2


# -- drop_through ------------------------------------------------------------------------------


def test_drop_through_in_memory() -> None:
    r = reader()
    r.add(items(range(1, 7)))
    take_open(r)
    r.drop_through(3, 0, 0)
    assert [p.id for p in r.mem] == [4, 5, 6]
    assert r.items == 3 and r.counters.discarded == 2 and r.open_count == 1
    assert take_id(r) == 4


def test_drop_through_behind() -> None:
    r = reader(max_memory_size=250)
    r.add(items(range(1, 11), 100))
    assert r.behind == 3
    r.drop_through(5, 3, 300)
    assert not r.mem and r.behind == 6 and r.items == 5 and r.bytes == 500
    assert r.counters.discarded == 5
    assert r.checkpoint() == (5, [])


def test_drop_through_everything() -> None:
    r = reader(max_memory_size=250)
    r.add(items(range(1, 11), 100))
    r.drop_through(10, 8, 800)
    assert r.behind is None and r.items == 0 and r.bytes == 0
    assert r.checkpoint() == (10, [])


# -- property: the checkpoint describes exactly the outstanding items ------------------------


CAP = 300
#: The retry_backoff the machine's reads come back with, ms by error count.
BACKOFF = (5, 15)


class ReaderMachine(RuleBasedStateMachine):
    """A Reader driven like the broker drives it, against a model of consumed ids.

    The journal is a dict; refills are split in two steps (the read happens in a
    worker thread, so anything may happen between start and load)."""

    @initialize(cap=st.sampled_from([CAP, 1 << 20]), packing=st.booleans())
    def setup(self, cap: int, packing: bool) -> None:
        self.limits = Limits(max_memory_size=cap)
        self.r = (small_pack_reader if packing else Reader)("q", "", self.limits)
        self.journal: dict[int, Put] = {}
        self.consumed: set[int] = set()
        self.next_id = 1
        self.now = T0
        self.pending_load: tuple[int, list[Put], int] | None = None
        # Expected delivery order: aborted ids (newest abort first), then ids a back-off
        # made wait and now due (by due time, then id), then the rest by id.
        self.front: list[int] = []
        self.delays: dict[int, int] = {}  # id -> due ms, for items a back-off made wait
        # Leases of the reads opened by take_open, as the broker keeps them.
        self.reads = OpenReads()
        self.heap = TimeoutHeap(min_size=4)
        self.deadlines: dict[int, int] = {}  # id -> lease deadline (ms on the model clock)

    # -- helpers

    def outstanding(self) -> set[int]:
        return set(self.journal) - self.consumed

    def available(self) -> set[int]:
        return self.outstanding() - set(self.r.open) - set(self.r.moving)

    def expected_next(self, *, promoting: bool = True) -> list[int]:
        """In delivery order, but due items whose data is on disk: the items in memory
        may come before those (docs/queues.md, Delayed delivery, says so); `_take` reads
        them back once memory has nothing else. `promoting`: for a take or a peek, which
        first move what is due from the delay heap (a sweep or a discard does not)."""
        waiting = set(self.delays)
        in_memory = {e.id for e in self.r.due if not isinstance(e, int)}
        if promoting:
            in_memory |= set(self.r.parked)
        due = []  # due ones in due order, up to the first whose data is on disk: the
        for _, i in sorted((d, i) for i, d in self.delays.items() if d <= self.now):
            if i not in in_memory:  # rest waits behind it (memory's items come first)
                break
            due.append(i)
        rest = sorted(self.available() - set(self.front) - waiting)
        return self.front + due + rest

    def _settled(self, i: int) -> None:
        """Read `i` ended (confirmed, aborted, rejected): its lease ends with it."""
        self.reads.remove("q", "", i)
        self.deadlines.pop(i, None)

    def _return_with_backoff(self, ids: Iterable[int]) -> None:
        """What QueueState.return_read does with retry_backoff: each returned read (an
        error counted) waits the step of its error count, highest id first."""
        for i in sorted(ids, reverse=True):
            self._settled(i)
            it = self.r.abort(i, count_error=True)
            assert it is not None
            due = self.now + BACKOFF[min(it.error_count, len(BACKOFF)) - 1]
            self.r.delay_back(it, due)
            self.delays[i] = due

    def _take(self) -> Put | None:
        while True:
            expired: list[Put] = []
            order = self.expected_next()
            it = self.r.take(self.now, expired)
            got = [p.id for p in expired] + ([it.id] if it is not None else [])
            assert got == order[: len(got)], (got, order)
            for p in expired:
                self._forget_front(p.id)
                self.r.consume(p.id)
                self.consumed.add(p.id)
            if it is not None:
                self._forget_front(it.id)
                return it
            if self.r.wants_fetch():  # a due item whose data is on disk: read it back
                ids = self.r.fetch_ids(10)
                assert self.r.fetched([self.journal[i] for i in ids], ids) == 0
                continue
            if self.r.behind is None:
                assert not self.expected_next()  # (delayed items not due yet may wait)
                return None
            self.pending_load = None
            refill(self.r, self.journal)

    def _forget_front(self, i: int) -> None:
        if i in self.front:
            assert self.front[0] == i
            self.front.remove(i)
        self.delays.pop(i, None)

    # -- rules

    @rule(sizes=st.lists(st.integers(1, 160), min_size=1, max_size=5),
          ttl=st.none() | st.integers(1, 30))
    def add(self, sizes: list[int], ttl: int | None) -> None:
        puts = []
        for n in sizes:
            exp = None if ttl is None else self.now + ttl
            puts.append(Put(self.next_id, b"d" * n, self.now, exp))
            self.next_id += 1
        self.journal.update((p.id, p) for p in puts)
        self.r.add(puts)

    @rule(ms=st.integers(1, 20))
    def tick(self, ms: int) -> None:
        self.now += ms

    @rule()
    def take_and_consume(self) -> None:
        it = self._take()
        if it is not None:
            self.r.open_read(it)
            assert self.r.confirm(it.id)
            self.consumed.add(it.id)

    @rule(lease=st.integers(1, 30))
    def take_open(self, lease: int) -> None:
        it = self._take()
        if it is not None:
            self.r.open_read(it)
            self.reads.add("q", "", it.id, self.now + lease)
            self.heap.push(self.now + lease, self.reads, "q", "", [it.id])
            self.deadlines[it.id] = self.now + lease

    @precondition(lambda self: self.deadlines)
    @rule(data=st.data(), ms=st.integers(1, 60))
    def extend(self, data: st.DataObject, ms: int) -> None:
        """touch / extend: the leases move to `ms` from now, before or after they ran
        out (the broker returns a read at its deadline only if `expire` ran by then)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.deadlines)), min_size=1,
                                 unique=True))
        self.reads.add_many("q", "", ids, self.now + ms)
        self.heap.push(self.now + ms, self.reads, "q", "", ids)
        self.deadlines.update(dict.fromkeys(ids, self.now + ms))

    @rule()
    def expire(self) -> None:
        """The upkeep's timeout round: exactly the leases past their (last) deadline
        end, and their reads come back after a back-off."""
        due = self.heap.pop_due(self.now)
        gone = {t.item_id for t in due}
        assert gone == {i for i, d in self.deadlines.items() if d <= self.now}
        for i in gone:
            del self.deadlines[i]
        self._return_with_backoff(gone)

    @precondition(lambda self: self.r.open)
    @rule(data=st.data())
    def abort_with_backoff(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.sampled_from(sorted(self.r.open)), min_size=1))
        self._return_with_backoff(ids)

    @precondition(lambda self: self.r.open)
    @rule(data=st.data(), to_error_queue=st.booleans())
    def reject(self, data: st.DataObject, to_error_queue: bool) -> None:
        """What QueueState.reject_read does: to the error queue (a move), or dropped."""
        i = data.draw(st.sampled_from(sorted(self.r.open)))
        self._settled(i)
        if to_error_queue:
            it = self.r.open.pop(i)
            self.r.start_move(it)
        else:
            assert self.r.confirm(i)
            self.consumed.add(i)

    @rule(limit=st.integers(0, 6), max_bytes=st.sampled_from([0, 1, 50, 200]))
    def take_batch(self, limit: int, max_bytes: int) -> None:
        """A batch get's fast path: the next items at once, held, or nothing at all."""
        before = (self.r.items, self.r.bytes, self.r.mem_bytes, dict(self.r.open))
        want = self.expected_next()
        got = self.r.take_held(self.now, limit, max_bytes)
        event(f"take_held: {'some' if got else 'none'}")
        if not got:
            assert (self.r.items, self.r.bytes, self.r.mem_bytes, dict(self.r.open)) == before
            return
        assert not self.front and len(got) <= limit
        assert [it.id for it in got] == want[: len(got)]
        assert all(not self.r._expired(it, self.now) for it in got)
        if max_bytes:
            sizes = [len(it.data) for it in got]
            assert sum(sizes[:-1]) < max_bytes
        assert all(it.id in self.r.open for it in got)

    @precondition(lambda self: self.r.open)
    @rule(data=st.data())
    def confirm_batch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.r.open)), min_size=1,
                                 unique=True))
        stranger = max(self.journal, default=0) + 1  # never open: not confirmed
        assert [it.id for it in self.r.confirm_many([*ids, stranger])] == ids
        self.consumed.update(ids)
        for i in ids:
            self._settled(i)

    @rule()
    def take_and_move(self) -> None:
        it = self._take()
        if it is not None:
            self.r.start_move(it)

    @precondition(lambda self: self.r.moving)
    @rule(data=st.data(), moved=st.booleans())
    def end_move(self, data: st.DataObject, moved: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.r.moving)))
        self.r.end_move(i, moved=moved)
        if moved:
            self.consumed.add(i)
        else:
            self.front.insert(0, i)

    @precondition(lambda self: self.r.open)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.r.open)))
        assert self.r.confirm(i)
        self.consumed.add(i)
        self._settled(i)

    @precondition(lambda self: self.r.open)
    @rule(data=st.data(), count_error=st.booleans())
    def abort(self, data: st.DataObject, count_error: bool) -> None:
        ids = data.draw(st.sets(st.sampled_from(sorted(self.r.open)), min_size=1))
        abort_ids(self.r, ids, count_error=count_error)
        self.front = sorted(ids) + self.front
        for i in ids:
            self._settled(i)

    @rule()
    def peek(self) -> None:
        expired: list[Put] = []
        order = self.expected_next()
        it = self.r.peek(self.now, expired)
        got = [p.id for p in expired] + ([it.id] if it is not None else [])
        assert got == order[: len(got)]
        for p in expired:
            self._forget_front(p.id)
            self.r.consume(p.id)
            self.consumed.add(p.id)

    @rule(limit=st.integers(0, 3))
    def sweep(self, limit: int) -> None:
        expired: list[Put] = []
        self.r.expire_head(self.now, limit, expired)
        assert not limit or len(expired) <= limit
        assert [p.id for p in expired] == self.expected_next(promoting=False)[: len(expired)]
        for p in expired:
            assert p.expire_time_ms is not None and p.expire_time_ms <= self.now
            self._forget_front(p.id)
            self.r.consume(p.id)
            self.consumed.add(p.id)

    @rule()
    def flush(self) -> None:
        avail = self.available()
        assert self.r.flush() == len(avail)
        self.consumed |= avail
        self.front = []
        self.delays = {}

    @rule()
    def discard_oldest(self) -> None:
        order = self.expected_next(promoting=False)
        it = self.r.discard_oldest()
        if it is None:
            assert not held(self.r) and all(isinstance(e, int) for e in self.r.due)
            return
        assert it.id == order[0]
        self._forget_front(it.id)
        self.consumed.add(it.id)

    @precondition(lambda self: self.r.wants_refill() and self.pending_load is None)
    @rule()
    def start_refill(self) -> None:
        start = self.r.behind
        assert start is not None
        got, next_id = read_range(self.journal, start, self.r.tail, self.r.refill_budget())
        self.pending_load = (start, got, next_id)

    @precondition(lambda self: self.pending_load is not None)
    @rule()
    def finish_refill(self) -> None:
        assert self.pending_load is not None
        self.r.load(*self.pending_load)
        self.pending_load = None

    @rule()
    def checkpoint(self) -> None:
        head, done = self.r.checkpoint()
        assert done == sorted(done) and all(i > head for i in done)
        assert head <= self.r.tail
        assert replay(self.journal, head, done) == self.outstanding()
        for i in self.consumed:
            assert i <= head or i in done
        assert self.r.head == head and not self.r.dirty

    @precondition(lambda self: not self.r.moving and not self.delays)
    @rule()
    def restart(self) -> None:
        """Clean shutdown (open reads go back, checkpoint) and recovery from it. (That
        back-off delays survive one is tests/test_lease.py's, through the real files.)"""
        abort_ids(self.r, list(self.r.open), count_error=False)
        self.reads, self.heap, self.deadlines = OpenReads(), TimeoutHeap(min_size=4), {}
        head, done = self.r.checkpoint()
        r = Reader("q", "", self.limits, head=head, done=done, tail=max(self.journal, default=0))
        mem, behind, count, nbytes, _ = recovered(self.journal, head, done,
                                                  self.limits.max_memory_size)
        r.restore(mem, behind, count, nbytes)
        self.r = r
        self.front = []
        self.pending_load = None

    # -- invariants

    @invariant()
    def leases_match_the_model(self) -> None:
        assert self.reads.open.get(("q", ""), {}) == self.deadlines
        assert set(self.deadlines) <= set(self.r.open)

    @invariant()
    def reader_outstanding_matches_the_model(self) -> None:
        r = self.r
        waiting = [key_id(k) for k in r.delayed] + [
            key_id(e) if isinstance(e, int) else e.id for e in r.due]
        assert set(waiting) == set(self.delays)  # due or not, until taken
        seen = [p.id for p in held(r)] + list(r.open) + list(r.moving) + waiting
        assert len(seen) == len(set(seen)), "an id is held twice"
        disk = set()
        if r.behind is not None:
            disk = {i for i in self.journal if i >= r.behind and i not in r.done}
        assert set(seen).isdisjoint(disk)
        assert set(seen) | disk == self.outstanding()

    @invariant()
    def counters_match(self) -> None:
        r = self.r
        avail = self.available()
        assert r.items == len(avail)
        assert r.bytes == sum(len(self.journal[i].data) for i in avail)
        assert r.mem_bytes == sum(len(p.data) for p in held(r)) + sum(
            len(p.data) for p in r.parked.values()) + sum(
            len(e.data) for e in r.due if not isinstance(e, int))
        assert r.mem_count == len(held(r))

    @invariant()
    def ordering(self) -> None:
        r = self.r
        low = [p.id for p in r.front] + list(r.open) + list(r.moving)
        mem = [p.id for p in held(r)[len(r.front):]]
        assert mem == sorted(mem)
        assert len(r.mem) < r.pack_at
        if low and mem:
            assert max(low) < mem[0]
        if r.behind is not None and (mem or low):
            assert max(mem + low) < r.behind
        assert [p.id for p in r.front] == self.front

    @invariant()
    def memory_bounded_without_aborts(self) -> None:
        # Aborted items always come back to memory; a refill may take one item more
        # than its budget (it never returns nothing).
        r = self.r
        if not r.front and not self.delays and r.mem_count > 1:
            assert r.mem_bytes <= self.limits.max_memory_size + 160


ReaderMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_reader_state_machine = ReaderMachine.TestCase


@pytest.mark.parametrize("cap", [CAP])
def test_restore_then_refill_order(cap: int) -> None:
    journal = {p.id: p for p in items(range(1, 31), 50)}
    r = Reader("q", "", Limits(max_memory_size=cap), head=3, done=[5, 6, 20], tail=30)
    keep = sorted(replay(journal, 3, [5, 6, 20]))
    r.restore([journal[i] for i in keep[:6]], keep[6], len(keep), 50 * len(keep))
    assert take_all(r, journal) == keep


def test_flush_with_an_open_read_lists_at_most_the_cap_of_done_ids() -> None:
    from queued.reader.state import FLUSH_DONE_CAP

    r = reader(max_memory_size=100)
    r.add(items(range(1, 11), 10))  # ids 1..10 in memory
    r.add(items(range(11, FLUSH_DONE_CAP + 500), 100))  # the rest on disk only
    opened = take_open(r)
    assert r.flush() == FLUSH_DONE_CAP + 498
    assert len(r.done) == FLUSH_DONE_CAP and r.flush_overflow == 498
    head, done = r.checkpoint()
    assert head == opened.id - 1 and opened.id not in done and len(done) == FLUSH_DONE_CAP


def packable(i: int) -> Put:
    return Put(i, bytes([i % 256]) * 64, T0 + i % 3)


def test_a_reader_packs_its_backlog_and_gives_it_back_in_order() -> None:
    """At the server's sizes: a backlog of PACK_AT + 10 blocks is packed but for the newest
    items; takes, peeks, the checkpoint and the counts see one ordered sequence."""
    r = Reader("q", "", Limits(max_memory_size=1 << 30))
    n = PACK_AT + 10 * BLOCK_ITEMS + 5
    items = [packable(i) for i in range(1, n + 1)]
    items[7] = Put(8, b"e" * 64, T0, T0 + 10_000, flags=9)
    for k in range(0, n, 100):
        r.add(items[k:k + 100])
    assert len(r.mem) < PACK_AT and len(r.packed) == n - len(r.mem)
    assert r.mem_count == n and r.mem_bytes == 64 * n
    assert r.first_items(T0, 3) == items[:3]
    assert r.checkpoint() == (0, [])
    assert r.oldest_add_time_ms() == T0 + 1
    assert r.peek(T0, []) == items[0]
    got = []
    for _ in range(n // 2):
        it = r.take(T0, [])
        assert it is not None
        got.append(it)
    assert r.checkpoint() == (n // 2, [])
    r.drop_through(n // 2 + 10, 0, 0)  # (unpacks and packs again what stays)
    assert r.mem_count == n - n // 2 - 10
    while (it := r.take(T0, [])) is not None:
        got.append(it)
    assert got == items[:n // 2] + items[n // 2 + 10:]
    assert r.mem_bytes == 0 and r.items == 0 and r.packed is None and not r.unpacked


def test_a_consumer_that_keeps_up_packs_nothing() -> None:
    """The steady state (each item taken soon after it came) never packs or unpacks."""
    r = Reader("q", "", Limits(max_memory_size=1 << 30))
    r.add([packable(i) for i in range(1, PACK_AT - 1)])  # (a backlog just under PACK_AT)
    for i in range(PACK_AT - 1, 10 * PACK_AT):
        r.add([packable(i)])
        assert r.take(T0, []) == packable(i - PACK_AT + 2)
        assert r.packed is None


def _state(r: Reader) -> tuple[object, ...]:
    """What a reader holds, as takes see it, and how much of it waits unpacked."""
    return (r.tail, r.items, r.bytes, r.behind, r.mem_bytes, r.mem_count, r.counters.total_items,
            r.checkpoint(), r.first_items(T0, 1000), len(r.mem))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 120), st.sampled_from(["put", "headed", "delayed"])),
                min_size=1, max_size=40),
       st.sampled_from([300, 5000, 1 << 30]), st.integers(0, 3))
def test_items_added_one_at_a_time_or_together_leave_the_same_reader(
    shapes: list[tuple[int, str]], cap: int, old: int,
) -> None:
    """Reader.add of one plain put (its single-item path) and of a list (the bulk path and
    the general loop) agree: counts, memory, what goes behind, what is packed, the order
    of takes; ids at or below the tail (the first `old`, added again) are ignored."""
    made: list[Put] = []
    for i, (size, kind) in enumerate(shapes, 1):
        data = bytes([i % 256]) * size
        made.append(HeadedPut(i, data, T0, headers=b"h") if kind == "headed" else
                    DelayedPut(i, data, T0, due_ms=T0 - 1) if kind == "delayed" else
                    Put(i, data, T0))
    # (packing in blocks of 2 from 3 items held, as the state machine's readers do)
    one = small_pack_reader("q", "", Limits(max_memory_size=cap))
    together = small_pack_reader("q", "", Limits(max_memory_size=cap))
    for it in made:
        one.add([it])
    for it in made[:old]:
        one.add([it])  # (repeats: ignored)
    together.add(made)
    assert _state(one) == _state(together)
    journal = {p.id: p for p in made}
    assert take_all(one, journal) == take_all(together, journal)


def test_due_items_wait_behind_a_due_item_on_disk() -> None:
    """Found by the machine: two reads come back after the same back-off, the first's data
    on disk, the second's in memory; once due, the reader serves memory's items first (the
    not-delayed item 3) and the due items in due order once the first is read back."""
    m = ReaderMachine()
    m.setup(cap=CAP, packing=False)
    m.add(sizes=[1, 1, 149], ttl=None)
    m.take_open(lease=1)
    m.take_open(lease=1)
    m.tick(ms=1)
    m.expire()
    m.tick(ms=5)
    assert m.expected_next() == [3]
    m.peek()  # asserts the reader's answer is the model's
    for _ in range(3):
        m.take_and_consume()  # 3, then 1 read back from disk, then 2 (each asserted)
    assert not m.outstanding()


# -- batched takes and confirms against the per-item paths -------------------------------------


def _due_before_plain(bulk: bool) -> tuple[dict[int, Put], Reader]:
    store: dict[int, Put] = {
        1: Put(1, b"a" * 10, T0, None),
        2: DelayedPut(2, b"b" * 10, T0, None, due_ms=T0 + 5),
        3: DelayedPut(3, b"c" * 10, T0, None, due_ms=T0 + 5),
    }
    r = reader()
    r.add(list(store.values()))
    a, b = take_open(r, T0 + 10), take_open(r, T0 + 10)
    assert (a.id, b.id) == (2, 3)  # due first, ahead of the plain item 1
    assert ([it.id for it in r.confirm_many([2])] if bulk else [2] * r.confirm(2)) == [2]
    r.checkpoint()  # finds nothing delayed any more
    assert ([it.id for it in r.confirm_many([3])] if bulk else [3] * r.confirm(3)) == [3]
    return store, r


@pytest.mark.parametrize("bulk", [False, True], ids=["confirm", "confirm_many"])
def test_reader_confirm_of_a_due_item_ahead_of_a_held_one_is_checkpointed(bulk: bool) -> None:
    store, r = _due_before_plain(bulk)
    head, done = r.checkpoint()
    assert replay(store, head, done) == {1}


_ops = st.lists(st.tuples(
    st.sampled_from(["put", "put", "put", "get", "get", "open", "confirm", "abort", "tick",
                     "checkpoint", "restart"]),
    st.integers(0, 40), st.integers(0, 40), st.integers(0, 7)), max_size=50)


class _Pair:
    """Two readers fed the same items: `bulk` takes as QueueState.take_now does
    (take_held first) and confirms with confirm_many; `single` takes and confirms one at
    a time. Small packing blocks, so packed blocks are met often."""

    def __init__(self, cap: int) -> None:
        self.limits = Limits(max_memory_size=cap)
        self.bulk = small_pack_reader("q", "", self.limits)
        self.single = small_pack_reader("q", "", self.limits)
        self.store: dict[int, Put] = {}
        self.consumed: set[int] = set()

    def read_back(self, r: Reader) -> None:
        ids = r.fetch_ids(100)
        if ids:
            r.fetched([self.store[i] for i in ids], ids)
        elif r.behind is not None:
            start = r.behind
            got, next_id = read_range(self.store, start, r.tail, r.refill_budget())
            r.load(start, got, next_id)

    def take(self, r: Reader, now: int, limit: int, max_bytes: int, *,
             bulk: bool) -> tuple[list[Put], list[Put]]:
        out: list[Put] = []
        expired: list[Put] = []
        nbytes = 0
        try_bulk = bulk
        for _ in range(200):
            if len(out) >= limit or (max_bytes and nbytes >= max_bytes):
                break
            want = limit - len(out)
            if try_bulk and want > 1:
                run = r.take_held(now, want, max_bytes - nbytes if max_bytes else 0)
                if run:
                    out += run
                    nbytes += sum(len(it.data) for it in run)
                    continue
                try_bulk = False
            it = r.take(now, expired)
            if it is None:
                if not (r.wants_fetch() or r.behind is not None):
                    break
                self.read_back(r)
                try_bulk = bulk
                continue
            r.hold(it)
            out.append(it)
            nbytes += len(it.data)
        for it in expired:
            r.consume(it.id)
        return out, expired

    def confirm(self, r: Reader, ids: list[int], *, bulk: bool) -> list[int]:
        if bulk:
            return [it.id for it in r.confirm_many(ids)]
        return [i for i in ids if r.confirm(i)]

    def state(self, r: Reader) -> tuple[object, ...]:
        return (r.items, r.bytes, r.mem_bytes, sorted(r.open), r.counters.taken,
                r.counters.expired, r.counters.age_ms, r.counters.total_items, r.tail,
                r.behind, [it.id for it in held(r)], r.delayed_count)

    def check_checkpoint(self, r: Reader) -> None:
        head, done = r.checkpoint()
        assert replay(self.store, head, done) == set(self.store) - self.consumed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, cap=st.sampled_from([120, 1 << 20]))
@example(ops=[("put", 1, 0, 0), ("put", 3, 5, 0), ("tick", 10, 0, 0), ("open", 0, 0, 0),
              ("checkpoint", 0, 0, 0), ("confirm", 0, 0, 0), ("checkpoint", 0, 0, 0)],
         cap=1 << 20)
def test_bulk_take_and_confirm_match_the_per_item_paths(
    ops: list[tuple[str, int, int, int]], cap: int,
) -> None:
    """Bulk (take_held, confirm_many, Reader.add's bulk path) and per-item (take,
    confirm, add one at a time) readers deliver the same items in the same order with
    the same counters, and each one's checkpoint names exactly the consumed ids --
    with delayed items, expiry, aborts (back to the head or delayed), read-behind and
    clean restarts among them."""
    p = _Pair(cap)
    now = T0
    next_id = 0
    opened: list[int] = []
    for op, a, b, c in ops:
        if op == "put":
            puts: list[Put] = []
            for _ in range(c % 4 + 1):
                next_id += 1
                data = bytes([next_id % 256]) * (a % 50 + 1)
                exp = now + b if b % 5 == 1 else None
                if a % 3 == 0:
                    puts.append(DelayedPut(next_id, data, now, exp, due_ms=now + b))
                else:
                    puts.append(Put(next_id, data, now, exp))
            p.store.update((it.id, it) for it in puts)
            p.bulk.add(puts)
            for it in puts:
                p.single.add([it])
        elif op == "tick":
            now += a
        elif op in ("get", "open"):
            limit, max_bytes = c + 1, (0, 1, 30, 100)[b % 4]
            got_b, exp_b = p.take(p.bulk, now, limit, max_bytes, bulk=True)
            got_s, exp_s = p.take(p.single, now, limit, max_bytes, bulk=False)
            assert [it.id for it in got_b] == [it.id for it in got_s]
            assert [it.id for it in exp_b] == [it.id for it in exp_s]
            p.consumed.update(it.id for it in exp_b)
            ids = [it.id for it in got_b]
            if op == "get":
                assert p.confirm(p.bulk, ids, bulk=True) == ids
                assert p.confirm(p.single, ids, bulk=False) == ids
                p.consumed.update(ids)
            else:
                opened += ids
        elif op == "confirm" and opened:
            ids = opened[a % len(opened):][: c + 1]
            if b % 2:
                ids.reverse()
            assert p.confirm(p.bulk, ids, bulk=True) == ids
            assert p.confirm(p.single, ids, bulk=False) == ids
            p.consumed.update(ids)
            opened = [i for i in opened if i not in ids]
        elif op == "abort" and opened:
            i = opened.pop(a % len(opened))
            for r in (p.bulk, p.single):
                back = r.abort(i, count_error=True)
                assert back is not None
                if b % 3 == 0:
                    r.delay_back(back, now + c)
                else:
                    r.put_back(back)
        elif op == "checkpoint":
            p.check_checkpoint(p.bulk)
            p.check_checkpoint(p.single)
        elif op == "restart":
            opened = []
            for name in ("bulk", "single"):
                r = getattr(p, name)
                for i in sorted(r.open, reverse=True):
                    back = r.abort(i, count_error=False)
                    assert back is not None
                    r.put_back(back)
                head, done = r.checkpoint()
                assert replay(p.store, head, done) == set(p.store) - p.consumed
                fresh = small_pack_reader("q", "", p.limits, head=head, done=done,
                                        tail=next_id, delays=r.delays.items())
                left = sorted(replay(p.store, head, done))
                fresh.restore([], left[0] if left else None, len(left),
                              sum(len(p.store[i].data) for i in left))
                fresh.restore_delayed(
                    (r.delays.get(i, getattr(p.store[i], "due_ms", 0)), i, len(p.store[i].data))
                    for i in left if type(p.store[i]) is DelayedPut or i in r.delays)
                setattr(p, name, fresh)
        assert p.state(p.bulk) == p.state(p.single), op
