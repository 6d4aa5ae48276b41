"""Crash tests for durable confirms and abort error counts (issue 18, point 1).

`queued serve` runs as a subprocess with fsync "always" and a checkpoint interval of an
hour, so no periodic checkpoint can hide a confirm that was not made durable when it was
acknowledged. Each test acknowledges a burst of confirms (or aborts) over a real socket,
SIGKILLs the server right after the last acknowledgement, restarts it on the same data
directory and checks that not one confirmed item comes back (and that every unconfirmed
one does), or that abort error counts survived.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio
import trio.testing
from server_util import (
    HOST,
    WAIT,
    Conn,
    ServerProcess,
    gets_until_dry,
    killed_at_end,
    make_config,
    pymc,
    running,
    send_lines,
)

from queued.client import Client
from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.errors import JournalWriteError
from queued.storage import fileio
from queued.storage.files import read_checkpoint
from queued.storage.journal import wait_durable
from queued.storage.opening import open_data_dir

pytestmark = pytest.mark.slow

CONFIG = """
[server]
checkpoint_interval = "1h"  # no checkpoint during a test: only the confirms' own writes

[default]
fsync = "always"

[queues.e]
max_errors = 3
error_queue = "dead"
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A ServerProcess (not yet started) that is always SIGKILLed by PID at the end."""
    yield from killed_at_end(tmp_path, CONFIG)


def put_all(server: ServerProcess, queue: str, values: list[bytes]) -> None:
    batch = b"".join(b"set %s 0 0 %d\r\n%s\r\n" % (queue.encode(), len(v), v) for v in values)
    assert send_lines(server.memcache, batch, until=b"STORED\r\n" * len(values)) == (
        b"STORED\r\n" * len(values))


def drain(server: ServerProcess, queue: str, limit: int = 2000) -> list[bytes]:
    client = pymc(server.memcache)
    try:
        return gets_until_dry(client, queue, limit)
    finally:
        client.close()


def values(n: int, prefix: bytes = b"v") -> list[bytes]:
    return [b"%s-%04d" % (prefix, i) for i in range(n)]


def test_confirms_one_by_one_do_not_come_back_after_a_kill(server: ServerProcess) -> None:
    """The issue's report: 400 items read and confirmed with `get q/close/open`, one
    request at a time, SIGKILL right after the last END: none may come back."""
    server.start()
    items = values(400)
    put_all(server, "q", items)
    client = pymc(server.memcache)
    try:
        got = [client.get("q/open")]
        got += [client.get("q/close/open") for _ in range(len(items) - 1)]
        assert client.get("q/close") is None  # the last END: every confirm acknowledged
        assert got == items
        server.kill()
    finally:
        client.close()
    server.start()
    assert drain(server, "q") == []


def test_pipelined_confirm_burst_survives_a_kill(server: ServerProcess) -> None:
    """One pipelined burst of `get q/close/open` (one batch, one group commit): of 300
    items, the 200 confirmed ones stay gone, the open one and the unread ones return."""
    server.start()
    items = values(300)
    put_all(server, "q", items)
    n = 200
    burst = b"get q/open\r\n" + b"get q/close/open\r\n" * n
    with socket.create_connection((HOST, server.memcache), timeout=WAIT) as s:
        s.sendall(burst)
        keys = [b"q/open"] + [b"q/close/open"] * n  # VALUE echoes the key as sent
        want = b"".join(b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (k, len(v), v)
                        for k, v in zip(keys, items, strict=False))
        got = b""
        while len(got) < len(want):
            chunk = s.recv(65536)
            assert chunk, got[-200:]
            got += chunk
        assert got == want
        server.kill()  # the open read (item n) was never confirmed
    server.start()
    assert drain(server, "q") == items[n:]


def test_rpc_confirms_survive_a_kill(server: ServerProcess) -> None:
    """RPC `confirm` of reliable reads taken in batches: confirmed ids stay gone; an
    unconfirmed open read and the rest come back, in order."""
    server.start()
    items = values(250)
    put_all(server, "q", items)
    with Client(f"{HOST}:{server.rpc}", read_timeout=WAIT) as c:
        confirmed: list[bytes] = []
        for _ in range(4):
            batch = c.get("q", 50, 0, 60_000)
            assert c.confirm(batch) == len(batch)
            confirmed += [it.data for it in batch]
        held = c.get("q", 10, 0, 60_000)  # open, never confirmed
        assert [it.data for it in held] == items[200:210]
        server.kill()
    assert confirmed == items[:200]
    server.start()
    assert drain(server, "q") == items[200:]


def test_text_protocol_confirms_survive_a_kill(server: ServerProcess) -> None:
    """The text protocol's `monitor` opens reads and `confirm q n` confirms them."""
    server.start()
    items = values(30)
    put_all(server, "q", items)
    with socket.create_connection((HOST, server.text), timeout=WAIT) as s:
        f = s.makefile("rb")
        s.sendall(b"monitor q 1000 20\n")
        got = [f.readline() for _ in range(21)]
        assert got == [b":" + v + b"\n" for v in items[:20]] + [b"*\n"]
        s.sendall(b"confirm q 15\n")
        assert f.readline() == b"+15\n"
        server.kill()  # 5 reads still open
    server.start()
    assert drain(server, "q") == items[15:]


