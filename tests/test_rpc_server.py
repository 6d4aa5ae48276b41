"""Real-TCP tests of the MessagePack-RPC port, through a plain msgpack socket client.

The client here is written from the MessagePack-RPC spec alone (msgpack + a trio
socket), not with `queued.client`, so these are interop tests: any msgpack-rpc
client in another language sees the same bytes. Each test runs its own server on
free 127.0.0.1 ports over a fresh data directory; every wait is bounded.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import pytest
import trio
import trio.testing
from rpc_util import Rpc
from server_util import make_config, running
from wait_util import wait_for, wait_until

from queued import __version__
from queued.config import ServerConfig
from queued.reader.open_reads import TIMEOUT_HEAP_MIN
from queued.server.task_gets import MAX_WAITING
from queued.storage.journal import QueueJournal
from queued.wire.rpc_protocol import ErrorCode

E = ErrorCode


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


# -- every method ------------------------------------------------------------------------------


async def test_every_method_round_trip(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("version") == __version__
        assert await c.call("put", "jobs", [b"a", b"b", "c\u00e9"]) == 3
        assert await c.call("put", "jobs", [b"d"], 0) == 1
        peek = await c.call("peek", "jobs")
        assert peek["head"] == [1, b"a"] and peek["items"] == 4 and peek["bytes"] == 6
        got = await c.call("get", "jobs", 2)
        assert got == [[1, b"a"], [2, b"b"]]
        # Open reads: ids confirm and abort on this connection only.
        opened = await c.call("get", "jobs", 5, 0, 60_000)
        assert opened == [[3, "c\u00e9".encode()], [4, b"d"]]
        assert (await c.call("peek", "jobs"))["open_transactions"] == 2
        assert await c.call("abort", "jobs", [4, 99]) == 1  # 99 is not open here
        assert await c.call("confirm", "jobs", [3, 3]) == 1
        assert await c.call("confirm", "jobs", [3]) == 0  # already confirmed
        assert await c.call("get", "jobs", 10) == [[4, b"d"]]  # the aborted one came back
        assert await c.call("get", "jobs", 10) == []
        stats = await c.call("stats")
        assert stats["server"]["version"] == __version__
        assert stats["server"]["curr_connections"] == 1
        assert stats["queues"]["jobs"]["items"] == 0
        assert stats["queues"]["jobs"]["total_items"] == 4
        assert await c.call("put", "other", [b"x", b"y"]) == 2
        assert await c.call("flush", "other") == 2
        assert await c.call("get", "other", 1) == []
        assert await c.call("put", "other", [b"z"]) == 1
        assert await c.call("flush_all") >= 1
        assert await c.call("delete", "other") is True
        assert "other" not in (await c.call("stats"))["queues"]
        await c.aclose()


async def test_fanout_readers_and_expiration(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, expiration_timer="1h")) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("get", "feed+a", 1) == []  # creates reader a at the tail
        assert await c.call("get", "feed+b", 1) == []
        assert await c.call("put", "feed", [b"1", b"2"]) == 2
        assert await c.call("get", "feed+a", 10) == [[1, b"1"], [2, b"2"]]
        assert await c.call("get", "feed+b", 1, 0, 60_000) == [[1, b"1"]]
        assert await c.call("confirm", "feed+b", [1]) == 1
        assert (await c.call("peek", "feed+b"))["head"] == [2, b"2"]
        code, _ = await c.error("put", "feed+a", [b"x"])
        assert code == E.BAD_QUEUE_NAME
        # expiration_ms is relative: 1 ms has passed long before the get below.
        assert await c.call("put", "exp", [b"old"], 1) == 1
        assert await c.call("put", "exp", [b"new"]) == 1
        # (the wall clock's: wait until the peek no longer shows the expired one)
        await wait_for(lambda: c.call("peek", "exp"), lambda info: info["head"] == [2, b"new"])
        assert await c.call("get", "exp", 10) == [[2, b"new"]]
        await c.aclose()


async def test_get_cuts_a_batch_at_the_reply_size(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, rpc_max_frame="1MiB")) as server:
        c = await Rpc.open(server.ports["rpc"])
        for _ in range(2):
            assert await c.call("put", "big", [os.urandom(200_000) for _ in range(3)]) == 3
        first = await c.call("get", "big", 100)
        assert 1 <= len(first) < 6 and sum(len(d) for _, d in first) <= 700_000
        rest = await c.call("get", "big", 100)
        assert [i for i, _ in first + rest] == [1, 2, 3, 4, 5, 6]
        await c.aclose()


# -- pipelining ---------------------------------------------------------------------------------


async def test_pipelined_requests_answered_by_msgid(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        # One write: a long-polling get, then puts and a plain get behind it.
        wait_id, *put_ids, get_id = await c.send_pipelined([
            ("get", "late", 1, 5_000), *(("put", "q", [b"%d" % i]) for i in range(50)),
            ("get", "q", 100)])
        for mid in put_ids:
            assert (await c.response(mid))[2:] == [None, 1]
        got = await c.response(get_id)
        assert [d for _, d in got[3]] == [b"%d" % i for i in range(50)]  # saw every put
        assert wait_id not in c.early  # still waiting: it did not hold the others up
        assert await c.call("put", "late", [b"now"]) == 1
        assert (await c.response(wait_id))[2:] == [None, [[1, b"now"]]]
        await c.aclose()


@asynccontextmanager
async def warm_queue(tmp_path: Path) -> AsyncIterator[tuple[Rpc, QueueJournal]]:
    """A server, an RPC connection to it and the journal of its queue q, which one put
    made (so that what follows is not the queue's first append)."""
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        try:
            assert await c.call("put", "q", [b"warm"]) == 1
            yield c, server.broker.queues["q"].journal
        finally:
            await c.aclose()


async def test_consecutive_puts_share_one_append_round(tmp_path: Path) -> None:
    async with warm_queue(tmp_path) as (c, journal):
        fsyncs = journal.statistics().fsyncs
        ids = await c.send_pipelined(("put", "q", [b"x%d" % i] * 10) for i in range(20))
        for mid in ids:
            assert (await c.response(mid))[2:] == [None, 10]
        st = journal.statistics()
        assert st.items_appended == 201
        # 20 pipelined puts of 10 items: far fewer fsyncs than puts (usually one).
        assert 1 <= st.fsyncs - fsyncs <= 3


async def test_a_batch_put_is_one_append_and_one_fsync(tmp_path: Path) -> None:
    async with warm_queue(tmp_path) as (c, journal):
        before = journal.statistics()
        assert await c.call("put", "q", [b"%d" % i for i in range(1000)]) == 1000
        after = journal.statistics()
        assert (after.appends - before.appends, after.fsyncs - before.fsyncs) == (1, 1)


# -- open reads -----------------------------------------------------------------------------------


async def test_auto_abort_returns_items_on_trio_time(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        other = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "jobs", [b"a", b"b", b"c"]) == 3
        assert await c.call("get", "jobs", 2, 0, 10_000) == [[1, b"a"], [2, b"b"]]
        mock_clock.jump(9)
        assert await c.call("confirm", "jobs", [1]) == 1  # in time
        mock_clock.jump(2)  # item 2's 10 s are over
        await trio.testing.wait_all_tasks_blocked()
        # Item 2 went back to the head, before item 3; the late confirm finds nothing.
        assert await other.call("get", "jobs", 10) == [[2, b"b"], [3, b"c"]]
        assert await c.call("confirm", "jobs", [2]) == 0
        stats = server.broker.reader_info("jobs")
        assert stats["canceled_transactions"] == 1 and stats["open_transactions"] == 0
        await c.aclose()
        await other.aclose()


async def test_auto_abort_real_time(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "jobs", [b"a"]) == 1
        assert await c.call("get", "jobs", 1, 0, 100) == [[1, b"a"]]
        # Real time is the point: the read returns to the queue after 100 ms.
        assert await c.call("get", "jobs", 1, 5_000) == [[1, b"a"]]
        await c.aclose()


async def test_disconnect_returns_open_reads(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        waiter = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "jobs", [b"a", b"b"]) == 2
        assert len(await c.call("get", "jobs", 2, 0, 60_000)) == 2
        mid = await waiter.send_request("get", "jobs", 5, 5_000, 60_000)
        await trio.testing.wait_all_tasks_blocked()
        await c.aclose()  # hangs up holding both
        _, _, error, got = await waiter.response(mid)
        assert error is None and got == [[1, b"a"], [2, b"b"]]
        assert server.broker.reader_info("jobs")["canceled_transactions"] == 2
        await waiter.aclose()


async def test_a_waiting_get_of_a_closed_connection_takes_nothing(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        await c.send_request("get", "jobs", 1, 10_000)
        await trio.testing.wait_all_tasks_blocked()
        assert server.broker.reader_info("jobs")["waiters"] == 1
        await c.aclose()
        await wait_until(lambda: not server.broker.reader_info("jobs")["waiters"])
        other = await Rpc.open(server.ports["rpc"])
        assert await other.call("put", "jobs", [b"kept"]) == 1
        assert await other.call("get", "jobs", 1) == [[1, b"kept"]]
        await other.aclose()


async def test_open_read_limit(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, toml="[server]\nmax_open_reads = 3\n")) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"%d" % i for i in range(5)]) == 5
        assert len(await c.call("get", "q", 5, 0, 60_000)) == 3  # cut to the allowance
        code, message = await c.error("get", "q", 1, 0, 60_000)
        assert code == E.TOO_MANY_OPEN_READS and "3" in message
        assert await c.call("get", "q", 5) == [[4, b"3"], [5, b"4"]]  # plain gets still work
        assert await c.call("confirm", "q", [1, 2, 3]) == 3
        await c.aclose()


