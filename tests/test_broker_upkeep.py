"""The broker's background work (queued.broker.upkeep): checkpoints and expiry sweeps on
their timers, rounds counted, a failing round that does not take the broker down, a
delete racing a background refill, and a refill that fails. Real brokers over real data
directories; trio time is a MockClock the tests jump (broker_util)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from broker_util import (
    T0,
    FakeClock,
    advance,
    get_all,
    make_config,
    settle,
    stats,
    with_default,
)
from compiled_util import not_compiled

import queued.broker.queues
from queued.broker.broker import Broker
from queued.broker.upkeep import Upkeep, open_broker
from queued.storage.opening import open_data_dir


async def test_delete_during_background_refill_keeps_the_broker_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trio_clock: trio.testing.MockClock
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = queued.broker.queues.read_range

    def slow_read_range(*args: Any) -> Any:
        entered.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(queued.broker.queues, "read_range", slow_read_range)
    cfg = with_default(make_config(tmp_path), max_memory_size=150)
    async with open_broker(cfg) as broker:
        await broker.put("q", [b"%03d" % i + b"." * 97 for i in range(20)])
        h = broker.queues["q"].readers[""]
        assert await broker.get("q") is not None  # memory is empty now: a refill starts
        await trio.to_thread.run_sync(entered.wait, 5)
        assert await broker.delete("q")
        release.set()
        await settle(lambda: not h.refilling)
        await broker.put("other", [b"x"])
        assert await get_all(broker, "other") == [b"x"]


async def test_a_refill_that_fails_unexpectedly_is_logged_and_the_broker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trio_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in a background read-back (anything but a journal error) is logged with its
    queue and reader; it does not end the broker's upkeep (the server with it), and the
    next get starts the read-back again."""
    real = queued.broker.queues.read_range

    def broken_read_range(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(queued.broker.queues, "read_range", broken_read_range)
    cfg = with_default(make_config(tmp_path), max_memory_size=150)
    payloads = [b"%03d" % i + b"." * 97 for i in range(20)]
    async with open_broker(cfg) as broker:
        await broker.put("q", payloads)
        h = broker.queues["q"].readers[""]
        first = await broker.get("q")  # (memory is empty now: a refill starts)
        assert first is not None and first.data == payloads[0]
        await settle(lambda: "reading items back failed" in caplog.text)
        await settle(lambda: not h.refilling)
        assert "queue q reader ''" in caplog.text and "RuntimeError: boom" in caplog.text
        await broker.put("other", [b"x"])
        assert await get_all(broker, "other") == [b"x"]
        monkeypatch.setattr(queued.broker.queues, "read_range", real)
        assert await get_all(broker, "q") == payloads[1:]


async def test_background_checkpoint_and_sweep(
    tmp_path: Path, trio_clock: trio.testing.MockClock
) -> None:
    clock = FakeClock()
    cfg = make_config(tmp_path, checkpoint_interval=20, expiration_timer=20)
    async with open_broker(cfg, clock=clock) as broker:
        await broker.put("q", [b"a", b"b"])
        await broker.put("q", [b"c"], expire_ms=T0 + 10)
        await broker.get("q")
        await broker.get("q")
        journal = broker.queues["q"].journal
        assert journal.readers[""].head == 0
        await advance(trio_clock, 0.015625)
        assert journal.readers[""].head == 0  # no round before 20 ms
        await advance(trio_clock, 0.015625)  # the checkpoint timer writes (in a thread)...
        await settle(lambda: journal.readers[""].head == 2)
        assert stats(broker)["items"] == 1  # ...and the sweep finds nothing expired yet
        clock.now += 10
        await advance(trio_clock, 0.03125)  # the next sweep expires c
        assert stats(broker)["items"] == 0 and stats(broker)["expired_items"] == 1


@not_compiled("replaces a method of Broker, which a compiled class does not allow")
async def test_upkeep_counts_its_rounds_and_outlives_a_failing_one(
    tmp_path: Path, trio_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing_sweep(self: Broker) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Broker, "sweep", failing_sweep)
    cfg = make_config(tmp_path, checkpoint_interval=1000, expiration_timer=1000)
    async with open_data_dir(cfg.data_dir, cfg.data_dir_config(),
                             lambda name: cfg.queue_config(name).journal_config()) as dd:
        upkeep = Upkeep(Broker(dd, cfg))
        assert not upkeep.statistics().running
        async with trio.open_nursery() as nursery:
            await nursery.start(upkeep.run)
            await advance(trio_clock, 1.0)
            await advance(trio_clock, 1.0)
            s = upkeep.statistics()
            assert s.running and (s.checkpoint_rounds, s.sweep_rounds, s.failed_rounds) == (
                2, 0, 2)
            nursery.cancel_scope.cancel()
        assert not upkeep.statistics().running
