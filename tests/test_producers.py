"""Exactly-once puts through the server: RPC puts with a producer id and a sequence.

A real server on free 127.0.0.1 ports, the spec-only msgpack client of
test_rpc_server.py: the next sequence is stored, a repeat is answered as the original
and stores nothing, a gap is refused; the table is durable with the items (restart,
after the items were consumed and their segments compacted away); `delete` drops it,
`flush` keeps it; the bounds and their counters. The pure table is tested in
test_reader_producers.py, the record in test_journal_records.py.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journal_util import COMPACTING, checked, dumped, segments, wait_compacted
from ops_util import NONE, scrape
from rpc_util import Rpc
from server_util import ServerProcess, make_config, running
from wait_util import wait_until

from queued.client import AsyncClient, ClientError
from queued.config import ServerConfig
from queued.journal import format as jf
from queued.wire.rpc_protocol import ErrorCode

E = ErrorCode
P = b"producer-1"


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def drain(c: Rpc, queue: str) -> list[bytes]:
    return [data for _, data in await c.call("get", queue, 1000)]


async def test_next_sequence_stored_repeat_answered_as_original_gap_refused(
        tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a", b"b"], 0, 0, 0, P, 1) == [2, 1, False]
        assert await c.call("put", "q", [b"c"], 0, 0, 0, P, 2) == [1, 3, False]
        # The last put again: its answer, flagged, nothing stored.
        assert await c.call("put", "q", [b"c"], 0, 0, 0, P, 2) == [1, 3, True]
        # An older one: a duplicate too (only the last answer is kept).
        assert await c.call("put", "q", [b"a", b"b"], 0, 0, 0, P, 1) == [0, 0, True]
        code, message = await c.error("put", "q", [b"e"], 0, 0, 0, P, 4)
        assert code == E.PRODUCER_GAP and "3 is next" in message
        # Another producer has its own sequence; a plain put is not counted.
        assert await c.call("put", "q", [b"x"], 0, 0, 0, b"other", 1) == [1, 4, False]
        assert await c.call("put", "q", [b"y"]) == 1
        assert await c.call("put", "q", [b"d"], 0, 0, 0, P, 3) == [1, 6, False]
        assert await drain(c, "q") == [b"a", b"b", b"c", b"x", b"y", b"d"]
        await c.aclose()


async def test_producer_params_checked(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert (await c.error("put", "q", [b"a"], 0, 0, 0, b"p" * 65, 1))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [b"a"], 0, 0, 0, b"", 1))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [b"a"], 0, 0, 0, P))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [b"a"], 0, 0, 0, P, 0))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [b"a"], 0, 0, 0, P, -1))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [], 0, 0, 0, P, 1))[0] == E.BAD_PARAMS
        # A nil producer is a plain put; a str id is its UTF-8 bytes.
        assert await c.call("put", "q", [b"a"], 0, 0, 0, None) == 1
        assert await c.call("put", "q", [b"b"], 0, 0, 0, "p\u00e9", 1) == [1, 2, False]
        assert await c.call("put", "q", [b"b"], 0, 0, 0, "p\u00e9".encode(), 1) == [1, 2, True]
        # A producer the queue does not know starts at 1; the largest sequence is u64's.
        assert (await c.error("put", "q", [b"c"], 0, 0, 0, b"new", 2**64 - 1))[0] == (
            E.PRODUCER_GAP)
        assert await drain(c, "q") == [b"a", b"b"]
        await c.aclose()


async def test_pipelined_puts_of_one_producer_keep_their_order(tmp_path: Path) -> None:
    """100 puts sent at once, then all sent again: each stored once, in order, and
    every repeat flagged."""
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        for repeat in (False, True):
            wire = b"".join(c.request("put", "q", [b"%d" % i], 0, 0, 0, P, i)[1]
                            for i in range(1, 101))
            first = c.msgid - 99
            await c.send(wire)
            replies = [await c.response(first + i) for i in range(100)]
            assert all(r[2] is None for r in replies), replies
            assert [r[3][2] for r in replies] == [repeat] * 100
        assert await drain(c, "q") == [b"%d" % i for i in range(1, 101)]
        await c.aclose()


async def test_concurrent_connections_resending_one_put_store_it_once(tmp_path: Path) -> None:
    """The same put (a re-send on a new connection while the first is in flight) from
    8 connections at once: one is stored, the others are answered as it was."""
    async with running(cfg(tmp_path)) as server:
        conns = [await Rpc.open(server.ports["rpc"]) for _ in range(8)]
        answers: list[list[object]] = []

        async def put(c: Rpc) -> None:
            answers.append(await c.call("put", "q", [b"once", b"twice"], 0, 0, 0, P, 1))

        async with trio.open_nursery() as nursery:
            for c in conns:
                nursery.start_soon(put, c)
        assert sorted(a[2] for a in answers) == [False] + [True] * 7  # type: ignore[type-var]
        assert all(a[:2] == [2, 1] for a in answers)
        assert await drain(conns[0], "q") == [b"once", b"twice"]
        for c in conns:
            await c.aclose()


async def test_table_survives_restart_consumption_and_compaction(tmp_path: Path) -> None:
    """Marks in segments that compaction removed are in the snapshot file (q.producers),
    written before the segments went; after a restart a repeat is still a repeat."""
    config = cfg(tmp_path, COMPACTING)
    data = tmp_path / "data"
    async with running(config) as server:
        c = await Rpc.open(server.ports["rpc"])
        for seq in range(1, 41):
            assert await c.call("put", "q", [b"x" * 100], 0, 0, 0, P, seq) == [1, seq, False]
        assert await c.call("put", "q", [b"y"], 0, 0, 0, b"early", 1) == [1, 41, False]
        for seq in range(41, 61):
            assert await c.call("put", "q", [b"x" * 100], 0, 0, 0, P, seq) == [1, seq + 1,
                                                                               False]
        assert len(await drain(c, "q")) == 61
        await wait_compacted(data)
        assert (data / jf.producers_name("q")).exists()
        await c.aclose()
    # `queued check` reads the snapshot; `queued dump` shows a segment's PRODUCER records.
    assert "ok    q.producers: 2 producers" in checked(data)
    (segment,) = segments(data)
    assert "PRODUCER id=b'producer-1' sequence=60 first_id=61 count=1" in dumped(segment)
    async with running(config) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"x" * 100], 0, 0, 0, P, 60) == [1, 61, True]
        assert await c.call("put", "q", [b"y"], 0, 0, 0, b"early", 1) == [1, 41, True]
        assert (await c.error("put", "q", [b"z"], 0, 0, 0, P, 62))[0] == E.PRODUCER_GAP
        assert await c.call("put", "q", [b"z"], 0, 0, 0, P, 61) == [1, 62, False]
        assert await drain(c, "q") == [b"z"]
        await c.aclose()


async def test_flush_keeps_the_table_delete_drops_it(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"a"], 0, 0, 0, P, 1) == [1, 1, False]
        assert await c.call("flush", "q") == 1
        assert await c.call("put", "q", [b"a"], 0, 0, 0, P, 1) == [1, 1, True]
        assert await c.call("delete", "q") is True
        # A new queue: the producer is unknown, so its put is stored (ids start again).
        assert await c.call("put", "q", [b"a"], 0, 0, 0, P, 1) == [1, 1, False]
        assert await drain(c, "q") == [b"a"]
        await c.aclose()


async def test_least_recently_used_producer_evicted_and_counted(tmp_path: Path) -> None:
    toml = """