# -- errors ------------------------------------------------------------------------------


async def test_error_codes(tmp_path: Path) -> None:
    toml = """
[queues.small]
max_items = 2
[queues.tiny]
max_item_size = "10B"
[queues.capped]
max_journal_size = "1KiB"
journal_size = "512B"
journal_full_policy = "refuse"
"""
    async with running(cfg(tmp_path, toml)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert (await c.error("nope"))[0] == E.UNKNOWN_METHOD
        assert (await c.error("put", "q"))[0] == E.BAD_PARAMS
        assert (await c.error("put", "q", [1]))[0] == E.BAD_PARAMS
        assert (await c.error("get", "q", 0))[0] == E.BAD_PARAMS
        assert (await c.error("get", "q", 1, -1))[0] == E.BAD_PARAMS
        assert (await c.error("confirm", "q", [0]))[0] == E.BAD_PARAMS
        assert (await c.error("version", 1))[0] == E.BAD_PARAMS
        assert (await c.error("put", "bad name", [b"x"]))[0] == E.BAD_QUEUE_NAME
        assert (await c.error("get", "q+", 1))[0] == E.BAD_QUEUE_NAME
        assert (await c.error("get", "x" * 251, 1))[0] == E.BAD_QUEUE_NAME
        assert (await c.error("get", "x" * 245, 1))[0] == E.BAD_QUEUE_NAME  # file name limit
        assert await c.call("put", "small", [b"1", b"2"]) == 2
        assert (await c.error("put", "small", [b"3"]))[0] == E.QUEUE_FULL
        assert (await c.error("put", "tiny", [b"x" * 11]))[0] == E.ITEM_TOO_LARGE
        assert await c.call("put", "tiny", [b"x" * 10]) == 1
        for _ in range(30):
            msgid = await c.send_request("put", "capped", [b"y" * 100])
            _, _, error, _ = await c.response(msgid)
            if error is not None:
                assert error[0] == E.JOURNAL_FULL
                break
        else:
            pytest.fail("max_journal_size never refused a put")
        # None of the refusals closed the connection, or stored anything.
        assert await c.call("get", "small", 10) == [[1, b"1"], [2, b"2"]]
        assert server.broker.reader_info("tiny")["items"] == 1
        await c.aclose()


async def test_frame_over_the_cap_is_answered_then_closed(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, rpc_max_frame="64KiB")) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"x" * 60_000]) == 1
        mid = await c.send_request("put", "q", [b"y" * 70_000])
        _, _, error, _ = await c.response(mid)
        assert error[0] == E.TOO_LARGE and "65536" in error[1]
        await c.expect_closed()
        other = await Rpc.open(server.ports["rpc"])
        assert await other.call("get", "q", 10) == [[1, b"x" * 60_000]]  # nothing else stored
        await other.aclose()


