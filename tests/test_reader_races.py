"""Readers under races and at the edges: takeovers, deletes and checkpoints racing with
gets and long polls, new readers created while puts land, and the errors a session gives
for names too long together, monitors past max_open_reads, failing checkpoint writes and
floods of peeks at a big item.

Races are made deterministic by gating the journal's checkpoint methods on trio Events
instead of sleeping."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from compiled_util import not_compiled
from server_util import WAIT, Conn, make_config, running

from queued.broker.upkeep import open_broker
from queued.config import ServerConfig
from queued.reader.open_reads import OpenReads
from queued.storage import fileio

MiB = 1 << 20
HOUR = 3_600_000


def broker_config(tmp_path: Path, **settings: Any) -> ServerConfig:
    """No background checkpoints or sweeps unless a test runs them."""
    return make_config(tmp_path / "data", fsync="never", checkpoint_interval=HOUR,
                       expiration_timer=HOUR, **settings)


def gate_after(
    original: Callable[..., Awaitable[None]], reader: str, entered: trio.Event, gate: trio.Event
) -> Callable[..., Awaitable[None]]:
    """`original` (a journal method), which for `reader` pauses at `gate` once it is done."""

    async def wrapper(name: str, *args: Any) -> None:
        await original(name, *args)
        if name == reader:
            entered.set()
            await gate.wait()

    return wrapper


def gate_before(
    original: Callable[..., Awaitable[None]], reader: str, entered: trio.Event, gate: trio.Event
) -> Callable[..., Awaitable[None]]:
    """`original` (a journal method), which for `reader` first waits at `gate`."""

    async def wrapper(name: str, *args: Any) -> None:
        if name == reader:
            entered.set()
            await gate.wait()
        await original(name, *args)

    return wrapper


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def still_serving(port: int, conn: Conn | None = None) -> None:
    """The server answers on a new connection (and on `conn`, if given)."""
    fresh = await Conn.open(port)
    try:
        assert (await fresh.cmd(b"version")).startswith(b"VERSION ")
    finally:
        await fresh.aclose()
    if conn is not None:
        assert (await conn.cmd(b"version")).startswith(b"VERSION ")


# -- (1) errors inside a long poll ---------------------------------------------------------


async def test_long_poll_get_with_names_too_long_together_is_a_client_error(
    tmp_path: Path,
) -> None:
    key = "a" * 200 + "+" + "b" * 200
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        conn = await Conn.open(port)
        reply = await conn.cmd(b"get %s/t=10" % key.encode())
        assert reply.startswith(b"CLIENT_ERROR "), reply
        assert b"too long" in reply
        await still_serving(port, conn)
        await conn.aclose()


async def test_monitor_past_max_open_reads_is_a_client_error(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data", max_open_reads=2)) as server:
        port = server.ports["memcache"]
        conn = await Conn.open(port)
        for data in (b"a", b"b", b"c"):
            assert await conn.set("q", data) == b"STORED"
        await conn.send(b"monitor q 1 10\r\n")
        assert await conn.read_block("q") == b"a"
        assert await conn.read_block("q") == b"b"
        reply = await conn.line()
        assert reply.startswith(b"CLIENT_ERROR "), reply
        assert b"too many open reads" in reply
        await still_serving(port, conn)
        await conn.aclose()


# -- (2) delete q+name after a takeover ----------------------------------------------------


@pytest.mark.parametrize("end", ["abort", "close"])
async def test_delete_of_takeover_reader_keeps_open_reads_of_new_default_reader(
    tmp_path: Path, end: str
) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        x, a = await Conn.open(port), await Conn.open(port)
        assert await x.set("q", b"a") == b"STORED"
        assert await x.get("q+audit/peek") == b"a"  # takeover: audit owns the backlog
        assert await x.get("q/peek") is None  # a new default reader, at the tail
        assert await x.set("q", b"d") == b"STORED"
        assert await a.get("q/open") == b"d"  # open on the new default reader
        assert await x.cmd(b"delete q+audit") == b"DELETED"
        assert await a.get(f"q/{end}") is None
        if end == "abort":
            assert await x.get("q") == b"d"  # it went back, it was not lost
        else:
            stats = await x.stats()
            assert stats["queue_q_open_transactions"] == "0"
            assert stats["queue_q_items"] == "0"
        await x.aclose()
        await a.aclose()


# -- (3) takeover racing the checkpoint timer ----------------------------------------------


@not_compiled("gates QueueJournal.remove_reader on the instance, which a compiled class "
              "does not allow")
async def test_checkpoint_during_takeover_does_not_bring_back_default_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = broker_config(tmp_path)
    async with open_broker(cfg) as b:
        await b.put("q", [b"1", b"2", b"3", b"4"])
        qs = b.queues["q"]
        removed, gate = trio.Event(), trio.Event()
        # The takeover pauses right after q.read. is gone, before the reader is renamed.
        monkeypatch.setattr(qs.journal, "remove_reader",
                            gate_after(qs.journal.remove_reader, "", removed, gate))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(b.get, "q", "x", peek=True))
            await removed.wait()
            got = await b.get("q")  # consumes through the reader being taken over: dirty
            assert got is not None
            assert got.data == b"1"
            nursery.start_soon(b.checkpoint_all)  # the checkpoint timer fires
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        await b.checkpoint_all()
        assert "q.read." not in os.listdir(cfg.data_dir)
        assert set(qs.journal.readers) == {"x"}
    async with open_broker(cfg) as b:
        assert set(b.queues["q"].readers) == {"x"}
        got = await b.get("q", "x")
        assert got is not None
        assert got.data == b"2"


# -- (4) a flood of peeks of a big item ----------------------------------------------------


async def test_peek_flood_of_big_item_streams_replies_with_bounded_memory(
    tmp_path: Path,
) -> None:
    n = 300
    item = b"x" * MiB
    async with running(make_config(tmp_path / "data", fsync="never")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("q", item) == b"STORED"
        counters = server.broker.counters
        before = rss_bytes()
        await conn.send(b"get q/peek\r\n" * n)  # and read nothing yet
        # Wait until the server stops making progress (blocked on a full socket).
        last = -1
        with trio.fail_after(WAIT):
            while counters.cmd_peek == 0 or counters.cmd_peek != last:
                last = counters.cmd_peek
                await trio.sleep(0.2)
        grown = rss_bytes() - before
        stalled_at = counters.cmd_peek
        assert grown < 150 * MiB, f"RSS grew {grown // MiB} MiB for an unread reply stream"
        assert stalled_at < n, "the whole batch was answered into memory before sending"
        # Every reply still arrives, in full.
        one = b"VALUE q/peek 0 %d\r\n%s\r\nEND\r\n" % (MiB, item)
        want = n * len(one)
        received = len(conn.buf)
        first = bytes(conn.buf)
        with trio.fail_after(WAIT):
            while received < want:
                chunk = await conn.stream.receive_some(4 * MiB)
                assert chunk, "connection closed early"
                if len(first) < len(one):
                    first += chunk[: len(one) - len(first)]
                received += len(chunk)
        assert received == want
        assert first[: len(one)] == one
        assert counters.cmd_peek == n
        await conn.aclose()


# -- (6) an OSError from a checkpoint write ------------------------------------------------


class NoSpaceForCheckpoints(fileio.FileIO):
    """The storage layer's file calls: a checkpoint's temp file cannot be created."""

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        if ".read." in str(path) and str(path).endswith("~~"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().open(path, flags, mode)


async def test_checkpoint_write_oserror_is_a_server_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        conn = await Conn.open(port)
        assert await conn.set("q", b"a") == b"STORED"
        monkeypatch.setattr(fileio, "_current", NoSpaceForCheckpoints())  # the disk fills up
        await conn.send(b"get q+r\r\nget q+s/t=50\r\n")
        for _ in range(2):
            reply = await conn.line()
            assert reply.startswith(b"SERVER_ERROR "), reply
            assert b"No space left" in reply
        await still_serving(port, conn)
        monkeypatch.undo()  # space again: the failed takeover left nothing half done
        assert await conn.get("q+r") == b"a"
        await conn.aclose()


# -- (7) a get that finishes after its queue was deleted -----------------------------------


async def test_get_finishing_after_queue_delete_leaves_no_stale_open_read(
    tmp_path: Path,
) -> None:
    async with open_broker(broker_config(tmp_path)) as b:
        a, c = b.register(OpenReads("A")), b.register(OpenReads("B"))
        b.registry.queue("q")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(b.get, "q", timeout_ms=int(WAIT * 1000), client=a,
                                       open=True))
            await trio.testing.wait_all_tasks_blocked()
            await b.put("q", [b"old"])  # handed to A's waiting get...
            await b.delete("q")  # ...and the queue is deleted before that get finishes
        assert a.open_ids("q", "") == []
        await b.put("q", [b"new"])  # re-created: ids start again at 1
        it = await b.get("q", client=c, open=True)
        assert it is not None
        assert it.data == b"new"
        assert b.confirm(a, "q") == 0  # A has nothing open here
        b.release(c)  # B goes away without confirming: its item goes back
        again = await b.get("q")
        assert again is not None
        assert again.data == b"new"


# -- (8) a long-poll open read waiting across a takeover -----------------------------------


async def test_open_long_poll_waiting_across_takeover_is_closed_by_plain_name(
    tmp_path: Path,
) -> None:
    async with open_broker(broker_config(tmp_path)) as b:
        a = b.register(OpenReads("A"))
        got: list[Any] = []

        async def waiter() -> None:  # get q/t=.../open
            got.append(await b.get("q", timeout_ms=int(WAIT * 1000), client=a, open=True))

        b.registry.queue("q")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            await b.get("q", "x", peek=True)  # another client's first q+x takes over
            await b.put("q", [b"job"])
        assert got[0] is not None
        assert got[0].data == b"job"
        assert a.open_ids("q", "") == [got[0].id]
        assert b.confirm(a, "q") == 1  # get q/close
        assert a.open == {}
        assert b.queues["q"].readers["x"].reader.open == {}
        assert await b.get("q", "x") is None  # confirmed, gone


# -- (9) puts delivered while a new reader's checkpoint is written -------------------------


@not_compiled("gates QueueJournal.write_checkpoint on the instance, which a compiled class "
              "does not allow")
async def test_new_reader_sees_puts_made_while_its_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_broker(broker_config(tmp_path)) as b:
        await b.get("q", "a", peek=True)  # a takes over the default reader
        await b.get("q", peek=True)  # and a new default reader
        qs = b.queues["q"]
        writing, gate = trio.Event(), trio.Event()
        monkeypatch.setattr(qs.journal, "write_checkpoint",
                            gate_before(qs.journal.write_checkpoint, "b", writing, gate))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(b.get, "q", "b", peek=True))  # new reader b
            await writing.wait()
            await b.put("q", [b"during"])  # durable while b's checkpoint is being written
            gate.set()
        await b.put("q", [b"after"])
        seen = []
        while (it := await b.get("q", "b")) is not None:
            seen.append(it.data)
        assert seen == [b"during", b"after"]


# -- monitor echoes the reader -------------------------------------------------------------


async def test_monitor_of_named_reader_echoes_queue_plus_reader(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("q", b"a") == b"STORED"
        await conn.send(b"monitor q+r 1 1\r\n")
        assert await conn.read_block("q+r") == b"a"
        assert await conn.line() == b"END"
        assert await conn.cmd(b"confirm q+r 1") == b"END"
        await conn.aclose()
