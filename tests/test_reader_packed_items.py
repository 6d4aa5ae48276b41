"""PackedItems (queued.reader.packed_items) against a model, a deque of blocks of Puts:
pack, unpack_next, iteration, len, truth and clear, with plain items (packed) and every
kind it keeps as objects (DelayedPut, error counts, big data, values its columns cannot
hold), and items with headers (packed, their headers in a column). A Reader packing its
backlog is tested in test_reader_state.py.

A reader that packs in tiny blocks must behave exactly as one that never packs (a
differential state machine over every Reader operation the broker uses, delays,
read-behind, drop_through and restarts included); edge-case items keep every field
through a block; the paths that walk a whole backlog (drop_through, flush) unpack no
more than they must; and a broker with packed backlogs drops, counts, shows and
restarts right."""

from __future__ import annotations

import dataclasses
import tracemalloc
from array import array
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from broker_util import get_all, make_config, stats
from compiled_util import not_compiled
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reader_util import Limits, held, read_range, recovered

from queued.broker.upkeep import open_broker
from queued.journal.format import DelayedPut, HeadedPut, Put
from queued.reader.open_reads import OpenReads
from queued.reader.packed_items import BLOCK_ITEMS, SMALL_MAX, PackedItems, PackedStats
from queued.reader.state import PACK_AT, Reader

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


def test_a_block_of_consecutive_ids_holds_them_in_less_memory() -> None:
    """Consecutive ids, a reader's usual block, cost no column (a range: 8 B less per
    item); ids with a gap, or in another order with the same ends, keep theirs. Either
    way the ids and the items come back equal."""
    n = BLOCK_ITEMS
    shapes = {
        "consecutive": list(range(10, 10 + n)),
        "a gap": [*range(10, 10 + n - 1), 10 + n],
        "same ends, out of order": [10, 12, 11, *range(13, 10 + n)],
    }
    held: dict[str, int] = {}
    for name, ids in shapes.items():
        items = [plain(i, 64) for i in ids]
        packed = PackedItems()
        tracemalloc.start()
        try:
            packed.pack(items)
            held[name] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert packed.ids() == ids, name
        assert packed.unpack_next() == items[::-1], name
    column = 8 * n
    assert held["a gap"] - held["consecutive"] > column - 200, held
    assert abs(held["a gap"] - held["same ends, out of order"]) < 64, held


def test_a_block_of_big_items_is_kept_as_it_is() -> None:
    items = [Put(i, b"b" * (SMALL_MAX + i), T0) for i in range(1, 5)]
    packed = PackedItems()
    packed.pack(items)
    packed.pack([plain(9)])
    assert packed.statistics() == PackedStats(5, 2, 1, 4, len(plain(9).data))
    assert list(packed) == [*items, plain(9)]
    got = packed.unpack_next()
    assert got == items[::-1] and all(a is b for a, b in zip(got, items[::-1], strict=True))


# -- a Reader that packs behaves as one that never packs ---------------------------------------


def tiny_pack(*args: Any, **kwargs: Any) -> Reader:
    """A Reader that packs in blocks of 2 once 3 items wait (set on the instance: a compiled
    Reader takes no interpreted subclass)."""
    r = Reader(*args, **kwargs)
    r.pack_at = 3
    r.pack_block = 2
    return r


def never_pack(*args: Any, **kwargs: Any) -> Reader:
    """The reader as it was before packing."""
    r = Reader(*args, **kwargs)
    r.pack_at = 1 << 62
    return r


item_spec = st.tuples(
    st.sampled_from([0, 1, 64, SMALL_MAX, SMALL_MAX + 1]),  # data size
    st.sampled_from([None, None, 0, -5, 3, 40]),  # expire: none, 0, past, soon (ms from now)
    st.sampled_from([0, 0, 7, (1 << 32) - 1]),  # flags
    st.sampled_from([0, 0, -1, T0]),  # add time: now, negative, fixed
    st.sampled_from([None] * 6 + [0, 5, 30]),  # delay (ms), None: a plain Put
)