async def test_batch_over_the_cap_is_answered_then_closed(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, rpc_max_batch=10)) as server:
        port = server.ports["rpc"]
        for method, params in (("put", ["q", [b"x"] * 11]), ("get", ["q", 11]),
                               ("confirm", ["q", list(range(1, 12))])):
            c = await Rpc.open(port)
            assert await c.call("put", "q", [b"ok"] * 10) == 10
            code, _ = await c.error(method, *params)
            assert code == E.TOO_LARGE
            await c.expect_closed()
        c = await Rpc.open(port)
        assert (await c.call("peek", "q"))["items"] == 30
        await c.aclose()


async def test_garbage_gets_an_error_notification_then_close(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["rpc"]
        for garbage in (b"\xc1", b"GET / HTTP/1.1\r\n\r\n", msgpack.packb({"a": 1}),
                        msgpack.packb([9, 1, "x", []])):
            c = await Rpc.open(port)
            await c.send(garbage)
            msg = await c.message()
            assert msg[0] == 2 and msg[1] == "error" and msg[2][0][0] == E.MALFORMED, msg
            await c.expect_closed()
        c = await Rpc.open(port)
        assert await c.call("version") == __version__  # the server is fine
        await c.aclose()


async def test_a_malformed_request_with_a_msgid_is_answered_and_the_connection_goes_on(
    tmp_path: Path,
) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        await c.send(msgpack.packb([0, 7, "put", "not an array"]))
        _, _, error, _ = await c.response(7)
        assert error[0] == E.MALFORMED
        assert await c.call("version") == __version__
        await c.aclose()


async def test_too_many_waiting_gets_are_refused(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        ids = await c.send_pipelined([("get", "idle", 1, 30_000)] * (MAX_WAITING + 1))
        _, _, error, _ = await c.response(ids[-1])
        assert error[0] == E.BUSY
        assert await c.call("version") == __version__
        await c.aclose()


async def test_notifications(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        # A put as a notification is stored without a reply; a get would only lose its
        # items, so it is ignored.
        await c.send(msgpack.packb([2, "put", ["q", [b"fire", b"forget"]]]))
        await c.send(msgpack.packb([2, "get", ["q", 10]]))
        await c.send(msgpack.packb([2, "no_such_method", []]))
        assert await c.call("get", "q", 10) == [[1, b"fire"], [2, b"forget"]]
        assert c.early == {} and c.notifications == []
        await c.aclose()


async def test_shutdown_answers_waiting_gets_empty(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        mid = await c.send_request("get", "idle", 1, 30_000)
        await trio.testing.wait_all_tasks_blocked()
        server.request_shutdown("test")
        assert (await c.response(mid))[2:] == [None, []]
        await c.expect_closed()


async def test_confirmed_reads_leave_no_timers_behind(tmp_path: Path) -> None:
    # Every open read with a deadline has a timer entry; confirmed ones must not pile
    # up until their deadline (a fast get/confirm loop would grow them without bound).
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        for _ in range(20):
            assert await c.call("put", "q", [b"x"] * 1000) == 1000
            got = await c.call("get", "q", 1000, 0, 60_000)
            assert await c.call("confirm", "q", [i for i, _ in got]) == 1000
        assert len(server.broker.timeouts) <= TIMEOUT_HEAP_MIN + 1000  # not 20,000
        await c.aclose()


async def test_requests_during_shutdown_are_refused_shutting_down(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"x"]) == 1
        # What shutdown does first: the broker stops taking new work (the listeners
        # and this connection stay up for the length of the test).
        server.broker.wake_waiters()
        code, message = await c.error("put", "new_queue", [b"x"])
        assert code == E.SHUTTING_DOWN and "shutting down" in message
        assert await c.call("get", "q", 1, 1_000) == [[1, b"x"]]  # stored items still read
        await c.aclose()
