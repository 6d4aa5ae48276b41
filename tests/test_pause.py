"""pause / resume: a paused queue takes puts, its gets and long polls wait (a long poll
is answered by the resume, not with empty), the pause outlives a restart, and stats,
/stats.json and /metrics show it. Real servers on free ports, real clients."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from server_util import HOST, Conn, http_get, make_config, running
from wait_util import wait_until

from queued.client import AsyncClient
from queued.config import ServerConfig


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def test_a_paused_queue_takes_puts_and_its_long_polls_wait_for_resume(
        tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        admin, waiter, other = [await Conn.open(port) for _ in range(3)]
        assert await admin.cmd(b"pause jobs") == b"OK"
        assert await admin.set("jobs", b"j1") == b"STORED"  # puts go on
        assert await other.get("jobs") is None  # a get that asked not to wait
        await waiter.send(b"get jobs/t=8000/open\r\n")  # waits...
        assert await other.get("jobs/t=300") is None  # (nothing handed out meanwhile)
        assert (await other.stats())["queue_jobs_paused"] == "1"
        start = trio.current_time()
        assert await admin.cmd(b"resume jobs") == b"OK"
        assert await waiter.read_value("jobs/t=8000/open") == b"j1"  # ...for the resume
        assert trio.current_time() - start < 5
        assert await waiter.get("jobs/close") is None
        assert await admin.cmd(b"resume jobs") == b"OK"  # resuming a running queue: a no-op
        assert (await other.stats())["queue_jobs_paused"] == "0"
        for c in (admin, waiter, other):
            await c.aclose()


async def test_pause_over_rpc_and_text_and_peek_still_sees(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server, AsyncClient(
            f"{HOST}:{server.ports['rpc']}") as c:
        await c.put("q", [b"a", b"b"])
        await c.pause("q")
        assert await c.get("q", 10, 200) == []
        assert (await c.peek("q")).head is not None  # looking is not consuming
        text = await Conn.open(server.ports["text"], b"\n")
        assert await text.cmd(b"get q") == b"*"
        assert await text.cmd(b"resume q") == b"+1"
        assert [it.data for it in await c.get("q", 10)] == [b"a", b"b"]
        assert await text.cmd(b"pause q") == b"+1"
        await text.aclose()
        stats = (await c.stats())[f"{HOST}:{server.ports['rpc']}"]
        assert stats["queues"]["q"]["paused"] == 1


async def test_pause_outlives_a_restart_and_shows_in_metrics(tmp_path: Path) -> None:
    config = cfg(tmp_path)
    async with running(config) as server:
        c = await Conn.open(server.ports["memcache"])
        assert await c.set("jobs", b"kept") == b"STORED"
        assert await c.cmd(b"pause jobs") == b"OK"
        await c.aclose()
    async with running(config) as server:
        c = await Conn.open(server.ports["memcache"])
        assert (await c.stats())["queue_jobs_paused"] == "1"
        assert await c.get("jobs/t=300") is None
        status, _, body = await trio.to_thread.run_sync(http_get, server.ports["http"],
                                                        "/metrics")
        assert status == 200
        assert b'queued_queue_paused{queue="jobs",reader=""} 1.0' in body
        status, _, body = await trio.to_thread.run_sync(http_get, server.ports["http"],
                                                        "/stats.json")
        assert json.loads(body)["queues"]["jobs"]["paused"] == 1
        assert await c.cmd(b"resume jobs") == b"OK"
        assert await c.get("jobs") == b"kept"
        await c.aclose()
    async with running(config) as server:  # the resume is durable too
        c = await Conn.open(server.ports["memcache"])
        assert (await c.stats())["queue_jobs_paused"] == "0"
        await c.aclose()


async def test_a_parked_paused_queue_stays_paused(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, park_after="1ms")) as server:
        c = await Conn.open(server.ports["memcache"])
        assert await c.set("idle", b"x") == b"STORED"
        assert await c.cmd(b"pause idle") == b"OK"
        await wait_until(lambda: "idle" not in server.broker.queues, why="parked")
        assert (await c.stats())["queue_idle_paused"] == "1"
        assert await c.get("idle/t=200") is None  # loaded again, still paused
        assert await c.cmd(b"resume idle") == b"OK"
        assert await c.get("idle") == b"x"
        await c.aclose()


async def test_pauses_at_the_same_time_are_all_kept(tmp_path: Path) -> None:
    config = cfg(tmp_path)
    names = [f"q{i}" for i in range(8)]
    async with running(config) as server, trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(server.broker.set_paused, name, True)
    async with running(config) as server:
        assert server.broker.paused == frozenset(names)
