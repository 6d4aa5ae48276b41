"""A reader's delayed items (queued.reader.delays): the heap keys, the due order, where a
delayed item's data waits (memory under half full, else disk), read-back of due items,
and what leaves (dropped, flushed, lost) -- through a real Reader, which the mixin is part
of. The queue-level behaviour (aborts with a delay, recovery) is tests/test_delay.py's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from reader_util import T0, Limits

from queued.journal.format import DelayedPut, Put
from queued.reader.delays import delay_key, key_due, key_id, key_size
from queued.reader.shared import NO_ITEMS, NO_LIST
from queued.reader.state import Reader


def delayed(i: int, due: int, size: int = 10) -> DelayedPut:
    return DelayedPut(i, bytes([i % 256]) * size, T0, None, 0, 0, T0 + due)


@given(st.integers(0, 1 << 60), st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1))
def test_a_key_gives_back_its_due_time_id_and_size(due: int, item_id: int, size: int) -> None:
    key = delay_key(due, item_id, size)
    assert (key_due(key), key_id(key), key_size(key)) == (due, item_id, size)


@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(1, 1 << 40)), min_size=2,
                max_size=2, unique_by=lambda t: t[1]))
def test_keys_order_by_due_time_then_id(pairs: list[tuple[int, int]]) -> None:
    (d1, i1), (d2, i2) = pairs
    assert (delay_key(d1, i1, 7) < delay_key(d2, i2, 0)) == ((d1, i1) < (d2, i2))


def test_due_items_come_in_due_order_ties_in_id_order_after_nothing_else() -> None:
    r = Reader("q", "", Limits())
    r.add([delayed(1, 300), delayed(2, 100), delayed(3, 100), Put(4, b"plain", T0, None)])
    assert r.delayed_count == 3 and r.next_due_ms() == T0 + 100
    assert [r.take(T0, []).id for _ in range(1)] == [4]  # type: ignore[union-attr]
    assert r.take(T0 + 99, []) is None  # nothing due yet
    assert r.promote(T0 + 300) == 3 and r.delayed_count == 0
    assert [r.take(T0 + 300, []).id for _ in range(3)] == [2, 3, 1]  # type: ignore[union-attr]
    assert r.items == 0 and r.mem_bytes == 0


def test_data_stays_in_memory_while_under_half_full_then_waits_on_disk() -> None:
    r = Reader("q", "", Limits(max_memory_size=100))
    r.add([delayed(1, 10, size=40), delayed(2, 10, size=40)])
    assert list(r.parked) == [1]  # 40 fits in half of 100; 80 would not
    assert r.mem_bytes == 40 and r.items == 2 and r.bytes == 80
    r.promote(T0 + 10)
    assert r.take(T0 + 10, []).id == 1  # type: ignore[union-attr]
    assert r.take(T0 + 10, []) is None  # item 2's data is on disk: read it back first
    assert r.wants_fetch() and r.fetch_ids(10) == [2]
    assert r.fetched([delayed(2, 10, size=40)], [2]) == 0
    assert r.take(T0 + 10, []).id == 2  # type: ignore[union-attr]


def test_a_due_item_the_journal_no_longer_holds_leaves_counted_discarded() -> None:
    r = Reader("q", "", Limits(max_memory_size=10))
    r.add([Put(1, b"x" * 10, T0, None), delayed(2, 5, size=10)])  # memory full: on disk
    assert not r.parked
    r.promote(T0 + 5)
    assert r.fetch_ids(10) == [2]
    assert r.fetched([], [2]) == 1
    assert r.counters.discarded == 1 and r.items == 1 and not r.due


def test_drop_and_flush_take_delayed_items_with_them() -> None:
    r = Reader("q", "", Limits())
    r.add([delayed(1, 50), delayed(2, 50), delayed(3, 500)])
    r.promote(T0 + 50)
    assert sorted(r.delayed_ids()) == [1, 2, 3]
    assert sorted(r.drop_delayed(lambda i: i != 2)) == [1, 3]
    assert r.items == 1 and r.counters.discarded == 2 and r.delayed_ids() == [2]
    assert r.flush() == 1
    assert r.delayed is NO_LIST and r.due is NO_ITEMS and not r.parked
    assert r.delay_low is None and r.delayed_ids() == []


def test_the_checkpoint_keeps_the_head_below_the_lowest_delayed_id() -> None:
    r = Reader("q", "", Limits())
    r.add([delayed(1, 1000), Put(2, b"a", T0, None), Put(3, b"b", T0, None)])
    for _ in range(2):
        it = r.take(T0, [])
        assert it is not None
        r.consume(it.id)
    assert r.checkpoint() == (0, [2, 3])  # item 1 still waits
    r.promote(T0 + 1000)
    it = r.take(T0 + 1000, [])
    assert it is not None and it.id == 1
    r.consume(1)
    assert r.delay_low_id() is None
    assert r.checkpoint() == (3, [])