class PackedVsPlain(RuleBasedStateMachine):
    """The same calls on a tiny_pack and a never_pack reader give the same answers and
    leave the same state (held items in order with every field, counts, checkpoint)."""

    @initialize(cap=st.sampled_from([700, 1 << 20]))
    def setup(self, cap: int) -> None:
        self.limits = Limits(max_memory_size=cap)
        self.a: Reader = tiny_pack("q", "", self.limits)
        self.b: Reader = never_pack("q", "", self.limits)
        self.journal: dict[int, Put] = {}
        self.next_id = 1
        self.now = T0

    def both(self, name: str, *args: object, **kw: object) -> object:
        ra = getattr(self.a, name)(*args, **kw)
        rb = getattr(self.b, name)(*args, **kw)
        assert ra == rb, (name, args, ra, rb)
        return ra

    def take_both(self, *, peek: bool = False) -> Put | None:
        ea: list[Put] = []
        eb: list[Put] = []
        fa = (self.a.peek if peek else self.a.take)(self.now, ea)
        fb = (self.b.peek if peek else self.b.take)(self.now, eb)
        assert fa == fb and ea == eb
        for it in ea:  # what the broker does with an expired item without a target
            self.both("consume", it.id)
        return fa

    @rule(specs=st.lists(item_spec, min_size=1, max_size=10))
    def add(self, specs: list[tuple[int, int | None, int, int, int | None]]) -> None:
        new: list[Put] = []
        for size, expire, flags, add, delay in specs:
            i = self.next_id
            self.next_id += 1
            data = bytes([i % 251]) * size
            exp = None if expire is None else (0 if expire == 0 else self.now + expire)
            at = self.now if add == 0 else add
            p = (Put(i, data, at, exp, 0, flags) if delay is None
                 else DelayedPut(i, data, at, exp, 0, flags, self.now + delay))
            self.journal[i] = p
            new.append(p)
        self.a.add(new)
        self.b.add(new)

    @rule(ms=st.integers(1, 20))
    def tick(self, ms: int) -> None:
        self.now += ms
        self.both("promote", self.now)

    @rule(keep_open=st.booleans())
    def take(self, keep_open: bool) -> None:
        it = self.take_both()
        if it is not None:
            self.both("open_read", it)
            if not keep_open:
                self.both("confirm", it.id)

    @rule()
    def peek(self) -> None:
        self.take_both(peek=True)

    @precondition(lambda self: self.a.open)
    @rule(data=st.data(), count_error=st.booleans(), delay=st.sampled_from([None, 0, 10]))
    def abort(self, data: st.DataObject, count_error: bool, delay: int | None) -> None:
        i = data.draw(st.sampled_from(sorted(self.a.open)))
        it = self.both("abort", i, count_error=count_error)
        assert isinstance(it, Put)
        if delay is None:
            self.both("put_back", it)
        else:
            self.both("delay_back", it, self.now + delay)

    @rule(limit=st.integers(0, 3))
    def expire_head(self, limit: int) -> None:
        ea: list[Put] = []
        eb: list[Put] = []
        self.a.expire_head(self.now, limit, ea)
        self.b.expire_head(self.now, limit, eb)
        assert ea == eb
        for it in ea:
            self.both("consume", it.id)

    @rule()
    def discard_oldest(self) -> None:
        self.both("discard_oldest")

    @rule()
    def flush(self) -> None:
        self.both("flush")

    @precondition(lambda self: self.a.wants_refill())
    @rule()
    def refill(self) -> None:
        start = self.a.behind
        assert start is not None and start == self.b.behind
        got, next_id = read_range(self.journal, start, self.a.tail, self.a.refill_budget())
        self.both("load", start, got, next_id)

    @precondition(lambda self: self.a.wants_fetch())
    @rule()
    def fetch(self) -> None:
        ids = self.both("fetch_ids", 10)
        assert isinstance(ids, list)
        self.both("fetched", [self.journal[i] for i in ids if i in self.journal], ids)

    @precondition(lambda self: self.journal)
    @rule(data=st.data())
    def drop_through(self, data: st.DataObject) -> None:
        """What Queue.before_drop does, then the journal forgets the ids."""
        last = data.draw(st.integers(min(self.journal), max(self.journal)))
        r = self.a
        count = nbytes = 0
        if r.behind is not None:
            for i, p in self.journal.items():
                if (i <= last and type(p) is not DelayedPut and i not in r.delays
                        and r.behind <= i <= r.tail and i not in r.done):
                    count += 1
                    nbytes += len(p.data)
        self.both("drop_through", last, count, nbytes)
        self.journal = {i: p for i, p in self.journal.items() if i > last}

    @rule()
    def checkpoint(self) -> None:
        self.both("checkpoint")
        self.both("error_counts")
        self.both("delay_entries")

    @precondition(lambda self: not self.a.moving)
    @rule()
    def restart(self) -> None:
        """Open reads go back, a checkpoint, then recovery as readback does it."""
        for i in sorted(self.a.open, reverse=True):
            self.both("put_back", self.both("abort", i, count_error=False))
        head, done = self.a.checkpoint()
        errors, delays = self.a.error_counts(), self.a.delay_entries()
        assert (head, done, errors, delays) == (
            *self.b.checkpoint(), self.b.error_counts(), self.b.delay_entries())
        tail = self.a.tail
        mem, behind, count, nbytes, delayed = recovered(
            self.journal, head, done, self.limits.max_memory_size, dict(delays))
        self.a, self.b = (cls("q", "", self.limits, head=head, done=done, tail=tail,
                              errors=errors, delays=delays) for cls in (tiny_pack, never_pack))
        self.both("restore", mem, behind, count, nbytes)
        self.both("restore_delayed", delayed)

    @invariant()
    def same_state(self) -> None:
        a, b = self.a, self.b
        assert held(a) == held(b)
        for f in ("items", "bytes", "mem_bytes", "mem_count", "behind", "tail", "head",
                  "done", "errors", "delays", "open", "delayed", "parked", "delay_low",
                  "counters"):
            assert getattr(a, f) == getattr(b, f), f
        assert list(a.due) == list(b.due)
        assert a.first_items(self.now, 4) == b.first_items(self.now, 4)
        assert a.oldest_add_time_ms() == b.oldest_add_time_ms()
        assert a.wants_refill() == b.wants_refill()
        assert len(a.mem) < a.pack_at
        assert a.mem_bytes == sum(len(p.data) for p in held(a)) + sum(
            len(p.data) for p in a.parked.values()) + sum(
            len(e.data) for e in a.due if not isinstance(e, int))


