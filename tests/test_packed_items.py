"""PackedItems (queued.reader.packed_items) against a model, a deque of blocks of Puts:
pack, unpack_next, iteration, len, truth and clear, with plain items (packed) and every
kind it keeps as objects (DelayedPut, error counts, big data, values its columns cannot
hold), and items with headers (packed, their headers in a column). A Reader packing its
backlog is tested in test_queue.py."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from queued.journal.format import DelayedPut, HeadedPut, Put
from queued.reader.packed_items import BLOCK_ITEMS, SMALL_MAX, PackedItems, PackedStats

T0 = 1_700_000_000_000
I64 = (1 << 63) - 1


def plain(i: int, size: int | None = None) -> Put:
    return Put(i, bytes([i % 256]) * (i % 70 if size is None else size), T0 + i % 3)


@st.composite
def puts(draw: st.DrawFn) -> Put:
    """Mostly plain items; the rest each have one thing a packed block treats apart."""
    i = draw(st.integers(1, I64))
    data = draw(st.one_of(st.binary(max_size=80), st.just(b"z" * SMALL_MAX),
                          st.just(b"y" * (SMALL_MAX + 1))))
    add = draw(st.one_of(st.just(T0), st.integers(-(1 << 63), I64)))
    expire = draw(st.one_of(st.none(), st.just(T0 + 5), st.integers(-(1 << 63), I64)))
    flags = draw(st.one_of(st.just(0), st.integers(0, (1 << 32) - 1), st.just(1 << 40)))
    errors = draw(st.one_of(st.just(0), st.integers(0, 5)))
    headers = draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=30)))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return DelayedPut(i, data, add, expire, errors, flags, draw(st.integers(0, I64)),
                          headers)
    if kind < 4:  # (headers packed in a column of their own)
        return HeadedPut(i, data, add, expire, errors, flags, headers)
    return Put(i, data, add, expire, errors, flags)


class PackedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: deque[list[Put]] = deque()  # the blocks packed
        self.packed = PackedItems()
        self.next_id = 1

    @rule(n=st.integers(0, BLOCK_ITEMS + 20))
    def pack_plain(self, n: int) -> None:
        new = [plain(i) for i in range(self.next_id, self.next_id + n)]
        self.next_id += n
        self.packed.pack(new)
        if new:
            self.model.append(new)

    @rule(new=st.lists(puts(), max_size=8))
    def pack_mixed(self, new: list[Put]) -> None:
        self.packed.pack(new)
        if new:
            self.model.append(new)

    @rule()
    def unpack_next(self) -> None:
        if not self.model:
            with pytest.raises(IndexError):
                self.packed.unpack_next()
            return
        got = self.packed.unpack_next()
        want = self.model.popleft()
        assert got == want[::-1]
        assert [type(it) for it in got] == [type(it) for it in want[::-1]]

    @rule()
    def clear(self) -> None:
        self.packed.clear()
        self.model.clear()

    @invariant()
    def same(self) -> None:
        assert len(self.packed) == sum(map(len, self.model))
        assert bool(self.packed) == bool(self.model)
        assert list(self.packed) == [it for b in self.model for it in b]


PackedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                           deadline=None)
test_packed_items_behave_as_a_deque_of_blocks = PackedMachine.TestCase


def test_plain_items_are_packed_and_others_stay_objects() -> None:
    special = [Put(1, b"x" * (SMALL_MAX + 1), T0), Put(2, b"e", T0, error_count=1),
               DelayedPut(3, b"d", T0, due_ms=T0 + 1), Put(4, b"n", -1)]
    items = special + [plain(i) for i in range(5, 5 + BLOCK_ITEMS)]
    packed = PackedItems()
    packed.pack(items)
    assert packed.statistics() == PackedStats(len(items), 1, BLOCK_ITEMS, 4,
                                              sum(len(it.data) for it in items[4:]))
    assert list(packed) == items
    assert packed.unpack_next() == items[::-1]
    assert packed.statistics() == PackedStats(0, 0, 0, 0, 0)


def test_items_with_headers_are_packed_their_headers_in_a_column() -> None:
    items = [HeadedPut(i, b"d%d" % i, T0, None, 0, i % 2, b"h%d" % i) if i % 3 else plain(i)
             for i in range(1, 1 + BLOCK_ITEMS)]
    packed = PackedItems()
    packed.pack(items)
    heads = sum(len(it.headers) for it in items)
    assert packed.statistics() == PackedStats(len(items), 1, len(items), 0,
                                              sum(len(it.data) for it in items) + heads)
    got = packed.unpack_next()[::-1]
    assert got == items and [type(it) for it in got] == [type(it) for it in items]


def test_a_block_of_big_items_is_kept_as_it_is() -> None:
    items = [Put(i, b"b" * (SMALL_MAX + i), T0) for i in range(1, 5)]
    packed = PackedItems()
    packed.pack(items)
    packed.pack([plain(9)])
    assert packed.statistics() == PackedStats(5, 2, 1, 4, len(plain(9).data))
    assert list(packed) == [*items, plain(9)]
    got = packed.unpack_next()
    assert got == items[::-1] and all(a is b for a, b in zip(got, items[::-1], strict=True))
