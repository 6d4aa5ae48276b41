"""Confirms and aborts that cannot be made durable (a full disk): each gets an error
reply on a connection that stays open, and no item whose confirm was refused is lost.

A real 2 MiB tmpfs under the data directory (needs root; skipped otherwise), real
servers on 127.0.0.1 port 0, raw memcache, text and MessagePack-RPC connections. The
checkpoint interval is an hour, so no checkpoint file exists before the disk fills:
the first confirm's append has to create one, which a full disk refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from disk_util import fill_completely
from server_util import HOST, Conn, Rpc, make_config, running

pytestmark = pytest.mark.slow

NO_SPACE = b"No space left on device"


async def drain(port: int, queue: str) -> list[bytes]:
    """Every item a plain get still finds on `queue`, in order."""
    conn = await Conn.open(port)
    got: list[bytes] = []
    while (data := await conn.get(queue)) is not None:
        got.append(data)
    await conn.aclose()
    return got


async def test_refused_confirms_and_aborts_answer_an_error_and_lose_nothing(
        tmpfs: Path) -> None:
    data_dir = tmpfs / "data"
    filler = tmpfs / "filler"
    items = [b"item%d" % i for i in range(1, 10)]
    async with running(make_config(data_dir, checkpoint_interval="1h")) as server:
        mc, text_port, rpc_port = (server.ports[p] for p in ("memcache", "text", "rpc"))
        producer = await Conn.open(mc)
        for data in items:
            assert await producer.set("q", data) == b"STORED"
        closer, close_open, aborter = [await Conn.open(mc) for _ in range(3)]
        assert await closer.get("q/open") == b"item1"
        assert await close_open.get("q/open") == b"item2"
        assert await aborter.get("q/open") == b"item3"
        text = await Conn.open(text_port, b"\n")
        await text.send(b"monitor q 5000 1\n")
        assert [await text.line(), await text.line()] == [b":item4", b"*"]
        rpc = Rpc(await trio.open_tcp_stream(HOST, rpc_port))
        assert await rpc.call("get", "q", 2, 0, 60_000) == (None, [[5, b"item5"],
                                                                   [6, b"item6"]])

        fill_completely(filler)
        reply = await closer.cmd(b"get q/close")
        assert reply.startswith(b"SERVER_ERROR") and NO_SPACE in reply, reply
        # /close/open: the confirm is refused, so is the whole request (the item it
        # would have opened goes back: the client never saw it)
        reply = await close_open.cmd(b"get q/close/open")
        assert reply.startswith(b"SERVER_ERROR") and NO_SPACE in reply, reply
        reply = await aborter.cmd(b"get q/abort")
        assert reply.startswith(b"SERVER_ERROR") and NO_SPACE in reply, reply
        reply = await text.cmd(b"confirm q 1")
        assert reply.startswith(b"-") and NO_SPACE in reply, reply
        error, result = await rpc.call("confirm", "q", [5, 6])
        assert result is None and NO_SPACE.decode() in error[1], error
        # Every connection is still open and usable.
        for conn in (closer, close_open, aborter):
            assert (await conn.cmd(b"version")).startswith(b"VERSION")
        assert (await text.cmd(b"version")).startswith(b":")
        assert (await rpc.call("version"))[0] is None

        # Room again: a refused confirm can be sent again, its read is still open.
        filler.unlink()
        assert await rpc.call("confirm", "q", [5]) == (None, 1)
        assert await close_open.cmd(b"get q/close") == b"END"  # item2, acknowledged
        assert await rpc.call("confirm", "q", [5]) == (None, 0)  # done already
        for conn in (producer, closer, close_open, aborter, text):
            await conn.aclose()
        await rpc.stream.aclose()

    # A clean restart: every item whose confirm was not acknowledged comes back (the
    # open reads of the connections went back when they ended), the two that were
    # acknowledged (item2, item5) never do.
    async with running(make_config(data_dir)) as server:
        got = await drain(server.ports["memcache"], "q")
    assert sorted(got) == sorted(set(items) - {b"item2", b"item5"})