PackedVsPlain.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_packing_reader_matches_a_reader_that_never_packs = PackedVsPlain.TestCase


@not_compiled("a Put of bytearray or memoryview data: the compiled Put takes "
              "bytes only, as its type says")
def test_edge_case_items_come_back_equal_with_every_field() -> None:
    cases = [
        Put(1, b"", 0), Put(2, b"", T0), Put(3, b"s" * SMALL_MAX, T0),
        Put(4, b"b" * (SMALL_MAX + 1), T0), Put(5, b"n", -1), Put(6, b"z", T0, 0),
        Put(7, b"e", T0, -1), Put(8, b"f", T0, None, 0, (1 << 32) - 1), Put(9, b"g", T0, I64),
        Put(I64, b"h", I64, I64), Put(11, b"x", T0, None, 3),
        DelayedPut(14, b"d", T0, None, 0, 0, T0 + 5),
        Put(12, bytearray(b"ba"), T0),  # type: ignore[arg-type]
        Put(13, memoryview(b"mv"), T0),  # type: ignore[arg-type]
    ]
    p = PackedItems()
    p.pack(cases)
    assert list(p) == cases
    out = p.unpack_next()[::-1]
    assert out == cases and [type(it) for it in out] == [type(it) for it in cases]
    assert out[5].expire_time_ms == 0 and out[0].expire_time_ms is None
    assert isinstance(out[-1].data, memoryview)  # (kept as it is: not `bytes`)


