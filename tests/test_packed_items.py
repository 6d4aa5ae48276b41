"""PackedItems (queued.core.packed_items) against a model, a deque of Puts: every
operation Reader.mem uses, with plain items (packed) and every kind it keeps as objects
(DelayedPut, error counts, big data, values its columns cannot hold), small blocks and the
real size."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from queued.core.journal_format import DelayedPut, Put
from queued.core.packed_items import BLOCK_ITEMS, SMALL_MAX, PackedItems, PackedStats

T0 = 1_700_000_000_000
I64 = (1 << 63) - 1


class SmallBlocks(PackedItems):
    block_items = 3
    __slots__ = ()


def plain(i: int) -> Put:
    return Put(i, bytes([i % 256]) * (i % 70), T0 + i % 3)


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
    if draw(st.integers(0, 9)) == 0:
        return DelayedPut(i, data, add, expire, errors, flags, draw(st.integers(0, I64)))
    return Put(i, data, add, expire, errors, flags)


class PackedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: deque[Put] = deque()
        self.packed: PackedItems = PackedItems()
        self.next_id = 1

    @rule(small=st.booleans())
    def remake(self, small: bool) -> None:
        """Start over with either block size, from what the model holds (the constructor)."""
        self.packed = (SmallBlocks if small else PackedItems)(self.model)

    @rule(it=puts())
    def append(self, it: Put) -> None:
        self.packed.append(it)
        self.model.append(it)

    @rule(n=st.integers(0, BLOCK_ITEMS + 20))
    def extend_plain(self, n: int) -> None:
        new = [plain(i) for i in range(self.next_id, self.next_id + n)]
        self.next_id += n
        self.packed.extend(new)
        self.model.extend(new)

    @rule(extra=st.lists(puts(), max_size=8))
    def extend_mixed(self, extra: list[Put]) -> None:
        self.packed.extend(extra)
        self.model.extend(extra)

    @precondition(lambda self: self.model)
    @rule(n=st.integers(1, BLOCK_ITEMS + 10))
    def popleft(self, n: int) -> None:
        for _ in range(min(n, len(self.model))):
            assert self.packed.popleft() == self.model.popleft()

    @precondition(lambda self: self.model)
    @rule()
    def head_then_pop(self) -> None:
        head = self.packed[0]
        assert head == self.model[0]
        assert self.packed.popleft() == self.model.popleft()

    @rule()
    def pop_empty_or_index(self) -> None:
        if not self.model:
            with pytest.raises(IndexError):
                self.packed.popleft()
            with pytest.raises(IndexError):
                self.packed[0]
        with pytest.raises(IndexError):
            self.packed[1]

    @rule()
    def clear(self) -> None:
        self.packed.clear()
        self.model.clear()

    @rule()
    def keep_some(self) -> None:
        """Reader.drop_through's way: iterate, clear, extend with what stays."""
        keep = [it for it in self.packed if it.id % 2]
        self.packed.clear()
        self.packed.extend(keep)
        self.model = deque(it for it in self.model if it.id % 2)

    @invariant()
    def same(self) -> None:
        assert len(self.packed) == len(self.model)
        assert bool(self.packed) == bool(self.model)
        assert list(self.packed) == list(self.model)
        if self.model:
            assert self.packed[0] == self.model[0]


PackedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
test_packed_items_behave_as_a_deque = PackedMachine.TestCase


@given(st.lists(puts(), max_size=40))
@settings(max_examples=50, deadline=None)
def test_items_come_back_equal_and_of_their_type(items: list[Put]) -> None:
    packed = SmallBlocks(items)
    out = [packed.popleft() for _ in items]
    assert out == items
    assert [type(it) for it in out] == [type(it) for it in items]
    assert not packed and len(packed) == 0


def test_a_consumer_that_keeps_up_packs_nothing() -> None:
    """The steady state (each item taken soon after it came) never packs or unpacks: a
    consumer one item behind never meets a block, however many items pass."""
    packed = PackedItems()
    packed.append(plain(1))
    for i in range(2, 10 * BLOCK_ITEMS):
        packed.append(plain(i))
        assert packed.popleft().id == i - 1
        assert packed.statistics().blocks == 0
    assert list(packed) == [plain(10 * BLOCK_ITEMS - 1)]


def test_plain_items_are_packed_and_others_stay_objects() -> None:
    special = [Put(1, b"x" * (SMALL_MAX + 1), T0), Put(2, b"e", T0, error_count=1),
               DelayedPut(3, b"d", T0, due_ms=T0 + 1), Put(4, b"n", -1)]
    items = special + [plain(i) for i in range(5, 5 + BLOCK_ITEMS)]
    packed = PackedItems(items)
    stats = packed.statistics()
    assert (stats.items, stats.blocks, stats.packed, stats.objects) == (
        len(items), 1, BLOCK_ITEMS - 4, 4 + len(items) - BLOCK_ITEMS)
    assert stats.packed_bytes == sum(len(it.data) for it in items[4:BLOCK_ITEMS])
    assert list(packed) == items
    assert packed.popleft() == items[0]  # (taking from a block unpacks it whole)
    assert packed.statistics() == PackedStats(len(items) - 1, 0, 0, len(items) - 1, 0)
