"""Review of the batched get/confirm/add paths (20f213b, 463d32c, 18e58c3, 6c2b222):
real brokers over real data directories (tests/test_broker.py's helpers), the pure
reader against the per-item path, and a restart after each scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_util import running
from test_broker import T0, FakeClock, advance, datas, frozen_clock, make_config
from test_parking import cfg as park_cfg
from test_parking import park_each, stats_of
from test_queue import Limits, SmallPackReader, held, read_range, reader, replay, take_open

from queued.broker.upkeep import open_broker
from queued.journal.format import DelayedPut, Put
from queued.reader.open_reads import TIMEOUT_HEAP_MIN, OpenReads
from queued.reader.state import Reader


@pytest.fixture
def trio_clock() -> trio.testing.MockClock:
    return frozen_clock()


async def test_confirmed_due_item_is_not_delivered_again_after_a_restart(
    tmp_path: Path,
) -> None:
    # A due item is delivered before a plain item with a lower id still held. A
    # checkpoint while it is open finds nothing delayed any more; its confirm then
    # moved the reader's head past the held item and listed it nowhere, so the next
    # checkpoint (head below the held item) forgot it was consumed.
    cfg = make_config(tmp_path)
    clock = FakeClock(T0)
    async with open_broker(cfg, clock=clock) as broker:
        await broker.put("q", [b"plain"])
        await broker.put("q", [b"delayed"], delay_ms=10)
        clock.now += 20
        c = broker.register(OpenReads())
        assert datas(await broker.get_many("q", max_items=1, client=c, open=True)) == [b"delayed"]
        await broker.checkpoint_all(force=True)
        assert broker.confirm(c, "q") == 1
        await broker.put("q", [b"later"])  # (a writer round: the confirm is journaled)
        await broker.checkpoint_all(force=True)
    async with open_broker(cfg, clock=clock) as broker:
        got = datas(await broker.get_many("q", max_items=10))
        got += datas(await broker.get_many("q", max_items=10))
        assert sorted(got) == [b"later", b"plain"]


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
    assert (r.confirm_many([2]) if bulk else [2] * r.confirm(2)) == [2]
    r.checkpoint()  # finds nothing delayed any more
    assert (r.confirm_many([3]) if bulk else [3] * r.confirm(3)) == [3]
    return store, r


@pytest.mark.parametrize("bulk", [False, True], ids=["confirm", "confirm_many"])
def test_reader_confirm_of_a_due_item_ahead_of_a_held_one_is_checkpointed(bulk: bool) -> None:
    store, r = _due_before_plain(bulk)
    head, done = r.checkpoint()
    assert replay(store, head, done) == {1}


# -- the bulk paths against the per-item ones -------------------------------------------------


class _Pair:
    """Two readers fed the same items: `bulk` takes as QueueState.take_now does
    (take_held first) and confirms with confirm_many; `single` takes and confirms one at
    a time. Small packing blocks, so packed blocks are met often."""

    def __init__(self, cap: int) -> None:
        self.limits = Limits(max_memory_size=cap)
        self.bulk = SmallPackReader("q", "", self.limits)
        self.single = SmallPackReader("q", "", self.limits)
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
            return r.confirm_many(ids)
        return [i for i in ids if r.confirm(i)]

    def state(self, r: Reader) -> tuple[object, ...]:
        return (r.items, r.bytes, r.mem_bytes, sorted(r.open), r.counters.taken,
                r.counters.expired, r.counters.age_ms, r.counters.total_items, r.tail,
                r.behind, [it.id for it in held(r)], r.delayed_count)

    def check_checkpoint(self, r: Reader) -> None:
        head, done = r.checkpoint()
        assert replay(self.store, head, done) == set(self.store) - self.consumed


_ops = st.lists(st.tuples(
    st.sampled_from(["put", "put", "put", "get", "get", "open", "confirm", "abort", "tick",
                     "checkpoint", "restart"]),
    st.integers(0, 40), st.integers(0, 40), st.integers(0, 7)), max_size=50)


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
                fresh = SmallPackReader("q", "", p.limits, head=head, done=done,
                                        tail=next_id, delays=r.delays.items())
                left = sorted(replay(p.store, head, done))
                fresh.restore([], left[0] if left else None, len(left),
                              sum(len(p.store[i].data) for i in left))
                fresh.restore_delayed(
                    (r.delays.get(i, getattr(p.store[i], "due_ms", 0)), i, len(p.store[i].data))
                    for i in left if type(p.store[i]) is DelayedPut or i in r.delays)
                setattr(p, name, fresh)
        assert p.state(p.bulk) == p.state(p.single), op


# -- open-read timeouts of batches ------------------------------------------------------------


async def test_a_batch_partly_confirmed_times_out_the_rest_once(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    """One timeout-heap entry stands for a get's batch: the reads confirmed (in any
    order) stay confirmed, the rest come back once each, the heap is emptied, and a
    restart delivers exactly the unconfirmed ones."""
    toml = "[queues.q]\nopen_transaction_timeout = 1000\n"
    cfg = make_config(tmp_path, toml)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"%d" % i for i in range(1, 7)])
        c = broker.register(OpenReads())
        got = await broker.get_many("q", max_items=5, client=c, open=True)
        assert datas(got) == [b"1", b"2", b"3", b"4", b"5"]  # type: ignore[arg-type]
        assert broker.statistics().timeouts.entries == 5
        assert broker.confirm(c, "q", ids=[got[3].id, got[0].id]) == 2
        await advance(trio_clock, 1.5)
        s = broker.statistics()
        assert (s.open_reads, s.timeouts.entries, c.open_total) == (0, 0, 0)
        back = await broker.get_many("q", max_items=10)
        assert datas(back) == [b"2", b"3", b"5", b"6"]  # type: ignore[arg-type]
        assert [it.error_count for it in back] == [1, 1, 1, 0]
        await advance(trio_clock, 5)  # nothing is due twice
        assert await broker.get_many("q", max_items=10) == []
    async with open_broker(cfg) as broker:
        assert await broker.get_many("q", max_items=10) == []


async def test_a_get_confirm_loop_keeps_the_timeout_heap_bounded(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    """Batches opened and confirmed at once leave closed reads in the heap; compaction
    keeps them within twice the open reads (never under TIMEOUT_HEAP_MIN), and keeps the
    deadline of a read still open: it times out."""
    toml = "[queues.q]\nopen_transaction_timeout = 60000\n"
    async with open_broker(make_config(tmp_path, toml)) as broker:
        c = broker.register(OpenReads())
        await broker.put("q", [b"stay"])
        (stay,) = await broker.get_many("q", max_items=1, client=c, open=True)
        biggest = 0
        for _ in range(120):  # 120 x 100 reads: three times TIMEOUT_HEAP_MIN
            await broker.put("q", [b"x"] * 100)
            got = await broker.get_many("q", max_items=100, client=c, open=True)
            assert len(got) == 100
            assert broker.confirm(c, "q", ids=[it.id for it in got]) == 100
            biggest = max(biggest, broker.statistics().timeouts.entries)
        s = broker.statistics()
        assert s.timeouts.compactions >= 2 and biggest <= TIMEOUT_HEAP_MIN
        assert c.open_total == 1
        await advance(trio_clock, 61)
        assert c.open_total == 0
        assert datas(await broker.get_many("q", max_items=5)) == [b"stay"]  # type: ignore[arg-type]
        assert stay.data == b"stay"


# -- flush_all yielding between loads ---------------------------------------------------------


async def test_flush_all_racing_a_delete_and_a_put_of_parked_queues(tmp_path: Path) -> None:
    """While flush_all yields between the parked queues it loads, one it has not reached
    is deleted and another gets a put: the deleted queue stays deleted (flush_all does
    not load it back), the others are flushed, and nothing raises."""
    names = [f"f{i}" for i in range(8)]
    async with running(park_cfg(tmp_path)) as server:
        conn = await park_each(server, names)
        broker = server.broker
        flushed: list[int] = []

        async def flush() -> None:
            flushed.append(await broker.flush_all())

        async def put() -> None:
            await broker.put(names[-2], [b"late"])

        async def delete() -> None:
            assert await broker.delete(names[-1])

        async def other(nursery: trio.Nursery) -> None:
            # Each starts at the flush's first yield: before it reaches either queue.
            nursery.start_soon(put)
            nursery.start_soon(delete)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush)
            nursery.start_soon(other, nursery)
        stats = stats_of(server)
        assert names[-1] not in stats and names[-1] not in broker.registry.parked
        assert all(stats[q]["items"] == 0 for q in names[:-2])
        # the late put was flushed or came after the flush reached its queue
        late = stats[names[-2]]["items"]
        assert late in (0, 1) and flushed == [len(names) - 1 + 1 - late]
        await conn.aclose()
