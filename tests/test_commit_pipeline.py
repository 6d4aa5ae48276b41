"""The pipelined commit under fsync "always" (queued.storage.pipeline, the reactor's
`_answer`): a pass's sync runs on a thread of its own while the next passes run; the
passes written meanwhile share the next sync; replies go in order, only once durable; a
failed sync fails what it covered and every later append to those files; a stop with a
sync under way still answers and keeps what it acknowledged."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import trio
from server_util import Conn, make_config, running

from queued.storage import fileio


class SlowFsync(fileio.FileIO):
    """fsyncs that take `seconds` longer (a disk busy with another's writes)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    def fsync(self, fd: int) -> None:
        self.calls += 1
        time.sleep(self.seconds)
        super().fsync(fd)


class FsyncFailsOnce(fileio.FileIO):
    """The first fsync after `armed` is set fails with EIO after `seconds`; the others
    succeed (as Linux reports a write-back error once)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = threading.Event()
        self.failed = threading.Event()

    def fsync(self, fd: int) -> None:
        if self.armed.is_set() and not self.failed.is_set():
            time.sleep(self.seconds)
            self.failed.set()
            raise OSError(errno.EIO, "Input/output error")
        super().fsync(fd)


def config(tmp_path: Path):  # type: ignore[no-untyped-def]
    return make_config(tmp_path / "data", fsync="always")


async def test_sets_sent_during_a_sync_share_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's set starts a sync of 0.3 s; the sets B, C and D send meanwhile are run and
    written in passes of their own, and share one sync once A's ends: two syncs for
    four sets, each answered STORED only after its sync."""
    async with running(config(tmp_path)) as server:
        assert server.reactor is not None
        pipeline = server.broker.datadir.pipeline
        port = server.ports["memcache"]
        conns = [await Conn.open(port) for _ in range(4)]
        for i, conn in enumerate(conns):  # each queue's segment open before the test
            assert await conn.set(f"q{i}", b"warm") == b"STORED"
        syncs, overlapped = pipeline.syncs, server.reactor.statistics().overlapped
        slow = SlowFsync(0.3)
        monkeypatch.setattr(fileio, "_current", slow)
        await conns[0].send(b"set q0 0 0 1\r\na\r\n")
        await trio.sleep(0.05)  # A's pass has run: its sync is under way
        for i, conn in enumerate(conns[1:], 1):
            await conn.send(b"set q%d 0 0 1\r\n%d\r\n" % (i, i))
        for conn in conns:
            assert await conn.line() == b"STORED"
        monkeypatch.undo()
        assert pipeline.syncs - syncs == 2 and slow.calls == 4  # (one file each)
        assert server.reactor.statistics().overlapped > overlapped
        for i, conn in enumerate(conns):
            assert await conn.get(f"q{i}") == b"warm"
            assert await conn.get(f"q{i}") == (b"a" if i == 0 else b"%d" % i)
            await conn.aclose()


async def test_a_connections_requests_keep_their_order_while_syncs_overlap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One connection pipelines sets and gets of one queue in one write while another
    keeps syncs under way: each get sees the set before it, and the replies come in the
    order sent."""
    async with running(config(tmp_path)) as server:
        port = server.ports["memcache"]
        conn, other = await Conn.open(port), await Conn.open(port)
        assert await conn.set("q", b"v0") == b"STORED"
        assert await other.set("busy", b"x") == b"STORED"
        monkeypatch.setattr(fileio, "_current", SlowFsync(0.02))
        n = 20
        async with trio.open_nursery() as nursery:
            async def keep_busy() -> None:
                for _ in range(n):
                    assert await other.set("busy", b"x") == b"STORED"

            nursery.start_soon(keep_busy)
            await conn.send(b"".join(b"get q\r\nset q 0 0 %d\r\nv%d\r\n" % (
                len(b"v%d" % (i + 1)), i + 1) for i in range(n)) + b"get q\r\n")
            for i in range(n + 1):
                assert await conn.line() == b"VALUE q 0 %d" % len(b"v%d" % i)
                assert await conn.line() == b"v%d" % i
                assert await conn.line() == b"END"
                if i < n:
                    assert await conn.line() == b"STORED"
        monkeypatch.undo()
        await conn.aclose()
        await other.aclose()


async def test_a_failed_sync_fails_its_sets_and_every_later_one_to_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's set is in a sync that fails (EIO); B's set to the same queue, written while
    that sync ran, is in the next sync, which succeeds: both are refused all the same
    (the queue's file refuses writes after a failed fsync, as Linux reports the error
    once). Both connections stay open; another queue takes sets as before."""
    async with running(config(tmp_path)) as server:
        port = server.ports["memcache"]
        a, b = await Conn.open(port), await Conn.open(port)
        assert await a.set("q", b"kept") == b"STORED"
        assert await b.set("other", b"x") == b"STORED"
        failing = FsyncFailsOnce(0.2)
        monkeypatch.setattr(fileio, "_current", failing)
        failing.armed.set()
        await a.send(b"set q 0 0 1\r\na\r\n")
        await trio.sleep(0.05)
        await b.send(b"set q 0 0 1\r\nb\r\n")
        assert (await a.line()).startswith(b"SERVER_ERROR")
        assert (await b.line()).startswith(b"SERVER_ERROR")
        assert failing.failed.is_set()
        assert (await a.set("q", b"c")).startswith(b"SERVER_ERROR")
        assert await b.set("other", b"y") == b"STORED"
        monkeypatch.undo()
        assert await a.get("q") == b"kept"
        assert await b.get("other") == b"x"
        await a.aclose()
        await b.aclose()


async def test_a_stop_during_a_sync_answers_the_set_and_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server is told to stop while a set's sync is under way: the set is answered
    STORED before the connection closes, and is there after a restart."""
    cfg = config(tmp_path)
    async with running(cfg) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("q", b"first") == b"STORED"
        monkeypatch.setattr(fileio, "_current", SlowFsync(0.3))
        await conn.send(b"set q 0 0 6\r\nsecond\r\n")
        await trio.sleep(0.05)
        server.request_shutdown("a test stops it")
        assert await conn.line() == b"STORED"
        monkeypatch.undo()
        await conn.aclose()
    async with running(cfg) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.get("q") == b"first"
        assert await conn.get("q") == b"second"
        await conn.aclose()
