"""Reading a queue's items back from its journal (queued.broker.readback, read-behind)
through a real broker over a real data directory: order and the memory cap kept across a
restart, a waiter served from disk, open reads and aborts while behind, a due delayed
item whose data is on disk."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from broker_util import (
    FakeClock,
    datas,
    get_all,
    make_config,
    stats,
    with_default,
)

from queued.broker.readback import LOAD_SLICE
from queued.broker.upkeep import open_broker
from queued.config import ServerConfig
from queued.reader.open_reads import OpenReads


async def test_read_behind_keeps_order_and_memory_cap_across_restart(tmp_path: Path) -> None:
    cap = 4096
    cfg = with_default(make_config(tmp_path), max_memory_size=cap, journal_size=64 * 1024)
    payloads = [b"%05d" % i + b"." * 95 for i in range(2000)]
    async with open_broker(cfg) as broker:
        for i in range(0, 2000, 100):
            await broker.put("q", payloads[i : i + 100])
            assert stats(broker)["mem_bytes"] <= cap
        s = stats(broker)
        assert s["items"] == 2000 and s["bytes"] == 200_000
        got = []
        for _ in range(700):
            it = await broker.get("q")
            assert it is not None
            got.append(it.data)
            assert stats(broker)["mem_bytes"] <= cap
        assert got == payloads[:700]
    async with open_broker(cfg) as broker:
        s = stats(broker)
        assert s["items"] == 1300 and s["mem_bytes"] <= cap
        while (it := await broker.get("q")) is not None:
            got.append(it.data)
            assert stats(broker)["mem_bytes"] <= cap
    assert got == payloads


async def test_read_behind_serves_a_waiter(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_memory_size=1024)
    payloads = [b"%04d" % i + b"-" * 96 for i in range(50)]
    async with open_broker(cfg) as broker:
        await broker.put("q", payloads)
        got = []
        for _ in payloads:
            it = await broker.get("q", timeout_ms=1000)
            assert it is not None
            got.append(it.data)
        assert got == payloads


async def test_read_behind_with_open_reads_and_aborts(tmp_path: Path) -> None:
    cfg = with_default(make_config(tmp_path), max_memory_size=500)
    payloads = [b"%04d" % i + b"-" * 96 for i in range(40)]
    async with open_broker(cfg) as broker:
        await broker.put("q", payloads)
        c = broker.register(OpenReads())
        opened = [await broker.get("q", client=c, open=True) for _ in range(10)]
        assert datas(opened) == payloads[:10]  # type: ignore[arg-type]
        broker.abort(c, "q")
        assert await get_all(broker) == payloads


async def test_a_get_reads_back_a_due_item_whose_data_is_on_disk(tmp_path: Path) -> None:
    """After a restart a delayed item's data stays in its segment; once due, a get
    (plain, reliable or peek) reads it back then and there, as a batch get does,
    rather than miss until the background fetch has run."""
    clock = FakeClock()
    cfg = make_config(tmp_path)
    async with open_broker(cfg, clock=clock) as broker:
        await broker.put("q", [b"later"], delay_ms=1000)
        await broker.put("r", [b"later"], delay_ms=1000)
    clock.now += 2000
    async with open_broker(cfg, clock=clock) as broker:
        assert datas([await broker.get("q", peek=True)]) == [b"later"]
        assert datas([await broker.get("q")]) == [b"later"]
        c = broker.register(OpenReads())
        assert datas([await broker.get("r", client=c, open=True)]) == [b"later"]


async def slices_on_disk(tmp_path: Path) -> tuple[ServerConfig, list[bytes]]:
    """A config whose queue "q" holds four slices of items and some (memory room for
    all), and those items, put and the broker closed: at the next start every one is on
    disk."""
    cfg = with_default(make_config(tmp_path), max_memory_size=64 * 1024 * 1024)
    payloads = [b"%06d" % i for i in range(4 * LOAD_SLICE + 100)]
    async with open_broker(cfg) as broker:
        await broker.put("q", payloads)
    return cfg, payloads


async def test_a_read_back_goes_into_memory_a_slice_at_a_time(tmp_path: Path) -> None:
    """Items read back go into memory LOAD_SLICE at a time, with the event loop's other
    work between the slices (one read of 50,000 items held the loop ~38 ms at once, a
    stall for every connection); every item still comes once, in order."""
    cfg, payloads = await slices_on_disk(tmp_path)
    n = len(payloads)
    async with open_broker(cfg) as broker:  # after a restart every item starts on disk
        seen: list[int] = []
        got: list[bytes] = []

        async def watch() -> None:
            while len(got) < n:
                seen.append(stats(broker)["mem_items"])
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            while (it := await broker.get("q")) is not None:
                got.append(it.data)
        assert got == payloads
        # Memory filled in steps the other task saw, not from nothing to all at once.
        assert any(LOAD_SLICE // 2 < m < n - LOAD_SLICE for m in seen), sorted(set(seen))[:20]


async def test_a_flush_between_the_slices_of_a_read_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A flush (or a delete) that empties a reader while its read-back is between two
    slices: the slices left are dropped, and the broker goes on. (Compiled, the check of
    where read-behind stood after the flush read it as the int it was before the slices
    began, and the refill task's TypeError took the whole server down.)"""
    cfg, payloads = await slices_on_disk(tmp_path)
    n = len(payloads)
    async with open_broker(cfg) as broker:  # after a restart every item starts on disk
        flushed = 0

        async def flush_between_slices() -> None:
            nonlocal flushed
            with trio.fail_after(10):
                while not 0 < stats(broker)["mem_items"] < n - LOAD_SLICE:
                    await trio.sleep(0)
            flushed = broker.flush("q")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush_between_slices)
            await broker.get("q")  # (starts the read-back; what it gets races the flush)
        assert flushed >= n - 1  # (all but what the get took, if it took one)
        await trio.sleep(0.1)  # (the read-back's task sees the flush at its next slice)
        assert stats(broker)["items"] == 0 and await broker.get("q") is None
        await broker.put("q", [b"after"])
        assert datas([await broker.get("q")]) == [b"after"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
