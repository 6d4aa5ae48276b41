"""Parking idle queues (queued.broker.parking) on a real server: real sockets on port 0,
real files, a SIGKILLed subprocess for the crash test.

A parked queue keeps every item, its order and its counters; the first use loads it;
what holds a queue (open reads, waiters, a larger backlog, delayed items) keeps it
loaded. Every wait is a bounded loop on a condition.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from wait_util import wait_until, wait_until_blocking

from queued.broker import parking
from queued.client.aio import AsyncClient
from queued.config import ServerConfig
from queued.reader.open_reads import OpenReads
from queued.server.listeners import Server

#: Short enough for a test; the checkpoint round and the sweep stay out of the way.
FAST = {"park_after": "100ms", "checkpoint_interval": "50ms", "expiration_timer": "1h"}
#: Stats that differ between a loaded and a parked queue by design (memory held) or
#: time (the oldest item keeps ageing).
VOLATILE = {"mem_items", "mem_bytes", "oldest_item_age_msec"}


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **{**FAST, **settings})


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

async def test_flush_all_racing_a_delete_and_a_put_of_parked_queues(tmp_path: Path) -> None:
    """While flush_all yields between the parked queues it loads, one it has not reached
    is deleted and another gets a put: the deleted queue stays deleted (flush_all does
    not load it back), the others are flushed, and nothing raises."""
    names = [f"f{i}" for i in range(8)]
    async with running(cfg(tmp_path)) as server:
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
        wait_parked(proc)
        proc.kill()
        proc.start()
        client = pymc(proc.memcache)
        got = [client.get("k") for _ in range(5)]
        client.close()
        assert got[:4] == [b"item-%d" % i for i in range(1, 5)]


def wait_parked(proc: ServerProcess) -> None:
    """Until the server subprocess reports one parked queue on /metrics."""
    wait_until_blocking(lambda: re.search(rb"^queued_parked_queues 1\.0$",
                                          http_get(proc.http, "/metrics")[2], re.M),
                        why="a queue parked")


def _server(tmp_path: Path) -> Iterator[ServerProcess]:
    yield from killed_at_end(tmp_path, '[server]\npark_after = "100ms"\n'
                                       'checkpoint_interval = "50ms"\n')


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


# -- what a park and a load must keep (each could lose or leave something behind) ----------


def open_files_under(path: Path) -> list[str]:
    """This process's open file descriptors that point into `path`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd)
        if target.startswith(str(path)):
            found.append(os.path.basename(target))
    return found


def alive(ids: set[int]) -> list[str]:
    """Which of the objects `ids` names are still there (QueueState and co. have
    __slots__ without __weakref__: looked for among the objects gc tracks)."""
    gc.collect()
    kinds = {"QueueState", "QueueJournal", "LiveReader", "Reader"}
    return [type(o).__name__ for o in gc.get_objects()
            if id(o) in ids and type(o).__name__ in kinds]


async def test_parked_queue_state_is_freed_and_its_files_closed(tmp_path: Path) -> None:
    """Nothing keeps a parked queue's QueueState, handles or journal alive, and none of
    its files stay open."""
    data = tmp_path / "data"
    toml = '[queues.fd]\nmax_journal_size = "1MiB"\n'  # (its journal holds qs.before_drop)
    async with running(cfg(tmp_path, toml, fsync="always")) as server:
        conn = await Conn.open(server.ports["memcache"])
        for i in range(3):
            assert await conn.set("fd", b"x%d" % i) == b"STORED"
        assert await conn.get("fd") == b"x0"
        assert await conn.get("fd+a") == b"x1"  # takes over the default reader
        assert await conn.get("fd+b") is None  # a second reader, its own file
        assert await conn.set("fd", b"x3") == b"STORED"
        qs = server.broker.queues["fd"]
        ids = {id(qs), id(qs.journal), *(id(h) for h in qs.readers.values()),
               *(id(h.reader) for h in qs.readers.values())}
        assert len(alive(ids)) == 6
        assert any(n.startswith("fd.") for n in open_files_under(data))
        del qs
        await parked(server, "fd")
        assert alive(ids) == []
        assert not [n for n in open_files_under(data) if n.startswith("fd.")]
        assert await conn.get("fd+a") == b"x2"  # and it loads again
        assert await conn.get("fd+b") == b"x3"
        await conn.aclose()


