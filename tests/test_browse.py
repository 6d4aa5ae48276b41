"""browse: items in delivery order, page by page, without opening or taking them: from
memory, from the read-behind on disk, returned ones first, with their delivery counts.
Real servers on free ports, the real client."""

from __future__ import annotations

from pathlib import Path

from server_util import HOST, make_config, running

from queued.client import AsyncClient
from queued.config import ServerConfig


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def test_browse_pages_through_a_queue_without_taking_anything(tmp_path: Path) -> None:
    # A small memory budget: most of the 300 items wait on disk (read-behind).
    toml = '[queues.q]\nmax_memory_size = "2KiB"\n'
    async with running(cfg(tmp_path, toml)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c:
            await c.put("q", [b"item-%03d" % i for i in range(300)])
            assert (await c.peek("q")).stats["mem_items"] < 300  # some wait on disk
            seen: list[bytes] = []
            after = 0
            while page := await c.browse("q", after, 64):
                seen += [it.data for it in page]
                after = page[-1].id
            assert seen == [b"item-%03d" % i for i in range(300)]
            info = await c.peek("q")
            assert (info.items, info.open_transactions) == (300, 0)  # nothing consumed
            assert [it.data for it in await c.get("q", 2)] == [b"item-000", b"item-001"]
            assert [it.data for it in await c.browse("q", 0, 2)] == [b"item-002", b"item-003"]


async def test_browse_shows_delivery_order_and_counts(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c:
            await c.put("q", [b"a", b"b", b"c", b"d"])
            got = await c.get("q", 2, 0, 10_000)  # a, b open: not in the queue now
            assert [it.data for it in await c.browse("q")] == [b"c", b"d"]
            await c.abort(got[1])  # b goes back to the head, one delivery so far
            page = await c.browse("q")
            assert [(it.data, it.deliveries) for it in page] == [(b"b", 1), (b"c", 0), (b"d", 0)]
            # A page after b (returned, a lower id than c) goes on in delivery order.
            assert [it.data for it in await c.browse("q", page[0].id, 10)] == [b"c", b"d"]
            assert await c.browse("nosuch") == []
            assert "nosuch" not in (await c.stats())[address]["queues"]  # nothing made
            await c.confirm(got[0])
