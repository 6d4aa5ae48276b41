"""Deduplication keys through the server: memcache `set q/key=<k>`, text `put q key=<k>:`,
RPC put's eighth param.

A real server on free 127.0.0.1 ports and real clients (pymemcache, raw sockets, the
spec-only msgpack client of test_rpc_server.py): a put whose key was stored within the
queue's dedup_window stores nothing and is answered as success; past the window it is
stored again; the table is durable with the items (restart, after the items were
consumed and their segments compacted away, SIGKILL); `delete` drops it, `flush` keeps
it; max_dedup_keys and its counters; two puts of one key in one pass store one. The pure
table and the DEDUP record are tested in test_reader_dedup.py.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest
import trio
from disk_util import fill
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journal_util import COMPACTING, checked, dumped, segments, wait_compacted
from ops_util import NONE, scrape
from rpc_util import Rpc
from server_util import (
    Conn,
    killed_at_end,
    make_config,
    pymc,
    recv_until,
    running,
    served_sockets,
)
from wait_util import wait_until

from queued.config import ServerConfig
from queued.journal import format as jf
from queued.wire.rpc_protocol import ErrorCode

E = ErrorCode


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def drain(c: Rpc, queue: str) -> list[bytes]:
    return [data for _, data in await c.call("get", queue, 1000)]


def keyed(key: bytes | str, queue: str = "q") -> tuple[object, ...]:
    """The params of an RPC put's eighth param onwards: `put(queue, items, 0, 0, 0, nil,
    nil, key)` with the items left to the caller."""
    return (0, 0, 0, None, None, key)


def mc_set(queue_key: bytes, data: bytes) -> bytes:
    return b"set %s 0 0 %d\r\n%s\r\n" % (queue_key, len(data), data)


# -- each protocol ---------------------------------------------------------------------------


async def test_memcache_set_with_a_key_is_stored_once(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        mc = pymc(server.ports["memcache"])
        try:
            # pymemcache sends the key as given: the queue, then its options.
            assert await trio.to_thread.run_sync(mc.set, "q/key=order-17", b"a") is True
            assert await trio.to_thread.run_sync(mc.set, "q/key=order-17", b"a") is True
            assert await trio.to_thread.run_sync(mc.set, "q/key=order-18/delay=0", b"b")
            assert await trio.to_thread.run_sync(mc.set, "q/delay=0/key=order-18", b"b")
            assert await trio.to_thread.run_sync(mc.set, "q", b"c")  # no key: always stored
            assert await trio.to_thread.run_sync(mc.get, "q") == b"a"
            assert await trio.to_thread.run_sync(mc.get, "q") == b"b"
            assert await trio.to_thread.run_sync(mc.get, "q") == b"c"
            assert await trio.to_thread.run_sync(mc.get, "q") is None
            stats = server.broker.registry.dedup_counters
            assert stats.duplicates == 2
        finally:
            mc.close()


async def test_text_put_with_a_key_is_stored_once(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Conn.open(server.ports["text"], b"\n")
        # The key names the whole put (its items); the repeat is answered as it was.
        assert await c.cmd(b"put q key=batch-1:\na\nb\n") == b"+2"
        assert await c.cmd(b"put q key=batch-1:\na\nb\n") == b"+2"
        assert await c.cmd(b"put q 60000 key=batch-2 delay=0:\nc\n") == b"+1"
        # Options come last; a refused put's items are skipped, nothing stored.
        assert (await c.cmd(b"put q delay=0 60000 key=batch-2:\nc\n")).startswith(b"-")
        assert await c.cmd(b"put q delay=0 key=batch-2:\nc\n") == b"+1"
        for want in (b":a", b":b", b":c"):
            assert await c.cmd(b"get q") == want
        assert await c.cmd(b"get q") == b"*"
        await c.aclose()


async def test_rpc_put_with_a_key_is_flagged_when_a_duplicate(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a", b"b"], *keyed(b"k1")) == [2, 1, False]
        assert await c.call("put", "q", [b"a", b"b"], *keyed(b"k1")) == [2, 1, True]
        # A str key is its UTF-8 bytes; the content of a duplicate is not compared.
        assert await c.call("put", "q", [b"other"], *keyed("k1")) == [2, 1, True]
        assert await c.call("put", "q", [b"c"], *keyed("k\u00e9")) == [1, 3, False]
        assert await c.call("put", "q", [b"c"], *keyed("k\u00e9".encode())) == [1, 3, True]
        # A nil key is a plain put; a key is per queue.
        assert await c.call("put", "q", [b"d"], 0, 0, 0, None, None, None) == 1
        assert await c.call("put", "other", [b"x"], *keyed(b"k1")) == [1, 1, False]
        assert await drain(c, "q") == [b"a", b"b", b"c", b"d"]
        await c.aclose()


async def test_keys_are_checked_and_a_bad_one_stores_nothing(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        for bad in (b"", b"k" * 65, 17, [b"k"]):
            code, message = await c.error("put", "q", [b"a"], *keyed(bad))  # type: ignore[arg-type]
            assert code == E.BAD_PARAMS and "key must be 1 to 64 bytes" in message
        code, message = await c.error("put", "q", [b"a"], 0, 0, 0, b"p", 1, b"k")
        assert code == E.BAD_PARAMS and "not both" in message
        assert (await c.error("put", "q", [], *keyed(b"k")))[0] == E.BAD_PARAMS
        assert await c.call("put", "q", [b"a"], *keyed(b"k" * 64)) == [1, 1, False]
        assert await c.call("put", "q", [b"\x00"], *keyed(b"\x00\xff/ ")) == [1, 2, False]

        m = await Conn.open(server.ports["memcache"])
        for key in (b"q/key=", b"q/key=" + b"k" * 65, b"q/key=a/key=b", b"q/keys=a",
                    b"q/key=a/delay=1/delay=2", b"q/key=\xc3\xa9"):
            await m.send(mc_set(key, b"x"))
            reply = await m.line()
            assert reply.startswith(b"CLIENT_ERROR "), (key, reply)
        assert await m.cmd(b"version") != b""  # the connection stays, in step
        await m.aclose()

        t = await Conn.open(server.ports["text"], b"\n")
        for line in (b"put q key=:", b"put q key=" + b"k" * 65 + b":", b"put q key=a key=b:",
                     b"put q key=a/b:", b"put q colour=red:"):
            reply = await t.cmd(line + b"\nx\n")
            assert reply.startswith(b"-"), (line, reply)
        assert await t.cmd(b"put q key=" + b"t" * 64 + b":\ny\n") == b"+1"
        await t.aclose()
        assert await drain(c, "q") == [b"a", b"\x00", b"y"]
        await c.aclose()


async def test_one_key_across_protocols_is_one_put(tmp_path: Path) -> None:
    """The table is the queue's, not a protocol's: a key set over memcache is a duplicate
    over text and RPC."""
    async with running(cfg(tmp_path)) as server:
        m = await Conn.open(server.ports["memcache"])
        await m.send(mc_set(b"q/key=shared", b"once"))
        assert await m.line() == b"STORED"
        t = await Conn.open(server.ports["text"], b"\n")
        assert await t.cmd(b"put q key=shared:\nonce\n") == b"+1"
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"once"], *keyed(b"shared")) == [1, 1, True]
        assert await drain(c, "q") == [b"once"]
        for conn in (m, t, c):
            await conn.aclose()


# -- the window ------------------------------------------------------------------------------


async def test_a_key_is_a_duplicate_within_the_window_and_stored_again_past_it(
        tmp_path: Path) -> None:
    """The broker's clock (unix ms) moved forward: at exactly dedup_window after the put
    the key is still seen; a millisecond later it is stored again. A duplicate does not
    extend the window."""
    toml = '[queues.q]\ndedup_window = "2s"\n'
    async with running(cfg(tmp_path, toml)) as server:
        base = server.broker.clock()
        now = [base]
        server.broker.clock = lambda: now[0]
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, False]
        now[0] = base + 1_000
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, True]
        now[0] = base + 2_000
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, True]
        now[0] = base + 2_001
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 2, False]
        # Another queue keeps the default window (5 minutes).
        assert await c.call("put", "r", [b"x"], *keyed(b"k")) == [1, 1, False]
        now[0] = base + 5 * 60_000 + 2_000
        assert await c.call("put", "r", [b"x"], *keyed(b"k")) == [1, 1, True]
        assert server.broker.registry.dedup_counters.expired == 1
        assert await drain(c, "q") == [b"a", b"a"]
        await c.aclose()


# -- one pass --------------------------------------------------------------------------------


async def test_same_key_twice_in_one_pass_stores_one(tmp_path: Path) -> None:
    """Sets of one key pipelined in one send (one pass of the reactor's synchronous core),
    and sent at once from eight connections: one item stored, every set STORED."""
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        m = await Conn.open(port)
        await m.send(b"".join(mc_set(b"q/key=k%d" % (i // 3), b"%d" % (i // 3))
                              for i in range(30)))
        assert [await m.line() for _ in range(30)] == [b"STORED"] * 30
        conns = [await Conn.open(port) for _ in range(8)]
        wire = b"".join(mc_set(b"q/key=same", b"same") + mc_set(b"q", b"plain")
                        for _ in range(4))
        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(conn.send, wire)
        for conn in conns:
            assert [await conn.line() for _ in range(8)] == [b"STORED"] * 8
        got = []
        while (data := await m.get("q")) is not None:
            got.append(data)
        assert got[:10] == [b"%d" % i for i in range(10)]
        assert sorted(got[10:]) == [b"plain"] * 32 + [b"same"]
        for conn in (m, *conns):
            await conn.aclose()


async def test_two_connections_one_key_one_pass_and_the_order_sent_kept(
        tmp_path: Path) -> None:
    """Both connections' sets arrive before the reactor runs (plain sockets, no await
    between the sends): one pass holds them, and the synchronous core checks and records
    the key there: one is stored. A keyed set sent after a plain one (joined with the other
    connection's) keeps its place: ids follow the order each connection sent."""
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        async with served_sockets(port, 2) as (a, b):
            a.sendall(mc_set(b"q", b"a1") + mc_set(b"q/key=k", b"a2") + mc_set(b"q", b"a3"))
            b.sendall(mc_set(b"q", b"b1") + mc_set(b"q/key=k", b"b2") + mc_set(b"q", b"b3"))
            for sock in (a, b):
                assert await trio.to_thread.run_sync(
                    recv_until, sock, b"STORED\r\n" * 3) == b"STORED\r\n" * 3
        c = await Rpc.open(server.ports["rpc"])
        got = await drain(c, "q")
        assert sorted(got) in ([b"a1", b"a2", b"a3", b"b1", b"b3"],
                               [b"a1", b"a3", b"b1", b"b2", b"b3"])
        for first, second, third in ((b"a1", b"a2", b"a3"), (b"b1", b"b2", b"b3")):
            kept = [x for x in (first, second, third) if x in got]
            assert [x for x in got if x in kept] == kept  # each connection's order
        assert server.broker.registry.dedup_counters.duplicates == 1
        await c.aclose()


async def test_keyed_puts_that_wait_for_room_are_checked_when_they_begin(
        tmp_path: Path) -> None:
    """A queue with max_items: puts make room on the task path (not the pass). Keyed puts
    pipelined there, a key three times over: each key stored once; a duplicate makes no
    room (discard_old_when_full: a stored put would push the oldest item out)."""
    toml = "[queues.q]\nmax_items = 4\ndiscard_old_when_full = true\n"
    async with running(cfg(tmp_path, toml)) as server:
        m = await Conn.open(server.ports["memcache"])
        await m.send(b"".join(mc_set(b"q/key=k%d" % (i // 3), b"%d" % (i // 3))
                              for i in range(12)))
        assert [await m.line() for _ in range(12)] == [b"STORED"] * 12
        await m.send(b"".join(mc_set(b"q/key=k%d" % i, b"again") for i in range(4)))
        assert [await m.line() for _ in range(4)] == [b"STORED"] * 4
        assert [await m.get("q") for _ in range(5)] == [b"0", b"1", b"2", b"3", None]
        await m.aclose()


async def test_a_parked_queue_keeps_its_keys(tmp_path: Path) -> None:
    """A queue parked on disk (its state dropped) reads its keys back when it loads."""
    config = cfg(tmp_path, park_after="100ms", checkpoint_interval="50ms")
    async with running(config) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, False]
        await wait_until(lambda: "q" in server.broker.registry.parked)
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, True]
        assert await drain(c, "q") == [b"a"]
        await c.aclose()


# -- durability --------------------------------------------------------------------------------


async def test_keys_survive_restart_consumption_and_compaction(tmp_path: Path) -> None:
    """DEDUP records in segments that compaction removed are in the key snapshot (q.dedup),
    written before the segments went; after a restart a duplicate is still one."""
    config = cfg(tmp_path, COMPACTING)
    data = tmp_path / "data"
    async with running(config) as server:
        c = await Rpc.open(server.ports["rpc"])
        for i in range(1, 61):
            assert await c.call("put", "q", [b"x" * 100], *keyed(b"key-%d" % i)) == [
                1, i, False]
        assert len(await drain(c, "q")) == 60
        await wait_compacted(data)
        assert (data / jf.dedup_name("q")).exists()
        await c.aclose()
    assert "ok    q.dedup: 60 deduplication keys" in checked(data)
    (segment,) = segments(data)
    assert "DEDUP key=b'key-60' first_id=60 count=1" in dumped(segment)
    async with running(config) as server:
        c = await Rpc.open(server.ports["rpc"])
        for i in (1, 30, 60):
            assert await c.call("put", "q", [b"x"], *keyed(b"key-%d" % i)) == [1, i, True]
        assert await c.call("put", "q", [b"z"], *keyed(b"key-61")) == [1, 61, False]
        assert await drain(c, "q") == [b"z"]
        await c.aclose()


async def test_a_key_whose_put_failed_is_forgotten(tmpfs: Path) -> None:
    """A full disk refuses keyed sets (nothing stored); the same sets sent again once
    there is room are stored, once each: a refused put's key was never remembered, and a
    repeat in the refused pass was answered with the refusal, not STORED."""
    data = tmpfs / "data"
    async with running(make_config(data, fsync="always")) as server:
        m = await Conn.open(server.ports["memcache"])
        filler = tmpfs / "filler"
        fill(filler, leave=400 * 1024)
        item = b"x" * 1500
        stored, refused = 0, None
        for i in range(2000):
            await m.send(mc_set(b"q/key=k%d" % i, item) * 2)  # a repeat in the same pass
            first, second = await m.line(), await m.line()
            if first != b"STORED":
                assert second == first and first.startswith(b"SERVER_ERROR"), (first, second)
                refused = i
                break
            assert second == b"STORED"
            stored += 1
        assert refused is not None and stored > 10, "the tmpfs never filled up"
        filler.unlink()
        for i in (0, refused, refused):
            await m.send(mc_set(b"q/key=k%d" % i, item))
            assert await m.line() == b"STORED"
        got = 0
        while await m.get("q") is not None:
            got += 1
        assert got == stored + 1
        await m.aclose()


async def test_flush_keeps_the_keys_delete_drops_them(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, False]
        assert await c.call("flush", "q") == 1
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, True]
        assert await c.call("delete", "q") is True
        assert await c.call("put", "q", [b"a"], *keyed(b"k")) == [1, 1, False]
        assert await drain(c, "q") == [b"a"]
        await c.aclose()


async def test_oldest_key_evicted_past_max_dedup_keys_and_counted(tmp_path: Path) -> None:
    toml = "[queues.q]\nmax_dedup_keys = 2\n"
    async with running(cfg(tmp_path, toml)) as server:
        c = await Rpc.open(server.ports["rpc"])
        for k in (b"a", b"b"):
            await c.call("put", "q", [k], *keyed(k))
        assert await c.call("put", "q", [b"a"], *keyed(b"a")) == [1, 1, True]
        await c.call("put", "q", [b"c"], *keyed(b"c"))  # evicts a, the oldest stored
        counters = server.broker.registry.dedup_counters
        assert counters.evicted == 1 and counters.duplicates == 1
        # a is forgotten: its re-send is stored again (at-least-once, never lost).
        assert await c.call("put", "q", [b"a"], *keyed(b"a")) == [1, 4, False]
        assert await c.call("put", "q", [b"c"], *keyed(b"c")) == [1, 3, True]
        metrics = await scrape(server)
        for name, value in {"queued_dedup_keys": 2, "queued_dedup_evictions_total": 2,
                            "queued_dedup_duplicates_total": 2,
                            "queued_dedup_expiries_total": 0}.items():
            assert metrics[(name, NONE)] == value, name
        assert await drain(c, "q") == [b"a", b"b", b"c", b"a"]
        await c.aclose()


def test_sigkill_keeps_the_keys_of_acknowledged_puts(tmp_path: Path) -> None:
    """Keyed sets (pymemcache) acknowledged, then the server SIGKILLed and started again:
    every set re-sent is STORED and stores nothing; the queue holds each item once."""
    with contextlib.contextmanager(killed_at_end)(tmp_path, '[default]\nfsync = "always"\n'
                                                  ) as proc:
        proc.start()
        mc = pymc(proc.memcache)
        for i in range(200):
            assert mc.set(f"q/key=k{i}", b"%d" % i) is True
        mc.close()
        proc.signal(signal.SIGKILL)
        proc.wait()
        proc.start()
        mc = pymc(proc.memcache)
        for i in range(200):
            assert mc.set(f"q/key=k{i}", b"%d" % i) is True
        got = []
        while (data := mc.get("q")) is not None:
            got.append(data)
        mc.close()
        assert got == [b"%d" % i for i in range(200)]


# -- any interleaving stores each key once ------------------------------------------------------

KEYS = 6
OPS = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, KEYS - 1),
                                   st.sampled_from(["memcache", "text", "rpc"])),
                         st.tuples(st.sampled_from(["reconnect", "restart", "wait"]),
                                   st.just(0), st.just(""))), max_size=24)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_interleaving_of_resends_reconnects_and_restarts_stores_each_key_once(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, str]]) -> None:
    """Keyed puts of keys 0..5 sent in any order, any number of times, over any protocol,
    pipelined (no reply awaited), with connections dropped (their replies lost) and the
    server restarted between them; then every key sent once more. The queue then holds
    each key's item exactly once. (A put sent and unanswered may or may not have been
    stored; the last sends tell: a key never sent before is no duplicate.)"""
    config = cfg(tmp_path_factory.mktemp("interleaving"))
    async def main() -> None:
        sent: set[bytes] = set()
        todo = list(ops)
        while True:  # one life of the server per turn: a restart ends it
            async with running(config) as server:
                clients = Clients(server.ports)
                while todo:
                    op, key, proto = todo.pop(0)
                    if op == "put":
                        await clients.send(proto, key)
                        sent.add(b"k%d" % key)
                    elif op == "wait":
                        await clients.replies()
                    else:
                        await clients.aclose()  # (in-flight replies lost)
                        if op == "restart":
                            break
                else:
                    await clients.aclose()
                    c = await Rpc.open(server.ports["rpc"])
                    for key in range(KEYS):
                        k = b"k%d" % key
                        count, _, duplicate = await c.call("put", "q", [k], *keyed(k))
                        assert count == 1 and (duplicate is False or k in sent)
                    assert sorted(await drain(c, "q")) == [b"k%d" % i for i in range(KEYS)]
                    await c.aclose()
                    return

    trio.run(main)


class Clients:
    """One connection per protocol, opened on first use; puts sent without waiting."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.conns: dict[str, Conn] = {}
        self.rpc: Rpc | None = None
        self.unanswered: list[int] = []  # msgids of the RPC puts sent

    async def send(self, proto: str, key: int) -> None:
        k = b"k%d" % key
        if proto == "rpc":
            if self.rpc is None:
                self.rpc = await Rpc.open(self.ports["rpc"])
            msgid, wire = self.rpc.request("put", "q", [k], *keyed(k))
            await self.rpc.send(wire)
            self.unanswered.append(msgid)
            return
        if proto not in self.conns:
            self.conns[proto] = await Conn.open(self.ports[proto],
                                                b"\r\n" if proto == "memcache" else b"\n")
        wire = mc_set(b"q/key=" + k, k) if proto == "memcache" else (
            b"put q key=%s:\n%s\n\n" % (k, k))
        await self.conns[proto].send(wire)

    async def replies(self) -> None:
        """Every reply so far: a version round trip on each connection (each put's reply
        before it is a success)."""
        for proto, c in self.conns.items():
            await c.send(b"version\r\n")
            end = b"VERSION" if proto == "memcache" else b":"
            while not (line := await c.line()).startswith(end):
                assert line in (b"STORED", b"+1"), line
        if self.rpc is not None:
            for msgid in self.unanswered:
                reply = await self.rpc.response(msgid)
                assert reply[2] is None and reply[3][0] == 1, reply
            self.unanswered.clear()

    async def aclose(self) -> None:
        for c in self.conns.values():
            await c.aclose()
        self.conns.clear()
        if self.rpc is not None:
            await self.rpc.aclose()
            self.rpc = None
            self.unanswered.clear()