[queues.q]
max_producers = 2
"""
    async with running(cfg(tmp_path, toml)) as server:
        c = await Rpc.open(server.ports["rpc"])
        for p in (b"a", b"b"):
            await c.call("put", "q", [p], 0, 0, 0, p, 1)
        assert await c.call("put", "q", [b"a"], 0, 0, 0, b"a", 1) == [1, 1, True]  # a: recent
        await c.call("put", "q", [b"c"], 0, 0, 0, b"c", 1)  # evicts b
        counters = server.broker.registry.producer_counters
        assert counters.evicted == 1 and counters.duplicates == 1
        # b is forgotten: its repeat is stored again (at-least-once, never lost).
        assert await c.call("put", "q", [b"b"], 0, 0, 0, b"b", 1) == [1, 4, False]
        # ... which evicted a, the least recently used now.
        assert await c.call("put", "q", [b"a"], 0, 0, 0, b"a", 1) == [1, 5, False]
        assert counters.evicted == 3
        metrics = await scrape(server)
        for name, value in {"queued_producers": 2, "queued_producer_evictions_total": 3,
                            "queued_producer_duplicates_total": 1,
                            "queued_producer_gaps_total": 0}.items():
            assert metrics[(name, NONE)] == value, name
        await c.aclose()


# -- any interleaving stores each sequence once ------------------------------------------------

OPS = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(1, 6)),
                         st.tuples(st.sampled_from(["reconnect", "restart", "wait"]),
                                   st.just(0))), max_size=20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_interleaving_of_resends_reconnects_and_restarts_stores_each_sequence_once(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]]) -> None:
    """Puts of sequences 1..6 sent in any order, any number of times, pipelined (no reply
    awaited), with connections dropped (their replies lost) and the server restarted
    between them; then every sequence sent once more, in order. The queue then holds each
    sequence's item exactly once, in sequence order."""
    config = cfg(tmp_path_factory.mktemp("interleaving"))

    async def main() -> None:
        highest, sent, todo = 0, 0, list(ops)
        while True:  # one life of the server per turn: a restart ends it
            async with running(config) as server:
                c = await Rpc.open(server.ports["rpc"])
                while todo:
                    op, seq = todo.pop(0)
                    if op == "put":
                        await c.send(c.request("put", "q", [b"%d" % seq], 0, 0, 0, P, seq)[1])
                        highest, sent = max(highest, seq), sent + 1
                    elif op == "wait":  # the replies so far (some may be gaps)
                        for msgid in range(c.msgid - sent + 1, c.msgid + 1):
                            await c.response(msgid)
                        sent = 0
                    else:
                        await c.aclose()  # (in-flight replies lost)
                        sent = 0
                        if op == "restart":
                            break
                        c = await Rpc.open(server.ports["rpc"])
                else:
                    await c.aclose()
                    c = await Rpc.open(server.ports["rpc"])
                    for seq in range(1, highest + 1):  # stored now, or a repeat: no gap
                        count, _, _ = await c.call("put", "q", [b"%d" % seq], 0, 0, 0, P, seq)
                        assert count in (0, 1)  # (0: a repeat of an older put)
                    assert await drain(c, "q") == [b"%d" % s for s in range(1, highest + 1)]
                    await c.aclose()
                    return

    trio.run(main)