async def test_stats_and_journal_figures_agree_parked_and_loaded(tmp_path: Path) -> None:
    """A fanout queue after a takeover: `stats` fields and the /metrics journal figures
    are the same loaded, parked and loaded again (but the memory figures and ages)."""
    async with running(cfg(tmp_path, fsync="always")) as server:
        b = server.broker
        conn = await Conn.open(server.ports["memcache"])
        for i in range(4):
            assert await conn.set("fan", b"x%d" % i) == b"STORED"
        assert await conn.get("fan") == b"x0"
        assert await conn.get("fan+a") == b"x1"  # takes over the default reader
        assert await conn.get("fan+b") is None
        assert await conn.set("fan", b"x4") == b"STORED"

        def view() -> tuple[list[tuple[str, dict[str, int]]], dict[str, object]]:
            fields, journal = b.queue_view("fan")
            keep = {"segments", "bytes", "last_id", "fsyncs", "write_errors", "failed",
                    "readers"}
            return ([(r, {k: v for k, v in f.items() if k not in VOLATILE})
                     for r, f in fields],
                    {k: v for k, v in dataclasses.asdict(journal).items() if k in keep})

        await wait_until(lambda: not any(h.reader.dirty
                                         for h in b.queues["fan"].readers.values()))
        before = view()
        await parked(server, "fan")
        assert view() == before
        assert b.has_reader("fan", "a") and b.reader_count("fan") == 2
        b.registry.unpark("fan")
        assert view() == before
        await conn.aclose()


async def test_recovery_report_survives_parking(tmp_path: Path) -> None:
    """What the start-up recovery cut from a torn tail (queued_recovery_truncated_bytes)
    is still reported once that queue has parked."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path, park_after=0)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("torn", b"x") == b"STORED"
        await conn.aclose()
    (segment,) = [n for n in os.listdir(data) if n.startswith("torn.") and ".read" not in n]
    with open(data / segment, "ab") as f:
        f.write(b"\x00\x01\x02\x03\x04\x05\x06")  # a torn append after the last batch
    async with running(cfg(tmp_path)) as server:
        cut = server.broker.datadir.statistics().truncated_bytes
        assert cut > 0
        await parked(server, "torn")
        assert server.broker.datadir.statistics().truncated_bytes == cut
        assert server.broker.datadir.report.records >= 1


async def test_error_counts_and_confirms_survive_park(tmp_path: Path) -> None:
    """Aborted reads keep their error counts, confirmed reads stay gone, across a park
    and a load (and a second one); ids keep rising."""
    async with running(cfg(tmp_path)) as server:
        b = server.broker
        await b.put("err", [b"a", b"b", b"c"])
        client = b.register(OpenReads())
        a = await b.get("err", client=client, open=True)
        bb = await b.get("err", client=client, open=True)
        assert a is not None and bb is not None
        assert b.abort(client, "err", ids=[a.id]) == 1
        assert b.confirm(client, "err", ids=[bb.id]) == 1
        again = await b.get("err", client=client, open=True)
        assert again is not None and again.id == a.id and again.error_count == 1
        assert b.abort(client, "err", ids=[a.id]) == 1
        for _ in range(2):
            await parked(server, "err")
            await b.put("err", [b"d"])
        got = await b.get_many("err", max_items=10)
        assert [(it.data, it.error_count) for it in got] == [
            (b"a", 2), (b"c", 0), (b"d", 0), (b"d", 0)]
        ids = [it.id for it in got]
        assert ids == sorted(set(ids)) and bb.id not in ids


async def test_delete_of_a_parked_queue_racing_a_put_of_the_same_name(tmp_path: Path) -> None:
    """`delete q` of a parked queue forgets it at once, then removes its files: a put
    of q meanwhile makes a new queue, whose acknowledged item must survive."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path, park_after="1h")) as server:
        b = server.broker
        await b.put("dq", [b"old"])
        qs = b.queues["dq"]
        qs.used = False
        assert await b.registry.park(qs)
        del qs
        acked: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.delete, "dq")
            for _ in range(100):  # a few scheduling rounds: the delete starts at once
                if "dq" not in b.registry.parked:
                    break
                await trio.lowlevel.checkpoint()
            assert "dq" not in b.registry.parked  # the delete is under way
            acked.append(await b.put("dq", [b"new"]))
        assert acked == [1]
        assert any(n.startswith("dq.") and ".read" not in n for n in os.listdir(data))
        got = await b.get("dq")
        assert got is not None and got.data == b"new"


