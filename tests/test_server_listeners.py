"""The network shell (queued.server.listeners) over real TCP on 127.0.0.1 port 0: the
connection cap, a thousand idle connections, and the order of a clean stop on the
`shutdown` command."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import trio
from ops_util import cfg
from server_util import (
    WAIT,
    Conn,
    in_thread,
    pymc,
    running,
    wait_for_stat,
)

from queued import __version__
from queued.server.app import serve


@pytest.mark.parametrize("proto", ["memcache", "text"])
async def test_shutdown_command_stops_the_server(tmp_path: Path, proto: str) -> None:
    config = cfg(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            client = pymc(server.ports["memcache"])
            try:
                assert await in_thread(lambda: client.set("q", b"x"))
                if proto == "memcache":
                    await in_thread(client.shutdown)
                else:
                    t = await Conn.open(server.ports["text"], newline=b"\n")
                    await t.send(b"shutdown\n")
                    assert await t.expect_closed() == b""
            finally:
                client.close()
        # Reaching here means serve() returned.
        assert server.shutdown_requested.is_set()
        async with running(config) as again:
            c = await Conn.open(again.ports["memcache"])
            assert await c.get("q") == b"x"
            await c.aclose()


async def test_max_connections_refuses_more(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, "[server]\nmax_connections = 2\n")) as server:
        port = server.ports["memcache"]
        a, b = await Conn.open(port), await Conn.open(port)
        assert await a.cmd(b"version") == b"VERSION " + __version__.encode()
        assert await b.cmd(b"version") == b"VERSION " + __version__.encode()
        c = await Conn.open(port)
        assert (await c.line()).startswith(b"SERVER_ERROR")
        await c.expect_closed()
        await b.aclose()
        with trio.fail_after(WAIT):
            while True:  # the freed slot is usable once the server has seen b go
                d = await Conn.open(port)
                try:
                    reply = await d.cmd(b"version")
                except (EOFError, trio.BrokenResourceError):
                    reply = b""
                await d.aclose()
                if reply.startswith(b"VERSION"):
                    break
                await trio.sleep(0.02)
        await a.aclose()


async def test_a_thousand_idle_connections(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2200:
        pytest.skip("cannot raise RLIMIT_NOFILE enough for 1000 connections")
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        idle: list[trio.SocketStream] = []
        try:
            with trio.fail_after(30):
                for _ in range(1000):
                    idle.append(await trio.open_tcp_stream("127.0.0.1", port))
                await wait_for_stat(port, "curr_connections", 1001, timeout=20)
            client = pymc(port)
            try:
                assert await in_thread(lambda: client.set("busy", b"still works"))
                assert await in_thread(lambda: client.get("busy")) == b"still works"
                stats = await in_thread(client.stats)
                assert stats[b"curr_connections"] == 1001
            finally:
                client.close()
        finally:
            for s in idle:
                s.socket.close()
        await wait_for_stat(port, "curr_connections", 1, timeout=20)