# -- SIGKILL -----------------------------------------------------------------------------------


async def reply_dropping_proxy(target: int, task_status: trio.TaskStatus[int]) -> None:
    """A TCP proxy to 127.0.0.1:`target` that passes every request on, but on every 5th
    chunk of replies closes both ends instead: the server ran the puts, their replies are
    lost (what a network cut or a server killed after its fsync does)."""
    chunks = 0

    async def pipe(client: trio.SocketStream) -> None:
        nonlocal chunks
        try:
            server = await trio.open_tcp_stream("127.0.0.1", target)
        except OSError:
            await client.aclose()
            return
        async with client, server, trio.open_nursery() as nursery:
            async def up() -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    async for data in client:
                        await server.send_all(data)
                nursery.cancel_scope.cancel()

            async def down() -> None:
                nonlocal chunks
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    async for data in server:
                        chunks += 1
                        if chunks % 5 == 0:
                            break  # the reply is lost
                        await client.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(up)
            nursery.start_soon(down)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(pipe, listeners)


async def test_idempotent_puts_with_lost_replies_and_sigkill_are_stored_once(
        tmp_path: Path) -> None:
    """Idempotent puts (4 tasks pipelined on one client) through a proxy that loses every
    5th reply, while the server is SIGKILLed twice and restarted on its port: every
    acknowledged put is there exactly once, and no put is there twice: the unanswered ones
    were re-sent to the same server and answered as repeats. (With idempotent=False this
    stores duplicates: re-sent puts whose first send was stored.)"""
    config = tmp_path / "queued.toml"
    config.write_text('[default]\nfsync = "always"\n')
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log", config)
    acked: list[bytes] = []
    failed = 0
    try:
        await trio.to_thread.run_sync(proc.start)
        port = proc.rpc
        async with trio.open_nursery() as outer:
            proxy = await outer.start(reply_dropping_proxy, port)
            async with AsyncClient(f"127.0.0.1:{proxy}", read_timeout=2.0, backoff=0.05,
                                   max_backoff=0.2) as c:
                stop = trio.Event()

                async def produce(who: int) -> None:
                    nonlocal failed
                    n = 0
                    while not stop.is_set():
                        data = b"%d-%d" % (who, n)
                        try:
                            await c.put("q", [data, data + b"+"])
                        except ClientError:
                            failed += 1  # not acknowledged: stored once or not at all
                        else:
                            acked.append(data)
                        n += 1

                async def more(n: int) -> None:
                    seen = len(acked)
                    await wait_until(lambda: len(acked) >= seen + n)

                async with trio.open_nursery() as nursery:
                    for who in range(4):
                        nursery.start_soon(produce, who)
                    for _ in range(2):
                        await more(100)
                        proc.kill()
                        await trio.to_thread.run_sync(lambda: proc.start(rpc_port=port))
                    await more(100)
                    stop.set()
                retries = c.statistics().retries
            outer.cancel_scope.cancel()
        got: list[bytes] = []
        async with AsyncClient(f"127.0.0.1:{port}") as direct:  # (not through the proxy)
            while batch := await direct.get("q", 1000):
                got += [i.data for i in batch]
    finally:
        proc.kill()
    assert retries > 20  # many puts were re-sent
    counts = Counter(got)
    assert not [d for d, n in counts.items() if n > 1], "a put was stored twice"
    assert all(counts[d] == 1 and counts[d + b"+"] == 1 for d in acked)
    pairs = [d for d in got if not d.endswith(b"+")]
    assert len(got) == 2 * len(pairs) and len(pairs) <= len(acked) + failed


async def test_puts_with_and_without_a_producer_on_one_connection_keep_their_order(
        tmp_path: Path) -> None:
    """Plain puts of a pass are joined (JoinedPuts) into one append made after every
    connection ran, a put with a producer never is: pipelined on one connection, plain,
    producer, plain, producer, ... are still stored in the order sent."""
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"first"]) == 1  # (a loaded queue: joins happen)
        ids = await c.send_pipelined(
            ("put", "q", [b"%d" % i], *((0, 0, 0, P, i // 2 + 1) if i % 2 else ()))
            for i in range(20))
        for msgid in ids:
            assert (await c.response(msgid))[2] is None
        assert await drain(c, "q") == [b"first"] + [b"%d" % i for i in range(20)]
        await c.aclose()