async def test_sweep_does_not_expire_items_of_a_queue_parked_meanwhile(tmp_path: Path) -> None:
    """The expiry sweep walks a list of the queues taken before it awaits (deleting a
    queue past max_queue_age); a queue parked during that await must not be swept from
    its stale state: its expired items would move to expire_to_queue from a state
    nobody saves, and again from its files when it loads (twice in the target)."""
    toml = ('[queues.old]\nmax_queue_age = "10ms"\n'
            '[queues.y]\nmax_age = "20ms"\nexpire_to_queue = "dead"\n')
    async with running(cfg(tmp_path, toml, park_after="1h")) as server:
        b = server.broker
        await b.put("old", [b"o"])
        assert (await b.get("old")) is not None  # empty: the sweep deletes it
        await b.put("y", [b"e1", b"e2"])
        await b.checkpoint_all()
        put_at = b.clock()
        await wait_until(lambda: b.clock() > put_at + 30)  # y's items are past max_age
        y = b.queues["y"]
        y.used = False
        lock = b.datadir.writer.paused()  # (the lock rounds hold)
        # The writer held, as a round would: the park waits first, the sweep's delete next.
        async with trio.open_nursery() as nursery, b.datadir.writer.paused():
            nursery.start_soon(b.registry.park, y)
            await wait_until(lambda: lock.statistics().tasks_waiting == 1)
            nursery.start_soon(b.sweep)  # its delete of `old` waits behind the park
            await wait_until(lambda: lock.statistics().tasks_waiting == 2)
        assert "old" not in b.queues and "y" in b.registry.parked
        del y
        for _ in range(3):  # loads y: its items expire (now, from its files)
            assert await b.get("y") is None

        def moved() -> int:
            return sum(f["items"] for n, f in b.queue_stats() if n == "dead")
        await wait_until(lambda: moved() >= 2)
        for _ in range(20):  # (a move of the stale state may land a little later)
            await trio.sleep(0.01)
        got = await b.get_many("dead", max_items=10)
        assert sorted(it.data for it in got) == [b"e1", b"e2"]


async def test_console_page_of_a_parked_queue_that_cannot_load(tmp_path: Path) -> None:
    """The console's page of a parked queue whose files are gone answers an error (as
    the protocols do) and the server goes on serving."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("gone", b"x") == b"STORED"
        await parked(server, "gone")
        for name in os.listdir(data):
            if name.startswith("gone.") and ".read" not in name:
                (data / name).unlink()
        status, _, body = await trio.to_thread.run_sync(
            http_get, server.ports["http"], "/api/queues/gone")
        assert status == 503 and b"loading it from disk failed" in body
        assert await conn.set("other", b"y") == b"STORED"
        await conn.aclose()


def test_sigkill_after_park_load_put_cycles_recovers_in_order(tmp_path: Path) -> None:
    """Park, load by a get and a put (a new segment each time), park again, a few times;
    then SIGKILL: the restarted server has exactly the unconsumed items, in order."""
    for proc in _server(tmp_path):
        proc.start()
        client = pymc(proc.memcache)
        expect: list[bytes] = []
        for cycle in range(4):
            for i in range(3):
                assert client.set("cyc", b"%d-%d" % (cycle, i))
                expect.append(b"%d-%d" % (cycle, i))
            assert client.get("cyc") == expect.pop(0)
            wait_parked(proc)
        segments = [n for n in data_files(tmp_path / "data")
                    if n.startswith("cyc.") and ".read" not in n]
        assert 1 <= len(segments) <= 4  # compaction keeps up with the new segments
        client.close()
        proc.kill()
        proc.start()
        client = pymc(proc.memcache)
        got = [client.get("cyc") for _ in range(len(expect) + 1)]
        client.close()
        assert got == [*expect, None]


async def test_max_queues_counts_parked_readers(tmp_path: Path) -> None:
    """Fanout readers of a parked queue count towards max_queues: parking frees no room
    for new queues or readers, and loading it takes none."""
    async with running(cfg(tmp_path, max_queues=4)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("f", b"x") == b"STORED"
        assert await conn.get("f+a") == b"x"  # takes over: still one name
        assert await conn.get("f+b") is None
        assert await conn.get("f+c") is None  # f+a, f+b, f+c: three names
        assert await conn.set("g", b"x") == b"STORED"  # four
        await parked(server, "f", "g")
        assert server.broker.registry.names() == 4
        assert (await conn.set("h", b"x")).startswith(b"SERVER_ERROR")
        assert (await conn.cmd(b"get f+d")).startswith(b"SERVER_ERROR")  # loads f, no room
        assert "f" in server.broker.queues and server.broker.registry.names() == 4
        assert await conn.get("g") == b"x"
        await conn.aclose()



class HeldLoads:
    """Holds every load of a parked queue on a worker thread (`Registry.read_parked`, the
    seam) until `release`; a load on the event loop's thread (`unpark`) goes through. It
    records the threads that read and what they read; `restore` puts the seam back."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.real = registry.read_parked
        self.threads: list[int] = []
        self.reads: list[Any] = []
        self.entered = threading.Event()
        self.released = threading.Event()
        registry.read_parked = self.read

    def read(self, name: str, p: parking.ParkedQueue) -> Any:
        if threading.current_thread() is threading.main_thread():
            return self.real(name, p)
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.released.wait(WAIT), "the test never released the load"
        loaded = self.real(name, p)
        self.reads.append(loaded)
        return loaded

    def release(self) -> None:
        self.released.set()

    def restore(self) -> None:
        self.released.set()
        self.registry.read_parked = self.real