@not_compiled("a Put of bytearray or memoryview data: the compiled Put takes "
              "bytes only, as its type says")
def test_data_whose_length_is_not_its_byte_count_is_not_corrupted() -> None:
    """A memoryview of 4-byte ints: len() counts 2 elements, its bytes are 8. Packing
    sized the block's offsets by len(): this item and the next came back wrong."""
    words = memoryview(array("I", [1, 2]))
    items = [Put(1, words, T0), Put(2, b"xy", T0)]  # type: ignore[arg-type]
    p = PackedItems()
    p.pack(items)
    out = p.unpack_next()[::-1]
    assert bytes(out[0].data) == bytes(words) and out[1].data == b"xy"


def _packed_reader(n: int) -> Reader:
    r = Reader("q", "", Limits(max_memory_size=1 << 30))
    r.add([Put(i, bytes([i % 251]) * 64, T0) for i in range(1, n + 1)])
    assert len(r.packed) > n // 2
    return r


def _peak_bytes(call: object) -> int:
    tracemalloc.start()
    try:
        call()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_drop_through_a_segment_unpacks_only_what_it_drops() -> None:
    """drop_oldest dropping a segment of 1,000 items from a reader holding 100,000 packed
    ones: it made every held item an object again (~15 MB here; +151 MB and 0.7 s with
    500,000 held) and packed them again, on the event loop, once per dropped segment."""
    n = 100_000
    r = _packed_reader(n)
    peak = _peak_bytes(lambda: r.drop_through(1000, 0, 0))
    assert peak < 1_000_000, peak
    assert r.items == r.mem_count == n - 1000 and r.mem_bytes == r.bytes == 64 * (n - 1000)
    assert r.counters.discarded == 1000
    assert r.checkpoint() == (1000, [])
    first = r.take(T0, [])
    assert first is not None and first.id == 1001


def test_drop_through_boundaries_inside_unpacked_packed_and_mem() -> None:
    for last in (1, 2, 5, 6, 7, 8, 9, 10, 11, 12):
        r = tiny_pack("q", "", Limits())
        r.add([Put(i, b"d" * i, T0) for i in range(1, 13)])
        assert r.take(T0, []) is not None  # id 1 taken: part of a block is unpacked
        r.consume(1)
        r.put_back(Put(1, b"d", T0))  # and back at the front
        assert r.unpacked and r.packed and r.mem
        r.drop_through(last, 0, 0)
        left = [p.id for p in held(r)]
        assert left == list(range(last + 1, 13)), (last, left)
        assert r.items == r.mem_count == 12 - last
        assert r.mem_bytes == r.bytes == sum(range(last + 1, 13))
        assert r.counters.discarded == last


def test_flush_without_open_reads_does_not_unpack_the_backlog() -> None:
    """A flush with nothing open needs no ids (the head moves to the tail), yet it made
    every packed item an object to list their ids."""
    r = _packed_reader(100_000)
    peak = _peak_bytes(r.flush)
    assert peak < 1_000_000, peak
    assert r.checkpoint() == (100_000, []) and r.items == 0 and r.mem_bytes == 0


def test_flush_with_an_open_read_lists_every_held_id() -> None:
    r = _packed_reader(10_000)
    it = r.take(T0, [])
    assert it is not None
    r.open_read(it)
    assert r.flush() == 9_999
    head, done = r.checkpoint()
    assert head == 0 and done == list(range(2, 10_001))
    assert dataclasses.astuple(r.counters)[0] == 10_000


