"""Reliable reads across queues (queued.broker.reliable) through a real broker over a real
data directory: the open-read limit per client, open reads timing out back to their
queue (and to a waiter), a batch partly confirmed, the deadline heap kept bounded, and
the broker's counts of open reads and their timers. trio time is a MockClock the tests
jump (broker_util)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio
import trio.testing
from broker_util import (
    advance,
    datas,
    get_all,
    make_config,
    stats,
)

from queued.broker.upkeep import open_broker
from queued.errors import ReadStateError
from queued.reader.open_reads import TIMEOUT_HEAP_MIN, OpenReads


async def test_open_read_limit_per_client(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, max_open_reads=2)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"a", b"b", b"c"])
        c = broker.register(OpenReads())
        await broker.get("q", client=c, open=True)
        await broker.get("q", client=c, open=True)
        with pytest.raises(ReadStateError):
            await broker.get("q", client=c, open=True)
        assert broker.confirm(c, "q", count=1) == 1
        assert datas([await broker.get("q", client=c, open=True)]) == [b"c"]


async def test_open_transaction_timeout_returns_the_item(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    toml = "[queues.q]\nopen_transaction_timeout = 50\n"
    async with open_broker(make_config(tmp_path, toml)) as broker:
        await broker.put("q", [b"a", b"b"])
        c = broker.register(OpenReads())
        assert datas([await broker.get("q", client=c, open=True)]) == [b"a"]
        await advance(trio_clock, 0.03125)
        assert c.open_total == 1, "timed out before its 50 ms"
        await advance(trio_clock, 0.03125)
        assert c.open_total == 0 and stats(broker)["open_transactions"] == 0
        assert broker.confirm(c, "q") == 0
        it = await broker.get("q", client=c, open=True)
        assert it is not None and it.data == b"a" and it.error_count == 1
        assert broker.confirm(c, "q") == 1  # in time: stays confirmed
        await advance(trio_clock, 0.25)
        assert await get_all(broker) == [b"b"]


async def test_open_transaction_timeout_wakes_a_waiter(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    toml = "[queues.q]\nopen_transaction_timeout = 50\n"
    async with open_broker(make_config(tmp_path, toml)) as broker:
        await broker.put("q", [b"a"])
        c = broker.register(OpenReads())
        await broker.get("q", client=c, open=True)
        got: list[bytes | None] = []

        async def poll() -> None:
            got.extend(datas([await broker.get("q", timeout_ms=5000)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await advance(trio_clock, 0.03125)
            assert got == []
            await advance(trio_clock, 0.03125)  # the open read times out: the poll gets it
            assert got == [b"a"]


async def test_broker_statistics_count_open_reads_and_their_timers(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    toml = "[queues.q]\nopen_transaction_timeout = 1000\n"
    async with open_broker(make_config(tmp_path, toml)) as broker:
        await broker.put("q", [b"a", b"b", b"c"])
        c = broker.register(OpenReads())
        for _ in range(2):
            await broker.get("q", client=c, open=True)
        # A named reader takes over the default one, open reads included.
        assert datas([await broker.get("q", "other")]) == [b"c"]
        s = broker.statistics()
        assert (s.queues, s.readers, s.clients, s.open_reads, s.timeouts.entries) == (
            1, 1, 1, 2, 2)
        assert dict(s.counters)["cmd_get"] == 3 and not s.closing
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.queues = 0  # type: ignore[misc]
        broker.confirm(c, "q")
        await advance(trio_clock, 1.0)  # both entries come due; neither read is open
        s = broker.statistics()
        assert (s.open_reads, s.timeouts.entries) == (0, 0)
        assert await broker.get("q", "other") is None  # confirmed, not timed out


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
