"""Parking idle queues (queued.broker.parking) on a real server: real sockets on port 0,
real files, a SIGKILLed subprocess for the crash test.

A parked queue keeps every item, its order and its counters; the first use loads it;
what holds a queue (open reads, waiters, a larger backlog, delayed items) keeps it
loaded. Every wait is a bounded loop on a condition.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from server_util import (
    HOST,
    WAIT,
    Conn,
    ServerProcess,
    data_files,
    http_get,
    killed_at_end,
    make_config,
    pymc,
    running,
)

from queued.broker import parking
from queued.client.aio import AsyncClient
from queued.config import ServerConfig
from queued.server.listeners import Server

#: Short enough for a test; the checkpoint round and the sweep stay out of the way.
FAST = {"park_after": "100ms", "checkpoint_interval": "50ms", "expiration_timer": "1h"}
#: Stats that differ between a loaded and a parked queue by design (memory held) or
#: time (the oldest item keeps ageing).
VOLATILE = {"mem_items", "mem_bytes", "oldest_item_age_msec"}


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **{**FAST, **settings})


async def wait_until(what: Callable[[], bool], timeout: float = WAIT) -> None:
    with trio.fail_after(timeout):
        while not what():
            await trio.sleep(0.01)


async def parked(server: Server, *names: str) -> None:
    await wait_until(lambda: all(n in server.broker.registry.parked for n in names))


async def park_each(server: Server, names: list[str]) -> Conn:
    """A memcache connection that put one item in each of `names`, once all are parked."""
    conn = await Conn.open(server.ports["memcache"])
    for q in names:
        assert await conn.set(q, b"x") == b"STORED"
    await parked(server, *names)
    return conn


def stable(fields: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in fields.items() if k not in VOLATILE}


def stats_of(server: Server) -> dict[str, dict[str, int]]:
    return dict(server.broker.queue_stats())


async def test_park_then_use_keeps_items_order_ids_and_stats(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c:
            assert await c.put("q", [b"a", b"b", b"c", b"d", b"e", b"f"]) == 6
            first = await c.get("q")
            assert [it.data for it in first] == [b"a"]
            before = stats_of(server)["q"]
            await parked(server, "q")
            assert "q" not in server.broker.queues
            during = stats_of(server)["q"]
            assert stable(during) == stable(before)
            assert during["mem_items"] == 0 and during["oldest_item_age_msec"] >= \
                before["oldest_item_age_msec"]
            # peek loads it; a reliable read, confirm, a plain get: order and ids hold
            conn = await Conn.open(server.ports["memcache"])
            assert await conn.get("q/peek") == b"b"
            assert "q" in server.broker.queues
            after = stats_of(server)["q"]
            assert stable(after) == stable(before)
            await parked(server, "q")
            opened = await c.get("q", auto_abort_ms=WAIT_MS)
            assert [it.data for it in opened] == [b"b"]
            assert opened[0].id > first[0].id
            assert await c.confirm(opened) == 1
            await parked(server, "q")
            rest = await c.get("q", 10)
            assert [it.data for it in rest] == [b"c", b"d", b"e", b"f"]
            ids = [it.id for it in first + opened + rest]
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
            await parked(server, "q")
            assert await c.put("q", [b"g"]) == 1  # a put loads it; ids keep rising
            await parked(server, "q")
            (g,) = await c.get("q")
            assert g.data == b"g" and g.id > ids[-1]
            await conn.aclose()


WAIT_MS = int(WAIT * 1000)


async def test_long_poll_and_fanout_reader_load_a_parked_queue(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("f", b"old") == b"STORED"
        await parked(server, "f")
        got: list[bytes | None] = []

        async def poll() -> None:
            poller = await Conn.open(server.ports["memcache"])
            got.append(await poller.get(f"f+audit/t={WAIT_MS}"))  # takes over f's backlog
            await poller.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await wait_until(lambda: "f" in server.broker.queues)
        assert got == [b"old"]
        await parked(server, "f")
        waiter: list[bytes | None] = []

        async def wait_new() -> None:
            poller = await Conn.open(server.ports["memcache"])
            waiter.append(await poller.get(f"f+audit/t={WAIT_MS}"))
            await poller.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_new)
            await wait_until(lambda: "f" in server.broker.queues and any(
                h.waiters for h in server.broker.queues["f"].readers.values()))
            await trio.sleep(0.3)  # (three park_after: a waiter keeps it loaded)
            assert "f" in server.broker.queues
            assert await conn.set("f", b"new") == b"STORED"
        assert waiter == [b"new"]
        await conn.aclose()


async def test_metrics_console_and_stats_show_parked_queues(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for i in range(3):
            assert await conn.set("m", b"x%d" % i) == b"STORED"
        await parked(server, "m")
        stats = await conn.stats()
        assert stats["queue_m_items"] == "3" and stats["curr_items"] == "3"
        _, _, body = await trio.to_thread.run_sync(http_get, server.ports["http"], "/metrics")
        text = body.decode()
        assert re.search(r'^queued_queue_items\{queue="m",reader=""\} 3\.0$', text, re.M)
        assert re.search(r"^queued_parked_queues 1\.0$", text, re.M)
        assert re.search(r"^queued_queues 1\.0$", text, re.M)
        assert re.search(r'^queued_journal_segments\{queue="m"\} 1\.0$', text, re.M)
        status, _, body = await trio.to_thread.run_sync(http_get, server.ports["http"],
                                                        "/api/queues/m")
        assert status == 200 and len(json.loads(body)["items"]) == 3  # the console's page
        assert "m" in server.broker.queues
        await conn.aclose()


async def test_delete_and_flush_all_of_parked_queues(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for q in ("d1", "d2", "full", "empty"):
            assert await conn.set(q, b"x") == b"STORED"
        assert await conn.get("empty") == b"x"
        await parked(server, "d1", "d2", "full", "empty")
        assert await conn.cmd(b"delete d1") == b"DELETED"
        assert not [f for f in data_files(data) if f.startswith("d1.")]
        assert "d1" not in server.broker.registry.parked
        assert await conn.cmd(b"flush_all") == b"Flushed all queues."
        stats = stats_of(server)
        assert stats["full"]["items"] == 0 and stats["full"]["total_flushes"] == 1
        assert stats["empty"]["total_flushes"] == 1
        assert stats["d2"]["items"] == 0
        assert await conn.get("full") is None and await conn.get("d2") is None
        assert "d1" not in stats
        await conn.aclose()


async def test_flush_all_lets_other_work_run_between_loads(tmp_path: Path) -> None:
    """flush_all loads each parked queue holding items: it yields after each load, so
    a flush_all over many of them does not hold the event loop in one go; a queue
    loaded by somebody else meanwhile is flushed all the same."""
    names = [f"f{i}" for i in range(12)]
    async with running(cfg(tmp_path)) as server:
        conn = await park_each(server, names)
        broker = server.broker
        turns = 0
        flushed: list[int] = []

        async def flush() -> None:
            flushed.append(await broker.flush_all())

        async def other() -> None:
            nonlocal turns
            while not flushed:
                turns += 1
                if turns == 3:  # a use loads a queue the flush has not reached yet
                    broker.registry.queue(names[-1])
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush)
            nursery.start_soon(other)
        assert flushed == [len(names)]
        assert turns >= len(names) - 2  # it ran between the loads, not after them all
        assert all(stats_of(server)[q]["items"] == 0 for q in names)
        await conn.aclose()

async def test_max_queues_counts_parked_queues(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, max_queues=3)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for q in ("a", "b", "c"):
            assert await conn.set(q, b"x") == b"STORED"
        await parked(server, "a", "b", "c")
        assert (await conn.set("d", b"x")).startswith(b"SERVER_ERROR cannot create queue 'd'")
        assert await conn.set("a", b"y") == b"STORED"  # a parked queue still works
        assert server.broker.registry.names() == 3
        await conn.aclose()


async def test_what_keeps_a_queue_loaded(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        holder = await Conn.open(server.ports["memcache"])
        assert await conn.set("open", b"x") == b"STORED"
        assert await holder.get("open/open") == b"x"  # an open read
        for i in range(parking.PARK_MAX_ITEMS + 1):  # a larger backlog
            assert await conn.set("big", b"%d" % i) == b"STORED"
        async with AsyncClient(f"{HOST}:{server.ports['rpc']}") as c:
            await c.call("put", "later", [b"x"], 0, 0, 60_000)  # a delayed item
        assert await conn.set("control", b"x") == b"STORED"
        async with trio.open_nursery() as nursery:
            async def wait() -> None:
                waiter = await Conn.open(server.ports["memcache"])
                await waiter.get("waited/t=2000")  # a waiter
                await waiter.aclose()
            nursery.start_soon(wait)
            await parked(server, "control")
            await trio.sleep(0.3)  # (three park_after more)
            assert {"open", "big", "later", "waited"} <= server.broker.queues.keys()
        await holder.aclose()  # the open read goes back: now it may park
        await parked(server, "open", "waited")
        assert {"big", "later"} <= server.broker.queues.keys()
        await conn.aclose()


async def test_parked_items_expire_lazily_and_old_empty_queues_go(tmp_path: Path) -> None:
    toml = '[queues.e]\nmax_age = "50ms"\n[queues.old]\nmax_queue_age = "150ms"\n'
    async with running(cfg(tmp_path, toml)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for q in ("e", "e", "old"):
            assert await conn.set(q, b"x") == b"STORED"
        assert await conn.get("old") == b"x"
        await parked(server, "e", "old")
        assert stats_of(server)["e"]["items"] == 2  # expired, but nobody looked yet
        assert await conn.get("e") is None  # loads it: they expire now
        assert stats_of(server)["e"]["expired_items"] == 2
        assert "old" in server.broker.registry.parked
        with trio.fail_after(WAIT):  # (the sweep runs every hour here: rounds by hand)
            while "old" in server.broker.registry.parked:
                assert "old" not in server.broker.queues  # deleted without loading
                await server.broker.sweep()
                await trio.sleep(0.02)
        assert "old" not in stats_of(server)
        assert server.broker.counters.queue_expires == 1
        assert not [f for f in data_files(tmp_path / "data") if f.startswith("old.")]
        await conn.aclose()


async def test_delete_a_reader_of_a_parked_queue(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.get("fan+a") is None
        assert await conn.get("fan+b") is None
        assert await conn.set("fan", b"x") == b"STORED"
        await parked(server, "fan")
        assert set(stats_of(server)) == {"fan+a", "fan+b"}
        assert await conn.cmd(b"delete fan+a") == b"DELETED"
        assert set(stats_of(server)) == {"fan+b"}
        assert await conn.get("fan+b") == b"x"
        await conn.aclose()


async def test_a_parked_queue_that_cannot_load_stays_parked(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for q in ("lost", "fine"):
            assert await conn.set(q, b"x") == b"STORED"
        await parked(server, "lost", "fine")
        for name in data_files(data):
            if name.startswith("lost.") and ".read." not in name:
                (data / name).unlink()  # its segment, gone behind the server's back
        reply = await conn.cmd(b"get lost")
        assert reply.startswith(b"SERVER_ERROR") and b"loading it from disk failed" in reply
        assert "lost" in server.broker.registry.parked  # still there, as it was
        conn2 = await Conn.open(server.ports["memcache"])
        assert await conn2.cmd(b"flush_all") == b"Flushed all queues."  # the rest flushed
        assert stats_of(server)["fine"]["items"] == 0
        await conn2.aclose()
        await conn.aclose()


async def test_reload_while_parked_applies_on_load(tmp_path: Path) -> None:
    toml = tmp_path / "data.toml"
    async with running(cfg(tmp_path, "[queues.r]\nmax_items = 10\n")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("r", b"1") == b"STORED"
        await parked(server, "r")
        toml.write_text("[queues.r]\nmax_items = 1\n")
        assert await conn.cmd(b"reload") == b"Reloaded config."
        assert await conn.set("r", b"2") == b"NOT_STORED"  # loaded with the new config
        assert server.broker.queues["r"].config.max_items == 1
        await conn.aclose()


async def test_park_racing_puts_and_gets(tmp_path: Path) -> None:
    """Parks started by hand against puts and gets at random moments: nothing is lost,
    duplicated or reordered, ids rise."""
    rnd = random.Random(16)
    async with running(cfg(tmp_path, park_after="1h")) as server:
        b = server.broker
        put: list[bytes] = []
        got: list[bytes] = []
        parks: list[bool] = []
        ids: list[int] = []
        for round_ in range(60):
            async def park() -> None:
                await trio.sleep(rnd.random() * 0.002)
                qs = b.queues.get("race")
                if qs is not None:
                    qs.used = False
                    parks.append(await b.registry.park(qs))

            async def use(round_: int = round_) -> None:
                await trio.sleep(rnd.random() * 0.002)
                data = [b"%d-%d" % (round_, i) for i in range(rnd.randint(1, 3))]
                await b.put("race", data)
                put.extend(data)
                if rnd.random() < 0.5:
                    items = await b.get_many("race", max_items=2)
                    got.extend(it.data for it in items)
                    ids.extend(it.id for it in items)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(park)
                nursery.start_soon(use)
        items = await b.get_many("race", max_items=1000)
        got.extend(it.data for it in items)
        ids.extend(it.id for it in items)
        assert got == put
        assert ids == sorted(set(ids))  # ids rose across every park and load
        assert True in parks and False in parks  # both orders happened


async def test_a_use_during_the_checkpoint_write_keeps_it_loaded(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, park_after="1h")) as server:
        b = server.broker
        await b.put("w", [b"1", b"2", b"3"])
        assert (await b.get("w")).data == b"1"  # type: ignore[union-attr]
        qs = b.queues["w"]
        assert any(h.reader.dirty for h in qs.readers.values())  # parking writes first
        qs.used = False
        result: list[bool] = []
        async with trio.open_nursery() as nursery:
            async def park() -> None:
                result.append(await b.registry.park(qs))
            nursery.start_soon(park)
            for _ in range(100):  # (a few scheduling rounds: it starts its write at once)
                if qs.reader_busy:
                    break
                await trio.lowlevel.checkpoint()
            assert qs.reader_busy  # in its checkpoint write
            got = await b.get("w")  # a use meanwhile
        assert result == [False] and b.queues.get("w") is qs
        assert got is not None and got.data == b"2"
        qs.used = False
        assert await b.registry.park(qs)  # untouched since: it parks
        assert [it.data for it in await b.get_many("w", max_items=5)] == [b"3"]


def test_sigkill_after_parking_recovers_everything(tmp_path: Path) -> None:
    for proc in _server(tmp_path):
        proc.start()
        client = pymc(proc.memcache)
        for i in range(5):
            assert client.set("k", b"item-%d" % i)
        assert client.get("k") == b"item-0"
        client.close()
        with _deadline(WAIT) as left:
            while left():
                _, _, body = http_get(proc.http, "/metrics")
                if re.search(rb"^queued_parked_queues 1\.0$", body, re.M):
                    break
            else:
                raise AssertionError("k never parked")
        proc.kill()
        proc.start()
        client = pymc(proc.memcache)
        got = [client.get("k") for _ in range(5)]
        client.close()
        assert got[:4] == [b"item-%d" % i for i in range(1, 5)]


def _server(tmp_path: Path) -> Iterator[ServerProcess]:
    yield from killed_at_end(tmp_path, '[server]\npark_after = "100ms"\n'
                                       'checkpoint_interval = "50ms"\n')


class _deadline:
    """`while left():` for at most `seconds`, 20 ms between tries."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> Callable[[], bool]:
        import time
        end = time.monotonic() + self.seconds
        first = [True]

        def left() -> bool:
            if not first[0]:
                time.sleep(0.02)
            first[0] = False
            return time.monotonic() < end
        return left

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_parked_summary_is_small() -> None:
    from queued.reader.shared import ReaderCounters
    p = parking.ParkedQueue(1_764_000_000_000, 12, 180, (1_764_000_000_123,), 3, 0, (
        parking.ParkedReader("", 1_764_000_000_000, 1, 60, 1_764_000_000_050,
                             ReaderCounters(2, 1, 0, 0, 0, 0, 0, 5)),))
    data = parking.pack(p)
    assert parking.unpack(data) == p
    assert len(data) < 50


@pytest.mark.parametrize("ms, tick", [(0, 1.0), (100, 0.01), (30_000, 1.0), (5000, 0.5)])
def test_park_tick(ms: int, tick: float) -> None:
    assert parking.park_tick(ms) == tick