BIG_BACKLOG = """
[queues.q]
journal_size = 65536
max_journal_size = 262144
journal_full_policy = "drop_oldest"
"""


def p64(i: int) -> bytes:
    return b"%06d" % i + b"." * 58


async def test_broker_with_packed_backlogs_drops_counts_shows_and_restarts_right(
    tmp_path: Path,
) -> None:
    """Two fanout readers hold more than PACK_AT items (packed); drop_oldest drops whole
    segments under them; stats, the console's head view, open reads, a restart and the
    drain all see the newest items once each, in order."""
    cfg = make_config(tmp_path, BIG_BACKLOG)
    n = 3 * PACK_AT
    async with open_broker(cfg) as broker:
        assert await broker.get("q", "a") is None  # (a takes over the default reader)
        assert await broker.get("q", "b") is None
        for i in range(0, n, 100):
            await broker.put("q", [p64(k) for k in range(i, min(i + 100, n))])
        got_a = [it.data for it in [await broker.get("q", "a") for _ in range(10)] if it]
        c = broker.register(OpenReads())
        opened = await broker.get("q", "b", client=c, open=True)  # stays open
        assert opened is not None
        sa, sb = stats(broker, "q+a"), stats(broker, "q+b")
        for s, held_out in ((sa, 0), (sb, 1)):
            assert s["discarded"] > 0  # segments were dropped under a packed backlog
            assert s["items"] == s["mem_items"] > PACK_AT
            assert s["items"] + s["discarded"] + held_out == n - (10 if s is sa else 0)
            assert s["mem_bytes"] == s["bytes"] == 64 * s["items"]
        head_b = broker.head_items("q", "b", 3)
        assert head_b is not None
        first_b = int(head_b[0].data[:6])
        assert [it.data for it in head_b] == [p64(first_b + k) for k in range(3)]
    async with open_broker(cfg) as broker:  # the open read came back at the head
        got_b = await get_all(broker, "q", "b")
        got_a += await get_all(broker, "q", "a")
    assert got_b == [opened.data] + [p64(k) for k in range(first_b, n)]
    first_a = int(got_a[0][:6])
    assert got_a == [p64(k) for k in range(first_a, n)] and first_a == int(opened.data[:6])
    assert first_b == first_a + 1


async def test_fanout_readers_pack_only_what_saves_memory(tmp_path: Path) -> None:
    """The readers of a queue share the objects a put hands them; packed, each holds a copy
    of its own (pack_max_for). With one reader 256 B items are packed; with two, 64 B items
    are (a copy each is cheaper than a shared object) and 256 B items stay shared objects."""
    cfg = make_config(tmp_path, BIG_BACKLOG)
    n = PACK_AT + 2 * 128
    async with open_broker(cfg) as broker:
        for q in ("two64", "two256"):
            assert await broker.get(q, "a") is None
            assert await broker.get(q, "b") is None
        for q, size in (("one256", 256), ("two64", 64), ("two256", 256)):
            await broker.put(q, [b"%06d" % i + b"." * (size - 6) for i in range(n)])
        packed = {(q, r): h.reader.packed.statistics()
                  for q in ("one256", "two64", "two256")
                  for r, h in broker.registry.queues[q].readers.items()}
        assert all(s.items >= 128 for s in packed.values())  # blocks were made
        assert {k: s.packed == s.items for k, s in packed.items()} == {
            ("one256", ""): True, ("two64", "a"): True, ("two64", "b"): True,
            ("two256", "a"): False, ("two256", "b"): False}
        assert not any(packed["two256", r].packed for r in "ab")
        shared = broker.registry.queues["two256"].readers
        assert shared["a"].reader.packed.unpack_next()[0] is (
            shared["b"].reader.packed.unpack_next()[0])  # one object for both readers
        for q in ("one256", "two64"):
            assert [d[:6] for d in await get_all(broker, q, "a" if q == "two64" else None)
                    ] == [b"%06d" % i for i in range(n)]