def test_abort_error_counts_survive_a_kill(server: ServerProcess) -> None:
    """Queue e moves an item to `dead` on its 3rd abort. Two acknowledged aborts, a
    kill, one more abort after the restart: the item must go to `dead` (count 3), not
    stay in e with a count started again from the journal's 0."""
    server.start()
    put_all(server, "e", [b"poison", b"fine"])
    client = pymc(server.memcache)
    try:
        for _ in range(2):
            assert client.get("e/open") == b"poison"
            assert client.get("e/abort") is None  # acknowledged
        server.kill()
    finally:
        client.close()
    server.start()
    client = pymc(server.memcache)
    try:
        assert client.get("e/open") == b"poison"
        assert client.get("e/abort") is None
    finally:
        client.close()
    # The move to the error queue is a put of its own: wait for it through `dead`.
    poisoned = pymc(server.memcache)
    try:
        assert poisoned.get("dead/t=5000") == b"poison"
    finally:
        poisoned.close()
    assert drain(server, "e") == [b"fine"]


def test_rpc_abort_error_counts_survive_a_kill(server: ServerProcess) -> None:
    """The same over RPC: `abort` of a batch counts an error for each, durably."""
    server.start()
    put_all(server, "e", values(5, b"e"))
    with Client(f"{HOST}:{server.rpc}", read_timeout=WAIT) as c:
        for _ in range(2):
            batch = c.get("e", 5, 0, 60_000)
            assert len(batch) == 5
            assert c.abort(batch) == 5
        server.kill()
    server.start()
    with Client(f"{HOST}:{server.rpc}", read_timeout=WAIT) as c:
        batch = c.get("e", 5, 0, 60_000)
        assert c.abort(batch) == 5
        dead: list[bytes] = []
        for _ in range(50):
            dead += [it.data for it in c.get("dead", 5, 500)]
            if len(dead) >= 5:
                break
    assert sorted(dead) == values(5, b"e")
    assert drain(server, "e") == []


class ReaderFilesFail(fileio.FileIO):
    """The storage layer's file calls: appends to readers' checkpoint files fail (EIO)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.names[fd] = Path(path).name
        return fd

    def writev(self, fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        if ".read." in self.names.get(fd, ""):
            raise OSError(errno.EIO, "Input/output error")
        return super().writev(fd, buffers)


async def test_a_confirm_that_cannot_be_made_durable_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confirm whose append fails is answered with an error, on a connection that stays
    open, and undone: its read is open again. The item a refused `/close/open` would have
    opened goes back to the queue (its reply was not sent). After a write error other than
    a full disk the reader's file refuses appends until restart: later confirms are
    refused the same way."""
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        conn = await Conn.open(port)
        for v in (b"a", b"b", b"c"):
            assert await conn.set("q", v) == b"STORED"
        assert await conn.get("q/open") == b"a"
        monkeypatch.setattr(fileio, "_current", ReaderFilesFail())
        await conn.send(b"set q 0 0 1\r\nd\r\nget q/close/open\r\nget q/close\r\n")
        replies = [await conn.line() for _ in range(3)]
        assert replies[0] == b"STORED"
        for reply in replies[1:]:
            assert reply.startswith(b"SERVER_ERROR confirm not durable"), reply
            assert b"Input/output error" in reply
        monkeypatch.undo()
        other = await Conn.open(port)
        assert [await other.get("q") for _ in range(4)] == [b"b", b"c", b"d", None]
        assert (await conn.cmd(b"get q/close")).startswith(b"SERVER_ERROR")  # until restart
        await conn.aclose()  # its read of a goes back
        assert await other.get("q/t=5000") == b"a"
        await other.aclose()


class ReaderAppendHeld(fileio.FileIO):
    """The first append to a reader's checkpoint file waits for `go`, then fails with
    ENOSPC (refused, not fatal: later writes to the file work)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.entered = threading.Event()
        self.go = threading.Event()

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.names[fd] = Path(path).name
        return fd

    def writev(self, fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        if self.names.get(fd, "").endswith(".read.") and not self.entered.is_set():
            self.entered.set()
            self.go.wait(WAIT)
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().writev(fd, buffers)


async def test_a_checkpoint_planned_while_a_refused_confirm_was_written_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint taken while a confirm's append is being written counts that confirm as
    done; if the append is refused, the confirm is undone, so that checkpoint must not be
    written (it would make the refused confirm durable after all)."""
    cfg = JournalConfig(fsync=FsyncPolicy.parse("always"))
    async with open_data_dir(tmp_path / "data", DataDirConfig(), lambda _q: cfg) as dd:
        q = dd.queue("q")
        await q.append([b"a", b"b"], 1)
        await q.write_checkpoint("", 0)
        fake = ReaderAppendHeld()
        monkeypatch.setattr(fileio, "_current", fake)
        confirm = q.note_read("", done=[1])
        await trio.to_thread.run_sync(fake.entered.wait, WAIT)  # the round is writing it
        refused: list[JournalWriteError] = []

        async def checkpoint() -> None:
            # head 1: the checkpoint a reader holding the confirm as done would take
            try:
                await q.write_checkpoint("", 1)
            except JournalWriteError as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(checkpoint)
            await trio.testing.wait_all_tasks_blocked()
            fake.go.set()
            with pytest.raises(JournalWriteError, match="No space left"):
                await wait_durable(confirm)
        assert refused, "the checkpoint was written"
        monkeypatch.undo()
        assert q.readers[""].head == 0
    assert read_checkpoint(tmp_path / "data" / "q.read.").head == 0
