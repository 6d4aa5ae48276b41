"""The broker (queued.broker.broker, run by queued.broker.upkeep) over a real data directory: a
hypothesis model test of put / get / open / confirm / abort / disconnect / flush /
checkpoint / restart, and targeted tests of long polls, read-behind, fanout readers,
error and expiry queues, limits, open-read timeouts, queue ageing, delete and flush.

Time is the test's: the wall clock (item add and expiry times) is a FakeClock where
expiry matters, and trio time (long polls, open-read timeouts, the upkeep timers)
is a MockClock that only moves when a test jumps it. Not autojump_threshold=0: trio
counts a task waiting for a worker thread (the journal's writes) as blocked, so an
autojump clock would run ahead while a put is being written and time out the long
poll that put was meant to answer.
"""

from __future__ import annotations

import gc
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from broker_util import (
    T0,
    FakeClock,
    advance,
    datas,
    frozen_clock,
    get_all,
    make_config,
    stats,
    with_default,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queued
import queued.storage.journal as journal_module
from queued.broker.broker import Broker
from queued.broker.upkeep import open_broker
from queued.errors import ItemTooLargeError, QueueFullError
from queued.journal import format as jf
from queued.reader.open_reads import OpenReads
from queued.reader.shared import NO_ENTRIES, NO_IDS

# -- a model test over random operation sequences ---------------------------------------------

N_CLIENTS = 2
client_ix = st.integers(0, N_CLIENTS - 1)
reader_ix = st.integers(0, 1)  # with one reader (the default), both mean that one
count = st.none() | st.integers(1, 2)
NO_READER = ("put", "disconnect", "checkpoint", "restart")

op = st.one_of(
    st.tuples(st.just("put"), st.lists(st.integers(1, 120), min_size=1, max_size=4)),
    st.tuples(st.just("get"), reader_ix),
    st.tuples(st.just("wait_get"), reader_ix),
    st.tuples(st.just("peek"), reader_ix),
    st.tuples(st.just("open"), reader_ix, client_ix),
    st.tuples(st.just("confirm"), reader_ix, client_ix, count),
    st.tuples(st.just("abort"), reader_ix, client_ix, count),
    st.tuples(st.just("disconnect"), client_ix),
    st.tuples(st.just("flush"), reader_ix),
    st.tuples(st.just("checkpoint"),),
    st.tuples(st.just("restart"),),
)


class Model:
    """What one reader of queue q must hold: FIFO with aborted items first."""

    def __init__(self, order: dict[bytes, int]) -> None:
        self.order = order  # payload -> put sequence number (shared)
        self.front: list[bytes] = []  # aborted, delivered first (newest abort first)
        self.rest: list[bytes] = []  # in put order
        self.open: list[list[bytes]] = [[] for _ in range(N_CLIENTS)]  # in open order
        self.errors: dict[bytes, int] = {}
        self.gone: set[bytes] = set()  # consumed for good

    def available(self) -> list[bytes]:
        return self.front + self.rest

    def pop(self) -> bytes | None:
        if self.front:
            return self.front.pop(0)
        if self.rest:
            return self.rest.pop(0)
        return None

    def put_back(self, payloads: list[bytes]) -> None:
        self.front = sorted(payloads, key=self.order.__getitem__) + self.front

    def restart(self) -> None:
        everything = self.front + self.rest + [p for o in self.open for p in o]
        self.rest = sorted(everything, key=self.order.__getitem__)
        self.front = []
        self.open = [[] for _ in range(N_CLIENTS)]
        # Error counts survive: aborts are journaled in the reader's file.


async def run_model(
    tmp: Path, ops: list[tuple[Any, ...]], cap: int, journal_size: int, fanout: bool
) -> None:
    """Interpret `ops` against a broker on queue q and check it against Model.

    With `fanout`, q has readers a and b (a took over the default reader before any
    put); otherwise only the default reader. Restarts are clean (aclose)."""
    cfg = with_default(make_config(tmp), max_memory_size=cap, journal_size=journal_size)
    names: list[str | None] = ["a", "b"] if fanout else [None]
    order: dict[bytes, int] = {}
    ids: dict[bytes, int] = {}  # payload -> id seen on delivery
    models = [Model(order) for _ in names]
    seq = 0

    def check(m: Model, it: jf.Put | None, want: bytes | None) -> None:
        assert datas([it]) == [want], m.available()
        if it is None or want is None:
            return
        assert it.data not in m.gone, "a consumed item came back"
        assert it.error_count == m.errors[want]
        assert ids.setdefault(want, it.id) == it.id
        seen = sorted(ids.items(), key=lambda kv: order[kv[0]])
        assert [i for _, i in seen] == sorted(i for _, i in seen), "ids not in put order"

    def new_payloads(sizes: list[int]) -> list[bytes]:
        nonlocal seq
        out = []
        for size in sizes:
            p = b"%06d:" % seq + b"x" * size
            order[p] = seq
            for m in models:
                m.errors[p] = 0
            seq += 1
            out.append(p)
        return out

    first = True
    restart = True
    while restart:
        restart = False
        async with open_broker(cfg) as broker:
            if first and fanout:
                assert await broker.get("q", "a") is None  # takes over the default reader
                assert await broker.get("q", "b") is None
            first = False
            clients = [broker.register(OpenReads()) for _ in range(N_CLIENTS)]
            while ops:
                name, *args = ops.pop(0)
                ri = args[0] % len(names) if name not in NO_READER else 0
                m, rname = models[ri], names[ri]
                if name == "put":
                    payloads = new_payloads(args[0])
                    assert await broker.put("q", payloads) == len(payloads)
                    for mm in models:
                        mm.rest.extend(payloads)
                elif name == "get":
                    want = m.pop()
                    check(m, await broker.get("q", rname), want)
                    if want is not None:
                        m.gone.add(want)
                elif name == "wait_get":
                    # A long poll; when the reader is empty an item arrives while it waits.
                    got: list[jf.Put | None] = []

                    async def waiter(
                        rname: str | None = rname, got: list[jf.Put | None] = got
                    ) -> None:
                        got.append(await broker.get("q", rname, timeout_ms=10_000))

                    want = m.pop()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(waiter)
                        if want is None:
                            await trio.testing.wait_all_tasks_blocked()
                            [want] = new_payloads([7])
                            await broker.put("q", [want])
                            for mm in models:
                                if mm is not m:
                                    mm.rest.append(want)
                    check(m, got[0], want)
                    m.gone.add(want)
                elif name == "peek":
                    avail = m.available()
                    check(m, await broker.get("q", rname, peek=True), avail[0] if avail else None)
                elif name == "open":
                    k = args[1]
                    want = m.pop()
                    check(m, await broker.get("q", rname, client=clients[k], open=True), want)
                    if want is not None:
                        m.open[k].append(want)
                elif name in ("confirm", "abort"):
                    k, cnt = args[1], args[2]
                    n = len(m.open[k]) if cnt is None else min(cnt, len(m.open[k]))
                    done = m.open[k][:n]
                    del m.open[k][:n]
                    if name == "confirm":
                        assert broker.confirm(clients[k], "q", rname, count=cnt) == n
                        m.gone.update(done)
                    else:
                        assert broker.abort(clients[k], "q", rname, count=cnt) == n
                        for p in done:
                            m.errors[p] += 1
                        m.put_back(done)
                elif name == "disconnect":
                    k = args[0]
                    broker.release(clients[k])
                    clients[k] = broker.register(OpenReads())
                    for mm in models:
                        for p in mm.open[k]:
                            mm.errors[p] += 1
                        mm.put_back(mm.open[k])
                        mm.open[k] = []
                elif name == "flush":
                    assert broker.flush("q", rname) == len(m.available())
                    m.gone.update(m.available())
                    m.front, m.rest = [], []
                elif name == "checkpoint":
                    await broker.checkpoint_all()
                elif name == "restart":
                    for mm in models:
                        mm.restart()
                    restart = True
                    break
                if "q" in broker.queues:
                    for mm, rn in zip(models, names, strict=True):
                        s = stats(broker, f"q+{rn}" if rn else "q")
                        assert s["items"] == len(mm.available())
                        assert s["open_transactions"] == sum(map(len, mm.open))
                        assert s["bytes"] == sum(map(len, mm.available()))
            if not restart:
                # Drain: everything outstanding comes out, in order, exactly once.
                for k, c in enumerate(clients):
                    broker.release(c, count_error=False)
                    for mm in models:
                        mm.put_back(mm.open[k])
                        mm.open[k] = []
                for mm, rn in zip(models, names, strict=True):
                    got_all = await get_all(broker, "q", rn)
                    assert got_all == mm.available()
                    mm.gone.update(got_all)
    # Nothing consumed comes back after a last restart either.
    async with open_broker(cfg) as broker:
        for rn in names:
            assert await get_all(broker, "q", rn) == []


model_settings = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
model_args = {
    "ops": st.lists(op, max_size=40),
    "cap": st.sampled_from([200, 1 << 20]),
    "journal_size": st.sampled_from([400, 1 << 20]),
}


@model_settings
@given(**model_args)
def test_broker_matches_model(ops: list[tuple[Any, ...]], cap: int, journal_size: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        trio.run(run_model, Path(d), list(ops), cap, journal_size, False, clock=frozen_clock())


@model_settings
@given(**model_args)
def test_fanout_broker_matches_model(
    ops: list[tuple[Any, ...]], cap: int, journal_size: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        trio.run(run_model, Path(d), list(ops), cap, journal_size, True, clock=frozen_clock())


# -- long polls ------------------------------------------------------------------------------


async def test_long_poll_waiters_are_served_fifo(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        got: dict[int, bytes | None] = {}

        async def waiter(i: int) -> None:
            it = await broker.get("q", timeout_ms=5000)
            got[i] = None if it is None else it.data

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(waiter, i)
                await trio.testing.wait_all_tasks_blocked()
            assert stats(broker)["waiters"] == 4
            await broker.put("q", [b"a"])
            await broker.put("q", [b"b", b"c"])
            await trio.testing.wait_all_tasks_blocked()
            assert got == {0: b"a", 1: b"b", 2: b"c"}
            await broker.put("q", [b"d"])
        assert got[3] == b"d"
        assert stats(broker)["waiters"] == 0 and stats(broker)["items"] == 0


async def test_long_poll_times_out_with_none(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        got: list[object] = []

        async def poll() -> None:
            got.append(await broker.get("q", timeout_ms=500))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await advance(trio_clock, 0.25)
            assert got == [] and stats(broker)["waiters"] == 1  # not before its timeout
            await advance(trio_clock, 0.25)
            assert got == [None]  # at it
        assert stats(broker)["waiters"] == 0
        await broker.put("q", [b"a"])
        assert datas([await broker.get("q")]) == [b"a"]


async def test_peek_waiter_sees_item_and_leaves_it(tmp_path: Path) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        got: list[bytes | None] = []

        async def peeker() -> None:
            got.extend(datas([await broker.get("q", timeout_ms=5000, peek=True)]))

        async def taker() -> None:
            got.extend(datas([await broker.get("q", timeout_ms=5000)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(peeker)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(taker)
            await trio.testing.wait_all_tasks_blocked()
            await broker.put("q", [b"a"])
        assert got == [b"a", b"a"]
        assert await broker.get("q") is None


async def test_waiter_cancelled_after_handover_does_not_lose_the_item(tmp_path: Path) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.put("q", [b"a", b"b"])
        holder = broker.register(OpenReads())
        assert datas([await broker.get("q", client=holder, open=True)]) == [b"a"]
        assert datas([await broker.get("q", client=holder, open=True)]) == [b"b"]
        outcome: list[object] = []
        scope = trio.CancelScope()

        async def waiter() -> None:
            with scope:
                outcome.append(await broker.get("q", timeout_ms=10_000))
            outcome.append("cancelled" if scope.cancelled_caught else "done")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            # Cancel the waiter, then (before it runs again) hand it items: the
            # abort below serves waiters synchronously.
            scope.cancel()
            assert broker.abort(holder, "q") == 2
            s = stats(broker)  # "a" was handed to the (cancelled) waiter
            assert s["items"] == 1 and s["open_transactions"] == 1 and s["waiters"] == 0
        assert outcome == ["cancelled"]
        s = stats(broker)
        assert s["items"] == 2 and s["open_transactions"] == 0 and s["waiters"] == 0
        got = [await broker.get("q"), await broker.get("q")]
        assert datas(got) == [b"a", b"b"]
        assert [it.error_count for it in got if it] == [1, 1]


async def test_waiter_whose_timeout_races_a_handover_gets_the_item(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.put("q", [b"a"])
        holder = broker.register(OpenReads())
        await broker.get("q", client=holder, open=True)
        got: list[bytes | None] = []

        async def waiter() -> None:
            with trio.move_on_after(0.05):
                got.extend(datas([await broker.get("q", timeout_ms=10_000)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await advance(trio_clock, 0.0625)  # the move_on_after fires and cancels the wait...
        assert got == []
        # ...and a later handover finds no stale waiter.
        broker.abort(holder, "q")
        assert datas([await broker.get("q")]) == [b"a"]


# -- read-behind ------------------------------------------------------------------------------


# -- fanout readers -----------------------------------------------------------------------------


async def test_fanout_first_reader_takes_over_second_starts_at_tail(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    data = tmp_path / "data"
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2", b"3"])
        assert datas([await broker.get("q", "a")]) == [b"1"]
        assert await broker.get("q", "b") is None
        await broker.put("q", [b"4", b"5"])
        assert await get_all(broker, "q", "a") == [b"2", b"3", b"4", b"5"]
        assert await get_all(broker, "q", "b") == [b"4", b"5"]
        await broker.checkpoint_all(force=True)
        files = sorted(p.name for p in data.iterdir() if ".read." in p.name)
        assert files == ["q.read.a", "q.read.b"]
        # A plain `q` after the takeover is a new default reader at the tail.
        assert await broker.get("q") is None
        await broker.put("q", [b"6"])
        assert [await get_all(broker, "q", r) for r in (None, "a", "b")] == [[b"6"]] * 3
    files = sorted(p.name for p in data.iterdir() if ".read." in p.name)
    assert files == ["q.read.", "q.read.a", "q.read.b"]
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"7"])
        assert [await get_all(broker, "q", r) for r in (None, "a", "b")] == [[b"7"]] * 3


async def test_fanout_readers_keep_their_own_position_across_restart(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.get("q", "a")
        await broker.get("q", "b")
        await broker.put("q", [b"1", b"2", b"3"])
        assert await get_all(broker, "q", "a") == [b"1", b"2", b"3"]
        assert datas([await broker.get("q", "b")]) == [b"1"]
        c = broker.register(OpenReads())
        assert datas([await broker.get("q", "b", client=c, open=True)]) == [b"2"]
    async with open_broker(cfg) as broker:
        assert await broker.get("q", "a") is None
        assert await get_all(broker, "q", "b") == [b"2", b"3"]


async def test_open_reads_taken_as_q_are_closed_as_q_after_takeover(tmp_path: Path) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.put("q", [b"1", b"2", b"3"])
        c = broker.register(OpenReads())
        assert datas([await broker.get("q", client=c, open=True)]) == [b"1"]
        assert datas([await broker.get("q", client=c, open=True)]) == [b"2"]
        assert datas([await broker.get("q", "a")]) == [b"3"]  # takeover
        assert broker.abort(c, "q", count=1) == 1
        assert broker.confirm(c, "q") == 1
        assert datas([await broker.get("q", "a")]) == [b"1"]
        assert await broker.get("q", "a") is None
        assert await broker.get("q") is None  # a new default reader, at the tail


async def test_open_read_timeout_survives_takeover(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    cfg = make_config(tmp_path, toml="[default]\nopen_transaction_timeout = 50\n")
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2"])
        c = broker.register(OpenReads())
        assert datas([await broker.get("q", client=c, open=True)]) == [b"1"]
        assert datas([await broker.get("q", "a")]) == [b"2"]  # takeover
        assert c.open_total == 1
        await advance(trio_clock, 0.0625)  # past the 50 ms
        assert c.open_total == 0, "the open read never timed out"
        assert datas([await broker.get("q", "a")]) == [b"1"]


async def test_delete_reader_wakes_its_waiters(tmp_path: Path) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.get("q", "a")
        await broker.get("q", "b")
        got: list[object] = []

        async def waiter() -> None:
            got.append(await broker.get("q", "b", timeout_ms=10_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert await broker.delete("q", "b")
        assert got == [None]
        assert not (tmp_path / "data" / "q.read.b").exists()
        await broker.put("q", [b"x"])
        assert await get_all(broker, "q", "a") == [b"x"]


# -- error queue, expiry queue, timeouts ------------------------------------------------------


async def test_error_queue_after_max_errors(tmp_path: Path) -> None:
    toml = '[queues.q]\nerror_queue = "errors"\nmax_errors = 2\n'
    async with open_broker(make_config(tmp_path, toml)) as broker:
        await broker.put("q", [b"bad", b"good"])
        c = broker.register(OpenReads())
        it = await broker.get("q", client=c, open=True)
        assert it is not None and it.data == b"bad"
        broker.abort(c, "q")
        it = await broker.get("q", client=c, open=True)
        assert it is not None and it.data == b"bad" and it.error_count == 1
        broker.release(c)  # a disconnect counts as an error too
        moved = await broker.get("errors", timeout_ms=2000)
        assert moved is not None and moved.data == b"bad" and moved.error_count == 2
        assert await get_all(broker) == [b"good"]
        await broker.checkpoint_all()
    async with open_broker(make_config(tmp_path, toml)) as broker:
        assert await get_all(broker) == []
        assert await get_all(broker, "errors") == []


async def test_abort_without_error_count_never_moves(tmp_path: Path) -> None:
    toml = '[queues.q]\nerror_queue = "errors"\nmax_errors = 1\n'
    async with open_broker(make_config(tmp_path, toml)) as broker:
        await broker.put("q", [b"a"])
        c = broker.register(OpenReads())
        for _ in range(3):
            await broker.get("q", client=c, open=True)
            broker.abort(c, "q", count_error=False)
        await trio.testing.wait_all_tasks_blocked()
        assert await broker.get("errors") is None
        assert await get_all(broker) == [b"a"]


async def test_expire_to_queue_on_sweep(tmp_path: Path) -> None:
    clock = FakeClock()
    toml = '[queues.q]\nexpire_to_queue = "dead"\n'
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        await broker.put("q", [b"old1", b"old2"], expire_ms=T0 + 100)
        await broker.put("q", [b"new"], expire_ms=T0 + 10_000)
        await broker.put("q", [b"forever"])
        await broker.sweep()
        assert stats(broker)["items"] == 4
        clock.now = T0 + 100
        await broker.sweep()
        moved = [await broker.get("dead", timeout_ms=2000) for _ in range(2)]
        assert datas(moved) == [b"old1", b"old2"]
        assert all(m is not None and m.expire_time_ms is None for m in moved)
        s = stats(broker)
        assert s["items"] == 2 and s["expired_items"] == 2
        await broker.checkpoint_all()
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        assert await get_all(broker) == [b"new", b"forever"]
        assert await get_all(broker, "dead") == []


async def test_max_expire_sweep_limits_one_sweep(tmp_path: Path) -> None:
    clock = FakeClock()
    toml = "[queues.q]\nmax_expire_sweep = 2\n"
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        await broker.put("q", [b"%d" % i for i in range(5)], expire_ms=T0 + 1)
        clock.now += 10
        await broker.sweep()
        assert stats(broker)["items"] == 3
        await broker.sweep()
        assert stats(broker)["items"] == 1
        assert broker.flush_expired("q") == 1
        assert stats(broker)["items"] == 0


async def test_get_skips_expired_items(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_broker(make_config(tmp_path), clock=clock) as broker:
        await broker.put("q", [b"a"], expire_ms=T0 + 5)
        await broker.put("q", [b"b"])
        clock.now += 5
        assert datas([await broker.get("q", peek=True)]) == [b"b"]
        assert datas([await broker.get("q")]) == [b"b"]
        assert stats(broker)["expired_items"] == 1


async def test_max_age_caps_expiry(tmp_path: Path) -> None:
    clock = FakeClock()
    toml = "[queues.q]\nmax_age = 1000\n"
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        await broker.put("q", [b"a"])
        await broker.put("q", [b"b"], expire_ms=T0 + 500)
        await broker.put("q", [b"c"], expire_ms=T0 + 5000)
        it = await broker.get("q", peek=True)
        assert it is not None and it.expire_time_ms == T0 + 1000
        clock.now += 1000
        assert await broker.get("q") is None


# -- limits ----------------------------------------------------------------------------------


async def test_max_items_refuses_when_full(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_items=3)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2", b"3"])
        with pytest.raises(QueueFullError):
            await broker.put("q", [b"4"])
        with pytest.raises(QueueFullError):
            await broker.put("other", [b"1", b"2", b"3", b"4"])
        c = broker.register(OpenReads())
        await broker.get("q", client=c, open=True)  # open reads do not count
        await broker.put("q", [b"4"])
        broker.abort(c, "q")
        assert stats(broker)["items"] == 4
        assert await get_all(broker) == [b"1", b"2", b"3", b"4"]


async def test_max_size_refuses_when_full(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_size=10)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"12345", b"67890"])
        with pytest.raises(QueueFullError):
            await broker.put("q", [b"x"])
        assert await get_all(broker) == [b"12345", b"67890"]


async def test_discard_old_when_full(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_items=3, discard_old_when_full=True)
    async with open_broker(cfg) as broker:
        for i in range(1, 6):
            await broker.put("q", [b"%d" % i])
        s = stats(broker)
        assert s["items"] == 3 and s["discarded"] == 2
        await broker.put("q", [b"6", b"7"])
        await broker.checkpoint_all()
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == [b"5", b"6", b"7"]


async def test_discard_old_when_full_with_read_behind(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_items=20, discard_old_when_full=True,
                       max_memory_size=300)
    payloads = [b"%03d" % i + b"." * 97 for i in range(50)]
    async with open_broker(cfg) as broker:
        for p in payloads:
            await broker.put("q", [p])
        assert stats(broker)["items"] == 20
        assert await get_all(broker) == payloads[30:]


# -- queue lifetime: max_queue_age, delete, flush -----------------------------------------------


async def test_max_queue_age_deletes_an_empty_old_queue(tmp_path: Path) -> None:
    clock = FakeClock()
    toml = "[default]\nmax_queue_age = 1000\n"
    data = tmp_path / "data"
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        await broker.put("empty", [b"x"])
        await broker.put("full", [b"x"])
        assert await broker.get("empty") is not None
        await broker.sweep()
        assert set(broker.queues) == {"empty", "full"}
        clock.now += 1001
        await broker.sweep()
        assert set(broker.queues) == {"full"}
        assert not any(p.name.startswith("empty.") for p in data.iterdir())
        assert broker.counters.queue_expires == 1
        assert datas([await broker.get("full")]) == [b"x"]
        clock.now += 1001
        await broker.sweep()
        assert broker.queues == {}


async def test_max_queue_age_spares_a_queue_with_open_reads(tmp_path: Path) -> None:
    clock = FakeClock()
    toml = "[default]\nmax_queue_age = 1000\n"
    async with open_broker(make_config(tmp_path, toml), clock=clock) as broker:
        await broker.put("q", [b"x"])
        c = broker.register(OpenReads())
        await broker.get("q", client=c, open=True)
        clock.now += 5000
        await broker.sweep()
        assert "q" in broker.queues
        broker.abort(c, "q")
        assert datas([await broker.get("q")]) == [b"x"]


async def test_delete_queue_wakes_waiters_with_none(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.put("q", [b"a"])
        assert await broker.get("q") is not None
        got: list[object] = []

        async def waiter(peek: bool) -> None:
            got.append(await broker.get("q", timeout_ms=10_000, peek=peek))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, False)
            nursery.start_soon(waiter, True)
            await trio.testing.wait_all_tasks_blocked()
            assert await broker.delete("q")
        assert got == [None, None]
        assert not any(p.name.startswith("q.") for p in data.iterdir())
        assert not await broker.delete("q")
        await broker.put("q", [b"new"])
        assert await get_all(broker) == [b"new"]
    async with open_broker(make_config(tmp_path)) as broker:
        assert await get_all(broker) == []


async def test_deleted_queue_stays_deleted_after_restart(tmp_path: Path) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        await broker.put("q", [b"a", b"b"])
        await broker.put("keep", [b"k"])
        assert await broker.delete("q")
    async with open_broker(make_config(tmp_path)) as broker:
        assert "q" not in broker.queues
        assert await get_all(broker) == []
        assert await get_all(broker, "keep") == [b"k"]


async def test_stale_open_read_of_a_deleted_queue_does_not_touch_the_new_queue(
    tmp_path: Path,
) -> None:
    async with open_broker(make_config(tmp_path)) as broker:
        old, new = broker.register(OpenReads()), broker.register(OpenReads())
        await broker.put("q", [b"old"])
        await broker.get("q", client=old, open=True)
        await broker.delete("q")
        await broker.put("q", [b"new"])
        it = await broker.get("q", client=new, open=True)
        assert it is not None and it.data == b"new"
        broker.confirm(old, "q")  # the deleted queue's read
        broker.abort(new, "q")  # "new" must go back to the queue
        assert await get_all(broker) == [b"new"]


async def test_flush_with_open_read_then_restart(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2", b"3", b"4"])
        c = broker.register(OpenReads())
        assert datas([await broker.get("q", client=c, open=True)]) == [b"1"]
        assert broker.flush("q") == 3
        assert await broker.get("q") is None
        await broker.put("q", [b"5"])
    async with open_broker(cfg) as broker:
        # The open read came back; the flushed items did not.
        assert await get_all(broker) == [b"1", b"5"]
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == []


async def test_flush_with_open_read_and_checkpoint_then_crash_like_restart(
    tmp_path: Path,
) -> None:
    # The client is never registered, so aclose does not return its read: the restart
    # only has the checkpoint written while the read was open.
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2", b"3"])
        c = OpenReads()
        await broker.get("q", client=c, open=True)
        broker.flush("q")
        await broker.checkpoint_all()
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == [b"1"]


async def test_flush_with_read_behind_then_restart(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_memory_size=500)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"%03d" % i + b"." * 97 for i in range(30)])
        c = broker.register(OpenReads())
        await broker.get("q", client=c, open=True)
        assert broker.flush("q") == 29
        await broker.put("q", [b"after"])
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == [b"000" + b"." * 97, b"after"]


async def test_confirmed_out_of_order_reads_stay_confirmed_after_restart(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"%d" % i for i in range(1, 7)])
        a, b = broker.register(OpenReads()), broker.register(OpenReads())
        await broker.get("q", client=a, open=True)  # 1
        await broker.get("q", client=b, open=True)  # 2
        await broker.get("q", client=a, open=True)  # 3
        await broker.get("q", client=b, open=True)  # 4
        assert broker.confirm(b, "q") == 2
        await broker.checkpoint_all()
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == [b"1", b"3", b"5", b"6"]


async def test_checkpoint_files_after_checkpoint_all(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, fsync="always")
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"a", b"b"])
        await broker.get("q")
        assert await broker.checkpoint_all() == 1
        assert await broker.checkpoint_all() == 0  # nothing new consumed
    cp = (tmp_path / "data" / "q.read.").read_bytes()
    assert cp[:4] == bytes([0x26, 0x3C, 0x26, 0x03])


async def test_deleting_the_last_reader_does_not_resurrect_consumed_items(
    tmp_path: Path,
) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"1", b"2", b"3"])
        assert await get_all(broker, "q", "a") == [b"1", b"2", b"3"]
        assert await broker.delete("q", "a")
        await broker.checkpoint_all(force=True)
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == []


# -- background work must not take the broker down ----------------------------------------------


# -- max_journal_size with drop_oldest ----------------------------------------------------------

DROP_OLDEST = """
[queues.q]
journal_size = 1000
max_journal_size = 3000
journal_full_policy = "drop_oldest"
max_memory_size = {cap}
"""


def p100(i: int) -> bytes:
    return b"%03d" % i + b"." * 97


@pytest.mark.parametrize("cap", [1 << 20, 150])
async def test_drop_oldest_keeps_the_newest_in_order(tmp_path: Path, cap: int) -> None:
    cfg = make_config(tmp_path, DROP_OLDEST.format(cap=cap))
    async with open_broker(cfg) as broker:
        for i in range(100):
            await broker.put("q", [p100(i)])
        s = stats(broker)
        assert 0 < s["items"] < 30 and s["discarded"] == 100 - s["items"]
        got = await get_all(broker)
        assert got == [p100(i) for i in range(100 - len(got), 100)]
        assert stats(broker)["items"] == 0


async def test_drop_oldest_with_read_behind_keeps_bytes_right(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, DROP_OLDEST.format(cap=350) + "max_size = 5000\n")
    async with open_broker(cfg) as broker:
        for i in range(200):
            await broker.put("q", [p100(i)])
        s = stats(broker)
        assert s["bytes"] == 100 * s["items"]


async def test_drop_oldest_after_out_of_order_confirms_keeps_items_right(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, DROP_OLDEST.format(cap=150))
    async with open_broker(cfg) as broker:
        await broker.put("q", [p100(i) for i in range(1, 15)])
        c1, c2 = broker.register(OpenReads()), broker.register(OpenReads())
        for c in (c1, c1, c2, c2):  # ids 1, 2 to c1; 3, 4 to c2
            await broker.get("q", client=c, open=True)
        broker.confirm(c2, "q")  # done = {3, 4}
    async with open_broker(cfg) as broker:
        for i in range(15, 30):
            await broker.put("q", [p100(i)])
        await get_all(broker)
        s = stats(broker)
        assert (s["items"], s["bytes"]) == (0, 0)


@pytest.mark.parametrize(("cap", "discard"), [(1 << 20, False), (150, False), (150, True)])
async def test_puts_cancelled_while_making_room_leave_memory_and_files_agreeing(
    tmp_path: Path, cap: int, discard: bool,
) -> None:
    """Each put is cancelled once it blocks (making room: a drop of the oldest segment,
    or a discard that reads items back from disk first): what a put does there is
    shielded, so the readers and the files still agree, and a restart brings back
    exactly the items the queue held, in order."""
    toml = DROP_OLDEST.format(cap=cap)
    if discard:
        toml += "max_items = 12\ndiscard_old_when_full = true\n"
    cfg = make_config(tmp_path, toml)
    blocked = 0
    async with open_broker(cfg) as broker:
        for i in range(100):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(broker.put, "q", [p100(i)])
                await trio.testing.wait_all_tasks_blocked()
                blocked += bool(nursery.child_tasks)
                nursery.cancel_scope.cancel()
        held = stats(broker)
        assert held["bytes"] == 100 * held["items"] > 0
    assert blocked > 0  # (else nothing was cancelled mid-put)
    async with open_broker(cfg) as broker:
        got = await get_all(broker)
    assert len(got) == held["items"]
    assert got == [p100(i) for i in range(100 - len(got), 100)]

# -- background loops and restarts --------------------------------------------------------------


async def test_clean_restart_returns_open_reads_and_forgets_confirmed(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"%d" % i for i in range(1, 7)])
        c = broker.register(OpenReads())
        await broker.get("q")  # 1, consumed
        for _ in range(3):
            await broker.get("q", client=c, open=True)  # 2 3 4
        broker.confirm(c, "q", count=1)  # 2
        broker.abort(c, "q", count=1)  # 3 goes back
        assert datas([await broker.get("q", client=c, open=True)]) == [b"3"]
        # No checkpoint_all: the clean close writes it.
    async with open_broker(cfg) as broker:
        assert await get_all(broker) == [b"3", b"4", b"5", b"6"]


async def test_max_item_size(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, "[queues.q]\nmax_item_size = 4\n")
    async with open_broker(cfg) as broker:
        with pytest.raises(ItemTooLargeError):
            await broker.put("q", [b"ok", b"toolong"])
        await broker.put("q", [b"four"])
        assert await get_all(broker) == [b"four"]


# -- statistics and the upkeep itself ---------------------------------------------------------


# -- what an idle queue costs ------------------------------------------------------------------


#: what `heap_per_queue` counts: blocks allocated with queued's code or this file's on the
#: stack. Not the process's whole heap: in `make test`'s worker processes ~4.7 MB more
#: showed up during the measure now and then (another thread of the process, presumably
#: py4j's once a Spark test ran in the same worker); this count gives the same figures
#: as the whole heap when run alone (1.8 KiB an empty queue, 4.1 KiB a taken one).
OURS = [tracemalloc.Filter(True, str(Path(queued.__file__).parent / "*"), all_frames=True),
        tracemalloc.Filter(True, __file__, all_frames=True)]


def traced_bytes() -> int:
    return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(OURS).traces)


async def heap_per_queue(broker: Broker, prefix: str, n: int, *, put: bool) -> float:
    """Python heap bytes each of `n` new queues holds once idle (tracemalloc): made by a
    get that finds nothing, or (`put`) by a put whose item a get then takes."""
    gc.collect()
    tracemalloc.start(8)
    try:
        before = traced_bytes()
        for i in range(n):
            name = f"{prefix}{i}"
            if put:
                await broker.put(name, [b"x" * 16])
            await broker.get(name)
        await broker.checkpoint_all()
        gc.collect()
        return (traced_bytes() - before) / n
    finally:
        tracemalloc.stop()


async def test_an_idle_queue_holds_little_memory(tmp_path: Path) -> None:
    """Hostile input may make max_queues (10,000) queues: each idle one must stay small.
    Containers, locks and files a queue may never use are made on first use, shared
    while empty, or dropped once idle (3.5 KiB for an empty queue before; 1.7 KiB now)."""
    # (park_after 0: no queue is parked while the traced run takes its time.) Each figure
    # is the smaller of two batches measured apart: a one-time allocation of a few MB
    # (seen now and then in make test's workers, once in a fresh clone) lands in one
    # batch at most, while a cost per queue shows in both.
    async with open_broker(make_config(tmp_path, park_after=0)) as broker:
        await heap_per_queue(broker, "warm", 20, put=True)  # first-use caches, code paths
        empty = min([await heap_per_queue(broker, f"e{batch}-", 150, put=False)
                     for batch in range(2)])
        taken = min([await heap_per_queue(broker, f"t{batch}-", 100, put=True)
                     for batch in range(2)])
        assert len(broker.queues) == 520
    assert empty < 2200, f"an empty queue holds {empty:.0f} B"
    assert taken < 4600, f"a queue whose item was taken holds {taken:.0f} B"


def test_the_shared_empty_containers_refuse_writes() -> None:
    """A reader or journal that forgot to make its own container fails at once instead
    of writing into the one every idle queue shares."""
    with pytest.raises(TypeError):
        NO_ENTRIES[1] = 2
    with pytest.raises(TypeError):
        NO_ENTRIES.setdefault(1, 2)
    with pytest.raises(TypeError):
        NO_IDS.add(1)
    with pytest.raises(TypeError):
        NO_IDS.update({1})
    with pytest.raises(TypeError):
        journal_module.NO_ENTRIES[1] = 2
    assert NO_ENTRIES.pop(1, None) is None and not NO_ENTRIES and not NO_IDS


# -- batched gets and confirms -----------------------------------------------------------------


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