async def test_a_pass_loads_a_parked_queue_on_a_worker_thread(tmp_path: Path) -> None:
    """A request of a parked queue leaves the reactor's pass for its connection's task,
    which reads the queue's files on a worker thread: while the read is held, other
    connections are served, and a second use of the same queue waits for that one load
    (the files are read once). Then both are answered, in order, with nothing lost."""
    async with running(cfg(tmp_path)) as server:
        conn = await park_each(server, ["p"])
        registry = server.broker.registry
        held = HeldLoads(registry)
        getter = await Conn.open(server.ports["memcache"])
        putter = await Conn.open(server.ports["memcache"])
        other = await Conn.open(server.ports["memcache"])
        try:
            await getter.send(b"get p\r\n")
            await wait_until(held.entered.is_set)
            await putter.send(b"set p 0 0 4\r\nlate\r\n")
            # The reactor goes on: another queue's set and get are answered meanwhile.
            for i in range(5):
                assert await other.set("busy", b"%d" % i) == b"STORED"
                assert await other.get("busy") == b"%d" % i
            assert "p" in registry.parked and not getter.buf and not putter.buf
            held.release()
            assert await getter.read_value("p") == b"x"
            assert await putter.line() == b"STORED"
            assert len(held.reads) == 1  # one read for both uses, on a worker thread
            assert "p" in server.broker.queues and "p" not in registry.parked
            assert await getter.get("p") == b"late"
        finally:
            held.restore()
            for c in (getter, putter, other, conn):
                await c.aclose()


async def test_a_delete_waits_for_a_load_of_the_parked_queue(tmp_path: Path) -> None:
    """A delete of a parked queue whose files are being read (a load on a worker
    thread) waits for that read, then deletes the queue it loaded: no file of it is
    left, and no load puts it back."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        conn = await park_each(server, ["gone"])
        registry = server.broker.registry
        held = HeldLoads(registry)
        deleted: list[bool] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(registry.load_parked, "gone")
                await wait_until(held.entered.is_set)

                async def delete() -> None:
                    deleted.append(await server.broker.delete("gone"))

                nursery.start_soon(delete)
                await trio.sleep(0.05)
                assert not deleted  # waiting for the read
                held.release()
            assert deleted == [True]
            assert "gone" not in server.broker.queues and "gone" not in registry.parked
            assert not [n for n in data_files(data) if n.startswith("gone.")]
        finally:
            held.restore()
            await conn.aclose()


async def test_a_load_made_moot_meanwhile_is_dropped(tmp_path: Path) -> None:
    """A queue loaded here and now (`unpark`) while its load on a worker thread was
    under way: the thread's copy is dropped, the queue loaded once, its item kept."""
    async with running(cfg(tmp_path)) as server:
        conn = await park_each(server, ["twice"])
        registry = server.broker.registry
        held = HeldLoads(registry)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(registry.load_parked, "twice")
                await wait_until(held.entered.is_set)
                qs = registry.unpark("twice")  # a use outside a pass, here and now
                held.release()
            assert len(held.reads) == 1 and held.reads[0].journal is not qs.journal
            assert server.broker.queues["twice"] is qs
            assert await conn.get("twice") == b"x"
        finally:
            held.restore()
            await conn.aclose()
