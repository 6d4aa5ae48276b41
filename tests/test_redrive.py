"""move (redrive): items go from one queue to another, each durable in the destination
before it leaves the source, with its error count and flags, rate-limited, admin only.

In-process servers on free ports for the behaviour; a `queued serve` subprocess killed
with SIGKILL in the middle of a move for the crash promise (nothing lost, at most the
item in flight twice); the CLI as a subprocess.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import msgpack
import trio
from server_util import (
    HOST,
    QUEUED,
    WAIT,
    Conn,
    ServerProcess,
    make_config,
    running,
    wait_for_stat,
)

from queued.client import AsyncClient, Client
from queued.config import ServerConfig


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


DEAD = '[queues.work]\nerror_queue = "dead"\nmax_errors = 1\n'


async def test_move_keeps_error_counts_flags_and_order(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, DEAD)) as server:
        c = await Conn.open(server.ports["memcache"])
        for i, flags in ((1, 7), (2, 0), (3, 16)):
            await c.send(b"set work %d 0 2\r\nj%d\r\n" % (flags, i))
            assert await c.line() == b"STORED"
        for i in (1, 2, 3):  # each fails once: to the dead letters, error count 1
            await c.send(b"get work/open\r\n")
            assert await c.line() == b"VALUE work/open %d 2" % (7, 0, 16)[i - 1]
            assert await c.line() == b"j%d" % i
            assert await c.line() == b"END"
            assert await c.cmd(b"get work/abort") == b"END"
        await wait_for_stat(server.ports["memcache"], "queue_dead_items", 3)  # (moved there
        address = f"{HOST}:{server.ports['rpc']}"  # in the background after each abort)
        async with AsyncClient(address) as client:
            assert await client.move("dead", "work") == 3
            assert (await client.peek("dead")).items == 0
            got = await client.get("work", 10, 0, 10_000, with_deliveries=True)
            assert [(it.data, it.flags, it.deliveries) for it in got] == [
                (b"j1", 7, 2), (b"j2", 0, 2), (b"j3", 16, 2)]
        await c.aclose()


async def test_move_takes_at_most_max_items_at_the_rate_asked(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as client:
            await client.put("src", [b"%d" % i for i in range(10)])
            assert await client.move("src", "dst", 3) == 3
            start = trio.current_time()
            assert await client.move("src", "dst", 5, rate=10) == 5  # 10/s: 0.4 s at least
            assert trio.current_time() - start >= 0.39
            assert (await client.peek("src")).items == 2
            got = await client.get("dst", 100)
            assert [it.data for it in got] == [b"%d" % i for i in range(8)]
            assert await client.move("empty", "dst") == 0


async def test_move_from_a_paused_queue(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as client:
            await client.put("src", [b"a"])
            await client.pause("src")
            assert await client.get("src", 1) == []
            assert await client.move("src", "dst") == 1  # its consumers stay off, not a move
            assert [it.data for it in await client.get("dst", 1)] == [b"a"]


async def test_move_onto_itself_is_refused(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        with socket.create_connection((HOST, server.ports["rpc"]), timeout=WAIT) as s:
            s.sendall(msgpack.packb([0, 1, "move", ["q", "q"]]))
            u = msgpack.Unpacker()
            while True:
                data = await trio.to_thread.run_sync(s.recv, 65536)
                u.feed(data)
                msgs = list(u)
                if msgs:
                    break
            assert msgs[0][2] == [3, "move: the destination is the source"]


def test_sigkill_during_a_move_loses_nothing(tmp_path: Path) -> None:
    """A move of 300 items at 150/s killed after ~80: every item is in one queue or the
    other after the restart, and at most one (the one in flight) in both."""
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    try:
        proc.start()
        address = f"{HOST}:{proc.rpc}"
        with Client(address) as c:
            assert c.put("dead", [b"item-%03d" % i for i in range(300)]) == 300
        mover = socket.create_connection((HOST, proc.rpc), timeout=WAIT)
        mover.sendall(msgpack.packb([0, 1, "move", ["dead", "work", 0, 150]]))
        with Client(address) as c:
            deadline = time.monotonic() + WAIT
            while c.peek("work").items < 80:
                assert time.monotonic() < deadline, "the move made no progress"
        proc.kill()
        mover.close()
        proc.start()
        with Client(address.rsplit(":", 1)[0] + f":{proc.rpc}") as c:
            left = [it.data for it in c.get("dead", 1000)]
            moved = [it.data for it in c.get("work", 1000)]
        assert 80 <= len(moved) < 300, len(moved)
        every = sorted(left + moved)
        assert set(every) == {b"item-%03d" % i for i in range(300)}  # nothing lost
        assert len(every) - 300 <= 1  # at most the item in flight, twice
        assert moved == sorted(moved) and left == sorted(left)  # in order, both sides
    finally:
        proc.kill()


def test_cli_move_pause_and_resume(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    try:
        proc.start()
        server = f"{HOST}:{proc.rpc}"

        def queued(*args: str) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run([str(QUEUED), *args, "--server", server],
                                  capture_output=True, timeout=WAIT * 2, check=False)

        with Client(server) as c:
            c.put("dlq", [b"a", b"b", b"c"])
        r = queued("move", "dlq", "jobs", "-n", "2", "--rate", "100")
        assert (r.returncode, r.stdout, r.stderr) == (0, b"moved 2 items\n", b"")
        assert queued("pause", "jobs").stdout == b"jobs: paused\n"
        with Client(server) as c:
            assert c.get("jobs", 10) == []  # paused
            assert c.stats()[server]["queues"]["jobs"]["paused"] == 1
        assert queued("resume", "jobs").stdout == b"jobs: resumed\n"
        with Client(server) as c:
            assert [it.data for it in c.get("jobs", 10)] == [b"a", b"b"]
            assert [it.data for it in c.get("dlq", 10)] == [b"c"]
    finally:
        proc.kill()
