"""Real-TCP tests of the server: pymemcache (noreply=False) and raw sockets, in process.

Each test runs its own server on free 127.0.0.1 ports over a fresh data directory and
checks the wire behaviour Kestrel's users rely on: FIFO, long polls, reliable reads,
fanout readers, expiry, limits, bad input, the text protocol, many idle connections.
Every wait is bounded (server_util.WAIT); no test sleeps except where real time is
the point (relative expiry, open-read timeouts, long-poll timeouts).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing
from pymemcache.exceptions import (
    MemcacheClientError,
    MemcacheServerError,
    MemcacheUnknownCommandError,
)
from server_util import (
    Conn,
    data_files,
    in_thread,
    make_config,
    pymc,
    running,
    running_conn,
    wait_for_stat,
)
from wait_util import autojumping, wait_for

from queued import __version__
from queued.config import ServerConfig
from queued.server.app import serve

#: Background sweeps never race a test that counts expired items itself.
NO_SWEEP = {"expiration_timer": "1h"}


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def long_poller(port: int, key: str, waiters: int = 1) -> Conn:
    """A new connection whose `get <key>` long-polls, once the server counts `waiters`
    waiting on the key's queue."""
    conn = await Conn.open(port)
    await conn.send(b"get %s\r\n" % key.encode())
    await wait_for_stat(port, f"queue_{key.split('/')[0]}_waiters", waiters)
    return conn


# -- set / get ---------------------------------------------------------------------------------


async def test_pymemcache_set_get_fifo(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        client = pymc(port)
        try:
            for i in range(5):
                assert await in_thread(lambda i=i: client.set("jobs", b"item-%d" % i))
            got = [await in_thread(lambda: client.get("jobs")) for _ in range(5)]
            assert got == [b"item-%d" % i for i in range(5)]
            assert await in_thread(lambda: client.get("jobs")) is None
            # Binary data, CR/LF inside the value and an empty value survive unchanged.
            for value in (bytes(range(256)), b"a\r\nEND\r\nb", b""):
                assert await in_thread(lambda v=value: client.set("bin", v))
                assert await in_thread(lambda: client.get("bin")) == value
        finally:
            client.close()


async def test_value_echoes_the_key_with_options(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q", b"hello") == b"STORED"
        await c.send(b"get q/t=10/open\r\n")
        assert await c.line() == b"VALUE q/t=10/open 0 5"
        assert await c.line() == b"hello"
        assert await c.line() == b"END"
        assert await c.cmd(b"get q/close") == b"END"  # confirms; nothing else to say
        assert await c.cmd(b"get q") == b"END"
        # pymemcache maps replies by key: it only finds the value if the key is echoed.
        assert await c.set("q", b"again") == b"STORED"
        client = pymc(c.port)
        try:
            assert await in_thread(lambda: client.get("q/t=10/open")) == b"again"
            assert await in_thread(lambda: client.get("q/close/t=10")) is None
            assert await in_thread(lambda: client.get("q/t=1")) is None
        finally:
            client.close()


async def test_long_poll_is_answered_by_a_set_on_another_connection(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        producer = await Conn.open(port)
        start = trio.current_time()
        poller = await long_poller(port, "q/t=5000")
        assert await producer.set("q", b"wake") == b"STORED"
        assert await poller.read_value("q/t=5000") == b"wake"
        assert trio.current_time() - start < 4.5
        await poller.aclose()
        await producer.aclose()


async def test_long_poll_waiters_are_served_first_come_first_served(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        pollers = [await long_poller(port, "q/t=5000", n) for n in (1, 2, 3)]
        producer = await Conn.open(port)
        await producer.send(b"".join(b"set q 0 0 1\r\n%d\r\n" % i for i in range(3)))
        assert [await producer.line() for _ in range(3)] == [b"STORED"] * 3
        assert [await p.read_value("q/t=5000") for p in pollers] == [b"0", b"1", b"2"]
        for c in [*pollers, producer]:
            await c.aclose()


async def test_long_poll_times_out_with_end(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(cfg(tmp_path)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            c = await Conn.open(server.ports["memcache"])
            start = trio.current_time()
            assert await c.get("q/t=300") is None
            elapsed = trio.current_time() - start
            assert 0.25 <= elapsed < 3.0
            # The connection is still in step after the timeout.
            assert await c.set("q", b"x") == b"STORED"
            assert await c.get("q/t=300") == b"x"
            await c.aclose()


async def test_long_poll_peek_and_get_waiters(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        peeker = await long_poller(port, "q/t=5000/peek")
        getter = await long_poller(port, "q/t=5000", 2)
        c = await Conn.open(port)
        assert await c.set("q", b"seen-twice") == b"STORED"
        assert await peeker.read_value("q/t=5000/peek") == b"seen-twice"
        assert await getter.read_value("q/t=5000") == b"seen-twice"
        assert await c.get("q") is None
        for conn in (peeker, getter, c):
            await conn.aclose()


async def test_long_poller_skips_an_item_that_arrives_expired(tmp_path: Path) -> None:
    async with running(cfg(tmp_path, **NO_SWEEP)) as server:
        port = server.ports["memcache"]
        poller = await long_poller(port, "q/t=5000")
        c = await Conn.open(port)
        assert await c.set("q", b"dead on arrival", exptime=-1) == b"STORED"
        assert await c.set("q", b"alive") == b"STORED"
        assert await poller.read_value("q/t=5000") == b"alive"
        assert await c.get("q") is None
        for conn in (poller, c):
            await conn.aclose()


async def test_large_values(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        client = pymc(server.ports["memcache"])
        try:
            big = bytes(range(256)) * (4 * 4096)  # 4 MiB
            assert await in_thread(lambda: client.set("big", big))
            assert await in_thread(lambda: client.set("big", big[::-1]))
            assert await in_thread(lambda: client.get("big/open")) == big
            assert await in_thread(lambda: client.get("big/close/open")) == big[::-1]
            assert await in_thread(lambda: client.get("big/close")) is None
        finally:
            client.close()


async def test_thousands_of_pipelined_commands(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        n = 3000
        await c.send(b"".join(b"set many 0 0 5\r\n%05d\r\n" % i for i in range(n)))
        assert [await c.line() for _ in range(n)] == [b"STORED"] * n
        await c.send(b"get many\r\n" * n)
        got = [await c.read_value("many") for _ in range(n)]
        assert got == [b"%05d" % i for i in range(n)]


async def test_max_open_reads_per_connection(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path, "[server]\nmax_open_reads = 2\n")) as c:
        for q in ("q1", "q2", "q3"):
            assert await c.set(q, q.encode()) == b"STORED"
        assert await c.get("q1/open") == b"q1"
        assert await c.get("q2/open") == b"q2"
        assert (await c.cmd(b"get q3/open")).startswith(b"CLIENT_ERROR")
        assert await c.get("q1/close") is None
        assert await c.get("q3/open") == b"q3"
        assert await c.get("q3/close") is None
        assert await c.get("q2/close") is None
        stats = await c.stats()
        assert stats["curr_items"] == "0"


async def test_pipelined_commands_answer_in_order(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"".join(b"set p 0 0 %d\r\nv%03d\r\n" % (4, i) for i in range(100)))
        assert [await c.line() for _ in range(100)] == [b"STORED"] * 100
        # sets and gets mixed in one send: each reply in its place.
        await c.send(b"get p\r\nset p 0 0 1\r\nz\r\nget p\r\nversion\r\n")
        assert await c.read_value("p") == b"v000"
        assert await c.line() == b"STORED"
        assert await c.read_value("p") == b"v001"
        assert await c.line() == b"VERSION " + __version__.encode()
        got = [await c.get("p") for _ in range(98)]
        assert got == [b"v%03d" % i for i in range(2, 100)]
        assert await c.get("p") == b"z"
        assert await c.get("p") is None


async def test_pipelined_requests_run_together_answer_each(tmp_path: Path) -> None:
    """Pipelined sets to one queue are one append and pipelined plain gets of one key one
    take (Request.count), but each request keeps its own answer and its own count: a full
    queue refuses exactly the sets past its limit, gets past the items answer END."""
    async with running_conn(cfg(tmp_path, "[queues.full]\nmax_items = 3\n")) as c:
        await c.send(b"".join(b"set full 0 0 2\r\nf%d\r\n" % i for i in range(5)))
        assert [await c.line() for _ in range(5)] == [b"STORED"] * 3 + [b"NOT_STORED"] * 2
        await c.send(b"get full\r\n" * 5)
        assert [await c.read_value("full") for _ in range(5)] == [b"f0", b"f1", b"f2",
                                                                  None, None]
        # a run broken by another key, an option, a noreply set: each still in its place
        await c.send(b"set a 0 0 1\r\n1\r\nset a 0 0 1\r\n2\r\nset b 0 0 1\r\n3\r\n"
                     b"set a 0 0 1 noreply\r\n4\r\nset a 0 0 1\r\n5\r\n"
                     b"get a\r\nget a/peek\r\nget a\r\nget a\r\nget b\r\nget a\r\n")
        assert [await c.line() for _ in range(4)] == [b"STORED"] * 4
        assert [await c.read_value(k) for k in ("a", "a/peek", "a", "a", "b", "a")] == [
            b"1", b"2", b"2", b"4", b"3", b"5"]
        stats = await c.stats()
        # (a peek is a hit, not a cmd_get)
        assert (stats["cmd_set"], stats["cmd_get"], stats["cmd_peek"], stats["get_hits"],
                stats["get_misses"]) == ("10", "10", "1", "9", "2")
        assert stats["total_items"] == "8"


async def test_pipelined_gets_with_a_read_open_answer_one_error_and_close(
        tmp_path: Path) -> None:
    """Kestrel: a plain get while a read is open on the queue is ERROR and the connection
    closes; pipelined plain gets joined into one still answer that once, then close."""
    async with running(cfg(tmp_path)) as server:
        c = await Conn.open(server.ports["memcache"])
        await c.store("q", b"a", b"b", b"c")
        assert await c.get("q/open") == b"a"
        await c.send(b"get q\r\nget q\r\nget q\r\n")
        assert await c.expect_closed() == b"ERROR\r\n"
        await c.aclose()
        other = await Conn.open(server.ports["memcache"])  # a's read went back; b, c stay
        assert [await other.get("q") for _ in range(4)] == [b"a", b"b", b"c", None]
        await other.aclose()


async def test_noreply_set_is_silent(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set q 0 0 1 noreply\r\na\r\nset q 0 0 1 noreply\r\nb\r\n")
        assert await c.get("q") == b"a"
        assert await c.get("q") == b"b"


# -- reliable reads ----------------------------------------------------------------------------


async def test_open_close_and_close_open(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.store("q", b"a", b"b", b"c")
        assert await c.get("q/open") == b"a"
        stats = await wait_for_stat(c.port, "queue_q_open_transactions", 1)
        assert stats["queue_q_items"] == "2"
        assert await c.get("q/close/open") == b"b"  # confirms a, opens b
        assert await c.get("q/close") is None  # confirms b
        await wait_for_stat(c.port, "queue_q_open_transactions", 0)
        assert await c.get("q/close") is None  # nothing open: still just END
        assert await c.get("q") == b"c"
        assert await c.get("q") is None


async def test_abort_puts_the_item_back_at_the_head(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.store("q", b"a", b"b")
        assert await c.get("q/open") == b"a"
        assert await c.get("q/abort") is None
        assert await c.get("q/open") == b"a"  # same item again, before b
        assert await c.get("q/abort") is None
        assert await c.get("q/abort") is None  # nothing open: END
        assert await c.get("q") == b"a"
        assert await c.get("q") == b"b"


@pytest.mark.parametrize("second", [b"get q/open", b"get q", b"get q/t=50/open"])
async def test_second_read_while_one_is_open_is_an_error(tmp_path: Path, second: bytes) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.store("q", b"a", b"b")
        assert await c.get("q/open") == b"a"
        assert await c.get("q/peek") == b"b"  # peeking is allowed meanwhile
        assert await c.cmd(second) == b"ERROR"
        assert await c.expect_closed() == b""
        # The connection is gone, so its open read went back to the head.
        other = await Conn.open(c.port)
        assert await other.get("q") == b"a"
        assert await other.get("q") == b"b"
        await other.aclose()


async def test_open_reads_on_two_queues_are_independent(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q1", b"1") == b"STORED"
        assert await c.set("q2", b"2") == b"STORED"
        assert await c.get("q1/open") == b"1"
        assert await c.get("q2/open") == b"2"
        assert await c.get("q1/close") is None
        assert await c.get("q2/abort") is None
        assert await c.get("q2") == b"2"
        assert await c.get("q1") is None


async def test_disconnect_with_open_read_feeds_a_long_poller(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        reader = await Conn.open(port)
        assert await reader.set("q", b"precious") == b"STORED"
        assert await reader.get("q/open") == b"precious"
        poller = await long_poller(port, "q/t=5000/open")
        await reader.aclose()  # the open read must go to the waiting poller
        assert await poller.read_value("q/t=5000/open") == b"precious"
        assert await poller.get("q/close") is None
        stats = await wait_for_stat(port, "queue_q_open_transactions", 0)
        assert stats["queue_q_items"] == "0"
        await poller.aclose()


async def test_disconnected_long_poller_does_not_swallow_an_item(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        gone = await long_poller(port, "q/t=3000")
        await gone.aclose()
        await wait_for_stat(port, "queue_q_waiters", 0)  # the server has seen the FIN
        c = await Conn.open(port)
        assert await c.set("q", b"for-a-live-client") == b"STORED"
        assert await c.get("q/t=1000") == b"for-a-live-client"
        await c.aclose()


async def test_open_read_held_by_a_long_poll_cancelled_by_shutdown_returns(tmp_path: Path) -> None:
    """Shutdown answers waiting gets with END; an open read comes back after restart."""
    config = cfg(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            port = server.ports["memcache"]
            holder = await Conn.open(port)
            assert await holder.set("q", b"held") == b"STORED"
            assert await holder.get("q/open") == b"held"
            poller = await long_poller(port, "other/t=20000")
            ctl = await Conn.open(port)
            await ctl.send(b"shutdown\r\n")
            assert await ctl.expect_closed() == b""
            assert await poller.line() == b"END"
            await poller.expect_closed()
            await holder.expect_closed()
        # serve() returned: the listeners are closed.
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
        async with running(config) as server2:
            c = await Conn.open(server2.ports["memcache"])
            assert await c.get("q") == b"held"
            await c.aclose()


# -- peek and option combinations --------------------------------------------------------------


async def test_peek_does_not_remove(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.get("q/peek") is None
        assert await c.set("q", b"a") == b"STORED"
        assert await c.get("q/peek") == b"a"
        assert await c.get("q/peek") == b"a"
        assert await c.get("q") == b"a"
        assert await c.get("q/peek") is None


@pytest.mark.parametrize("key", [
    "q/peek/open", "q/abort/open", "q/peek/abort", "q/peek/close", "q/abort/close",
    "q/bogus", "q/t=abc", "q/t=-1", "q/t=99999999999",
])
async def test_invalid_get_options_are_client_error_and_close(tmp_path: Path, key: str) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q", b"a") == b"STORED"
        assert (await c.cmd(b"get " + key.encode())).startswith(b"CLIENT_ERROR")
        assert await c.expect_closed() == b""
        other = await Conn.open(c.port)
        assert await other.get("q") == b"a"  # untouched
        await other.aclose()


async def test_pymemcache_sees_errors(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        client = pymc(server.ports["memcache"])
        try:
            with pytest.raises(MemcacheClientError):
                await in_thread(lambda: client.get("q/peek/open"))
            client.close()
            assert await in_thread(lambda: client.set("q", b"x"))
            assert await in_thread(lambda: client.get("q/open")) == b"x"
            with pytest.raises(MemcacheUnknownCommandError):
                await in_thread(lambda: client.get("q/open"))
        finally:
            client.close()


# -- expiry ------------------------------------------------------------------------------------


async def test_relative_exptime_expires(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path, **NO_SWEEP)) as c:
        assert await c.set("q", b"short", exptime=1) == b"STORED"
        assert await c.set("q", b"long", exptime=100) == b"STORED"
        # exptime counts whole seconds of the wall clock: wait until the first has gone
        await wait_for(lambda: c.get("q/peek"), lambda head: head == b"long")
        assert await c.get("q") == b"long"
        assert await c.get("q") is None
        stats = await c.stats()
        assert stats["queue_q_expired_items"] == "1"


async def test_absolute_exptime_and_flush_expired(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path, **NO_SWEEP)) as c:
        now = int(time.time())
        assert await c.set("q", b"past1", exptime=now - 10) == b"STORED"
        assert await c.set("q", b"past2", exptime=now - 5) == b"STORED"
        assert await c.set("q", b"future", exptime=now + 3600) == b"STORED"
        assert await c.set("q", b"negative", exptime=-1) == b"STORED"
        assert await c.set("q", b"forever") == b"STORED"
        assert await c.cmd(b"flush_expired q") == b"2"  # only the head run of expired items
        assert await c.get("q") == b"future"
        assert await c.cmd(b"flush_expired q") == b"1"
        assert await c.get("q") == b"forever"
        assert await c.cmd(b"flush_expired nosuchqueue") == b"0"
        assert await c.set("q", b"gone", exptime=now - 1) == b"STORED"
        assert await c.cmd(b"flush_all_expired") == b"1"
        assert await c.get("q") is None


async def test_max_age_expires_items(tmp_path: Path) -> None:
    toml = '[queues.aged]\nmax_age = "300ms"\n'
    async with running_conn(cfg(tmp_path, toml, **NO_SWEEP)) as c:
        assert await c.set("aged", b"a") == b"STORED"
        assert await c.set("fresh", b"f") == b"STORED"
        assert await c.get("aged/peek") == b"a"
        await wait_for(lambda: c.get("aged/peek"), lambda head: head is None)  # wall clock
        assert await c.get("aged") is None
        assert await c.get("fresh") == b"f"  # other queues keep the default (no max_age)


async def test_expired_items_move_to_expire_to_queue(tmp_path: Path) -> None:
    toml = '[queues.src]\nexpire_to_queue = "dst"\n'
    async with running_conn(cfg(tmp_path, toml, **NO_SWEEP)) as c:
        past = int(time.time()) - 60
        assert await c.set("src", b"old", exptime=past) == b"STORED"
        assert await c.set("src", b"live") == b"STORED"
        assert await c.get("src") == b"live"
        assert await c.get("dst/t=2000") == b"old"
        assert await c.get("src") is None


async def test_background_sweep_expires(tmp_path: Path) -> None:
    toml = '[server]\nexpiration_timer = "50ms"\n[queues.src]\nexpire_to_queue = "dst"\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        assert await c.set("src", b"old", exptime=-1) == b"STORED"
        # Nobody reads src: the sweep alone must move the item.
        assert await c.get("dst/t=3000") == b"old"


async def test_max_queue_age_deletes_an_idle_empty_queue(tmp_path: Path) -> None:
    toml = '[server]\nexpiration_timer = "50ms"\n[queues.tmp]\nmax_queue_age = "100ms"\n'
    data = tmp_path / "data"
    async with running_conn(cfg(tmp_path, toml)) as c:
        assert await c.set("tmp", b"x") == b"STORED"
        assert await c.set("keep", b"y") == b"STORED"
        assert await c.get("tmp") == b"x"
        stats = await wait_for_stat(c.port, "queue_expires", 1)
        assert "queue_tmp_items" not in stats
        assert stats["queue_keep_items"] == "1"
        assert not any(f.startswith("tmp.") for f in data_files(data))


# -- queue names -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    b"get a.b", b"get ../etc", b"get " + b"n" * 251, b"get q+a.b", b"get q+", b"get +r",
    b"get a\\b", b"get \xc3\xa9",
])
async def test_bad_names_in_get_are_client_error(tmp_path: Path, command: bytes) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert (await c.cmd(command)).startswith(b"CLIENT_ERROR")
        await c.expect_closed()
        assert data_files(tmp_path / "data") == []


@pytest.mark.parametrize("name", [b"a/b", b"a.b", b"..", b"n" * 251, b"q+r", b"q*"])
async def test_bad_names_in_set_are_client_error(tmp_path: Path, name: bytes) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set %s 0 0 5\r\nhello\r\n" % name)
        assert (await c.line()).startswith(b"CLIENT_ERROR")
        # The data block was skipped: the connection is still in step.
        assert await c.cmd(b"version") == b"VERSION " + __version__.encode()
        for cmd in (b"delete %s", b"flush %s", b"flush_expired %s"):
            if name == b"q+r":
                continue  # a valid address for these commands
            assert (await c.cmd(cmd % name)).startswith(b"CLIENT_ERROR")
        await c.aclose()
        assert data_files(tmp_path / "data") == []


async def test_queue_names_must_fit_in_a_file_name(tmp_path: Path) -> None:
    # The grammar allows 250 characters, but `<q>.<14 digits>~~` must fit in 255 bytes:
    # 238 is the longest queue name; longer ones are refused before any file exists.
    async with running_conn(cfg(tmp_path)) as c:
        reply = await c.set("n" * 239, b"x")
        assert reply.startswith(b"CLIENT_ERROR") and b"too long" in reply, reply
        assert data_files(tmp_path / "data") == []
        assert await c.set("n" * 238, b"x") == b"STORED"
        assert await c.get("n" * 238) == b"x"


async def test_longest_valid_reader_name_does_not_crash_the_server(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q", b"x") == b"STORED"
        reply = await c.cmd(b"get q+" + b"r" * 250)
        assert reply.startswith(b"CLIENT_ERROR") and b"too long" in reply, reply
        assert await c.cmd(b"get q+" + b"r" * 241) == b"VALUE q+" + b"r" * 241 + b" 0 1"
        other = await Conn.open(c.port)
        assert await other.cmd(b"version") == b"VERSION " + __version__.encode()
        await other.aclose()


# -- admin commands ----------------------------------------------------------------------------


async def test_delete_removes_the_queue_and_its_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        client = pymc(port)
        try:
            assert await in_thread(lambda: client.set("doomed", b"x"))
            assert await in_thread(lambda: client.set("kept", b"y"))
            assert any(f.startswith("doomed.") for f in data_files(data))
            assert await in_thread(lambda: client.delete("doomed"))
            assert not any(f.startswith("doomed.") for f in data_files(data))
            assert any(f.startswith("kept.") for f in data_files(data))
            assert await in_thread(lambda: client.get("doomed")) is None
            assert await in_thread(lambda: client.get("kept")) == b"y"
        finally:
            client.close()
        c = await Conn.open(port)
        stats = await c.stats()
        assert "queue_doomed_items" in stats  # the get above made a new, empty queue
        assert stats["queue_deletes"] == "1"
        await c.aclose()


async def test_delete_wakes_a_long_poller(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        poller = await long_poller(port, "q/t=20000")
        c = await Conn.open(port)
        assert await c.cmd(b"delete q") == b"DELETED"
        assert await poller.read_value("q/t=20000", timeout=5) is None
        # The queue can be used again at once.
        assert await c.set("q", b"new") == b"STORED"
        assert await poller.get("q") == b"new"
        for conn in (poller, c):
            await conn.aclose()


async def test_open_read_on_a_deleted_queue_does_not_lock_the_client_out(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q", b"old") == b"STORED"
        assert await c.get("q/open") == b"old"
        admin = await Conn.open(c.port)
        assert await admin.cmd(b"delete q") == b"DELETED"
        assert await admin.set("q", b"new") == b"STORED"
        assert await c.get("q/close") is None
        assert await c.get("q/open") == b"new"
        assert await c.get("q/close") is None
        await admin.aclose()


async def test_flush_and_flush_all(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        for q in ("a", "b"):
            for i in range(3):
                assert await c.set(q, b"%d" % i) == b"STORED"
        assert await c.cmd(b"flush a") == b"END"
        assert await c.get("a") is None
        assert await c.get("b") == b"0"
        assert await c.cmd(b"flush_all") == b"Flushed all queues."
        assert await c.get("b") is None
        stats = await c.stats()
        assert stats["curr_items"] == "0"


async def test_stats_use_kestrel_names(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        client = pymc(port)
        try:
            for v in (b"a", b"b", b"c"):
                assert await in_thread(lambda v=v: client.set("q", v))
            assert await in_thread(lambda: client.get("q")) == b"a"
            assert await in_thread(lambda: client.get("q/open")) == b"b"
            assert await in_thread(lambda: client.get("empty")) is None
            stats = await in_thread(client.stats)
        finally:
            client.close()
        stats = {k.decode(): v for k, v in stats.items()}
        assert stats["cmd_set"] == 3
        assert stats["cmd_get"] == 3
        assert stats["get_hits"] == 2
        assert stats["get_misses"] == 1
        assert stats["total_items"] == 3
        assert stats["curr_items"] == 1
        assert stats["curr_connections"] == 1
        assert stats["queue_q_items"] == 1
        assert stats["queue_q_open_transactions"] == 1
        assert stats["queue_empty_items"] == 0
        assert stats["version"] == __version__.encode()
        for name in ("uptime", "time", "bytes", "total_connections", "queue_q_bytes",
                     "queue_q_total_items", "queue_q_logsize", "queue_q_expired_items",
                     "queue_q_mem_items", "queue_q_mem_bytes", "queue_q_age",
                     "queue_q_discarded", "queue_q_waiters"):
            assert name in stats, name
        # The pymemcache connection has gone: its open read is back in the queue.
        await wait_for_stat(port, "queue_q_open_transactions", 0)
        c = await Conn.open(port)
        await c.send(b"dump_stats\r\n")
        lines = await c.lines_until(b"END")
        assert lines[0] == b"queue 'empty' {"
        q_block = lines[lines.index(b"queue 'q' {"):]
        assert b"  items=2" in q_block
        assert b"  open_transactions=0" in q_block
        assert await c.cmd(b"version") == b"VERSION " + __version__.encode()
        await c.send(b"quit\r\n")
        assert await c.expect_closed() == b""


async def test_reload_applies_queue_settings(tmp_path: Path) -> None:
    config = cfg(tmp_path, "[queues.r]\nmax_items = 1\n")
    assert config.config_file is not None
    async with running(config) as server:
        client = pymc(server.ports["memcache"])
        try:
            assert await in_thread(lambda: client.set("r", b"1"))
            assert not await in_thread(lambda: client.set("r", b"2"))
            config.config_file.write_text("[queues.r]\nmax_items = 3\n")
            assert await in_thread(lambda: client.raw_command("reload")) == b"Reloaded config."
            assert await in_thread(lambda: client.set("r", b"2"))
            assert await in_thread(lambda: client.set("r", b"3"))
            assert not await in_thread(lambda: client.set("r", b"4"))
            for broken in ("[queues.r]\nmax_items = \n",  # not TOML
                           "[queues.r]\nmax_itemz = 10\n",  # unknown key
                           "[queues.r]\nmax_items = -1\n"):  # bad value
                config.config_file.write_text(broken)
                with pytest.raises(MemcacheServerError, match="reload failed"):
                    await in_thread(lambda: client.raw_command("reload"))
            assert not await in_thread(lambda: client.set("r", b"4"))  # still max_items = 3
            assert await in_thread(lambda: client.get("r")) == b"1"
            assert await in_thread(lambda: client.set("r", b"4"))
        finally:
            client.close()


async def test_unsupported_storage_commands_are_refused(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"add q 0 0 1\r\na\r\nappend q 0 0 1\r\nb\r\n")
        assert (await c.line()).startswith(b"CLIENT_ERROR")
        assert (await c.line()).startswith(b"CLIENT_ERROR")
        assert (await c.cmd(b"get a b")).startswith(b"CLIENT_ERROR")  # multi-key get
        assert (await c.set("q+r", b"x")).startswith(b"CLIENT_ERROR")  # write to a reader
        assert await c.get("q") is None


async def test_monitor_and_confirm_over_memcache(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.store("q", b"a", b"b", b"c")
        await c.send(b"monitor q 2 2\r\n")
        assert await c.read_block("q") == b"a"
        assert await c.read_block("q") == b"b"
        # Its END is test_monitor_ends_with_end's business: skip it if present.
        await c.send(b"confirm q 1\r\nversion\r\n")
        assert set(await c.lines_until(b"VERSION " + __version__.encode())) <= {
            b"END", b"VERSION " + __version__.encode()}
        stats = await c.stats()
        assert stats["queue_q_open_transactions"] == "1"
        assert stats["queue_q_items"] == "1"
        await c.aclose()  # b was not confirmed: back to the head
        other = await Conn.open(c.port)
        assert await other.get("q/t=1000") == b"b"
        assert await other.get("q") == b"c"
        assert await other.get("q") is None
        await other.aclose()


@pytest.mark.parametrize("proto", ["memcache", "text"])
async def test_monitor_ends_with_end(tmp_path: Path, proto: str) -> None:
    async with running(cfg(tmp_path)) as server:
        if proto == "memcache":
            c = await Conn.open(server.ports["memcache"])
            assert await c.set("q", b"a") == b"STORED"
            await c.send(b"monitor q 1 1\r\nversion\r\n")
            assert await c.read_block("q") == b"a"
            assert await c.line() == b"END"
        else:
            c = await Conn.open(server.ports["text"], newline=b"\n")
            await c.send(b"put q:\na\n\nmonitor q 100 1\nversion\n")
            assert await c.line() == b"+1"
            assert await c.line() == b":a"
            assert await c.line() == b"*"
        await c.aclose()


# -- limits ------------------------------------------------------------------------------------


async def test_max_items_full_is_not_stored(tmp_path: Path) -> None:
    toml = "[queues.small]\nmax_items = 2\n[queues.ring]\nmax_items = 2\n" \
           "discard_old_when_full = true\n[queues.bytes]\nmax_size = \"10B\"\n"
    async with running(cfg(tmp_path, toml)) as server:
        client = pymc(server.ports["memcache"])
        try:
            assert [await in_thread(lambda i=i: client.set("small", b"%d" % i))
                    for i in range(3)] == [True, True, False]
            assert [await in_thread(lambda i=i: client.set("ring", b"%d" % i))
                    for i in range(4)] == [True] * 4
            assert [await in_thread(lambda: client.get("small")) for _ in range(3)] == \
                [b"0", b"1", None]
            assert [await in_thread(lambda: client.get("ring")) for _ in range(3)] == \
                [b"2", b"3", None]
            assert await in_thread(lambda: client.set("bytes", b"x" * 6))
            assert not await in_thread(lambda: client.set("bytes", b"x" * 6))
            assert await in_thread(lambda: client.set("bytes", b"x" * 4))
            stats = {k.decode(): v for k, v in (await in_thread(client.stats)).items()}
            assert stats["queue_ring_discarded"] == 2
            assert stats["queue_bytes_items"] == 2
        finally:
            client.close()


async def test_queue_max_item_size_is_not_stored(tmp_path: Path) -> None:
    toml = '[queues.tiny]\nmax_item_size = "10B"\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        assert await c.set("tiny", b"x" * 11) == b"NOT_STORED"
        assert await c.set("tiny", b"x" * 10) == b"STORED"
        assert await c.set("other", b"x" * 11) == b"STORED"
        assert await c.get("tiny") == b"x" * 10
        assert await c.get("tiny") is None


async def test_huge_declared_item_is_refused_without_reading_it(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set q 0 0 999999999999\r\n" + b"z" * 100_000)
        assert await c.line() == b"NOT_STORED"
        await c.aclose()  # half of nothing: the rest is never sent
        other = await Conn.open(c.port)
        assert await other.get("q") is None
        assert (await other.stats())["curr_connections"] == "1"
        await other.aclose()


async def test_item_over_server_max_item_size_is_skipped(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path, max_item_size="1KiB")) as c:
        payload = (b"get q\r\n" * 800)[:5000]  # looks like commands: must not run
        big = b"set q 0 0 5000\r\n" + payload + b"\r\n"
        await c.send(big[:3000])
        assert await c.line() == b"NOT_STORED"
        await c.send(big[3000:])
        assert await c.set("q", b"small") == b"STORED"  # the 5000 bytes were skipped
        assert await c.get("q") == b"small"
        assert await c.get("q") is None


async def test_read_behind_backlog_bigger_than_memory(tmp_path: Path) -> None:
    toml = '[queues.deep]\nmax_memory_size = "1KiB"\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        values = [b"%04d" % i + b"." * 96 for i in range(300)]
        await c.send(b"".join(b"set deep 0 0 100\r\n%s\r\n" % v for v in values))
        assert [await c.line() for _ in range(300)] == [b"STORED"] * 300
        stats = await c.stats()
        assert stats["queue_deep_items"] == "300"
        assert int(stats["queue_deep_mem_bytes"]) <= 2048
        got = []
        for i in range(300):
            if i % 7 == 0:  # an abort now and then: the item comes back first
                assert await c.get("deep/open") == values[i]
                assert await c.get("deep/abort") is None
            got.append(await c.get("deep"))
            if i == 150:  # more puts while the reader is behind
                await c.send(b"".join(b"set deep 0 0 100\r\n%s\r\n" % v for v in values[:50]))
                assert [await c.line() for _ in range(50)] == [b"STORED"] * 50
        assert got == values
        assert [await c.get("deep") for _ in range(51)] == [*values[:50], None]


# -- fanout ------------------------------------------------------------------------------------


async def test_fanout_readers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running_conn(cfg(tmp_path)) as c:
        await c.store("q", b"1", b"2")
        # The first named reader takes over the default reader's backlog.
        assert await c.get("q+a") == b"1"
        # A second reader starts at the tail, and so does a new default reader.
        assert await c.get("q+b") is None
        assert await c.get("q") is None
        assert "q.read.a" in data_files(data)
        assert "q.read.b" in data_files(data)
        await c.store("q", b"3", b"4")
        assert [await c.get("q+a") for _ in range(4)] == [b"2", b"3", b"4", None]
        assert [await c.get("q+b") for _ in range(3)] == [b"3", b"4", None]
        assert [await c.get("q") for _ in range(3)] == [b"3", b"4", None]
        # Reliable reads per reader.
        assert await c.set("q", b"5") == b"STORED"
        assert await c.get("q+a/open") == b"5"
        assert await c.get("q+b/open") == b"5"
        assert await c.get("q+a/abort") is None
        assert await c.get("q+b/close") is None
        assert await c.get("q+a") == b"5"
        assert await c.get("q+b") is None
        stats = await c.stats()
        assert stats["queue_q+a_items"] == "0"
        assert stats["queue_q+b_items"] == "0"
        # Deleting one reader leaves the other.
        assert await c.cmd(b"delete q+b") == b"DELETED"
        assert "q.read.b" not in data_files(data)
        assert await c.set("q", b"6") == b"STORED"
        assert await c.get("q+a") == b"6"


async def test_open_read_survives_the_fanout_takeover(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        a, b = await Conn.open(port), await Conn.open(port)
        await a.store("q", b"x", b"y")
        assert await a.get("q/open") == b"x"
        assert await b.get("q+a") == b"y"  # takes over the default reader, x still open
        assert await a.get("q/close") is None  # a confirms x
        await a.aclose()
        await wait_for_stat(port, "curr_connections", 2)  # b and the poller: a has gone
        assert await b.get("q+a") is None  # x was confirmed: never again


async def test_fanout_long_pollers_each_get_the_item(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.get("q+a") is None
        assert await c.get("q+b") is None
        pa, pb = await long_poller(c.port, "q+a/t=5000"), await long_poller(c.port, "q+b/t=5000")
        assert await c.set("q", b"both") == b"STORED"
        assert await pa.read_value("q+a/t=5000") == b"both"
        assert await pb.read_value("q+b/t=5000") == b"both"
        for conn in (pa, pb):
            await conn.aclose()


# -- error queue and open-read timeout ---------------------------------------------------------


async def test_item_aborted_max_errors_times_goes_to_the_error_queue(tmp_path: Path) -> None:
    toml = '[queues.work]\nerror_queue = "dead"\nmax_errors = 2\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        await c.store("work", b"poison", b"fine")
        assert await c.get("work/open") == b"poison"
        assert await c.get("work/abort") is None
        assert await c.get("work/open") == b"poison"  # one error: still here
        assert await c.get("work/abort") is None
        assert await c.get("dead/t=2000") == b"poison"
        assert await c.get("work") == b"fine"
        assert await c.get("work") is None


async def test_disconnects_count_as_errors(tmp_path: Path) -> None:
    toml = '[queues.work]\nerror_queue = "dead"\nmax_errors = 2\n'
    async with running(cfg(tmp_path, toml)) as server:
        port = server.ports["memcache"]
        admin = await Conn.open(port)
        assert await admin.set("work", b"crashy") == b"STORED"
        for _ in range(2):
            c = await Conn.open(port)
            assert await c.get("work/t=2000/open") == b"crashy"
            await c.aclose()
        assert await admin.get("dead/t=2000") == b"crashy"
        assert await admin.get("work") is None
        await admin.aclose()


async def test_open_transaction_timeout_returns_the_item(tmp_path: Path) -> None:
    toml = '[queues.t]\nopen_transaction_timeout = "200ms"\n'
    async with running(cfg(tmp_path, toml)) as server:
        port = server.ports["memcache"]
        slow = await Conn.open(port)
        assert await slow.set("t", b"job") == b"STORED"
        assert await slow.get("t/open") == b"job"
        start = trio.current_time()
        fast = await Conn.open(port)
        assert await fast.get("t/t=5000/open") == b"job"
        assert 0.15 <= trio.current_time() - start < 4.5
        assert await fast.get("t/close") is None
        # The slow client's read is gone: its close confirms nothing, and it may open again.
        assert await slow.get("t/close") is None
        assert await slow.set("t", b"next") == b"STORED"
        assert await slow.get("t/open") == b"next"
        assert await slow.get("t/close") is None
        stats = await slow.stats()
        assert stats["queue_t_items"] == "0"
        assert stats["queue_t_open_transactions"] == "0"
        for conn in (slow, fast):
            await conn.aclose()


# -- bad input ---------------------------------------------------------------------------------


async def test_garbage_lines_are_errors_and_the_connection_survives(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        c = await Conn.open(server.ports["memcache"])
        for garbage in (b"hello world", b"", b"\x00\xff\xfe", b"GETT q", b"set"):
            reply = await c.cmd(garbage)
            if garbage == b"set":  # a storage command without a length cannot keep framing
                assert reply.startswith(b"CLIENT_ERROR")
                await c.expect_closed()
                c = await Conn.open(server.ports["memcache"])
                continue
            assert reply == b"ERROR", (garbage, reply)
        assert await c.set("q", b"ok") == b"STORED"
        assert await c.get("q") == b"ok"
        await c.aclose()


async def test_half_sent_item_is_not_stored_and_nothing_is_lost(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        assert await c.set("q", b"before") == b"STORED"
        assert await c.get("q/open") == b"before"
        await c.send(b"set q 0 0 5\r\nwhole\r\nset q 0 0 10\r\nabc")
        assert await c.line() == b"STORED"
        await c.aclose()
        other = await Conn.open(c.port)
        assert await other.get("q/t=1000") == b"before"  # the open read came back
        assert await other.get("q") == b"whole"
        assert await other.get("q") is None  # the half item was not stored
        await wait_for_stat(c.port, "curr_connections", 2)  # other + the stats poller
        assert (await other.stats())["curr_items"] == "0"
        await other.aclose()


async def test_half_closed_client_still_gets_its_replies(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set q 0 0 1\r\na\r\nget q/t=200\r\nget q/t=200\r\n")
        await c.stream.send_eof()  # like `printf ... | nc -N`
        rest = await c.expect_closed()
        assert rest == b"STORED\r\nVALUE q/t=200 0 1\r\na\r\nEND\r\nEND\r\n"


async def test_quit_ends_the_batch(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set q 0 0 1\r\na\r\nquit\r\nset q 0 0 1\r\nb\r\n")
        assert await c.expect_closed() == b"STORED\r\n"
        other = await Conn.open(c.port)
        assert await other.get("q") == b"a"
        assert await other.get("q") is None
        await other.aclose()


async def test_bad_data_block_terminator_closes(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"set q 0 0 1\r\nabc\r\nget q\r\n")
        assert (await c.line()).startswith(b"CLIENT_ERROR")
        assert await c.expect_closed() == b""
        other = await Conn.open(c.port)
        assert await other.get("q") is None
        await other.aclose()


@pytest.mark.parametrize("newline", [True, False])
async def test_line_over_max_line_is_client_error_and_close(tmp_path: Path, newline: bool) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        await c.send(b"get " + b"q" * 5000 + (b"\r\n" if newline else b""))
        assert (await c.line()).startswith(b"CLIENT_ERROR")
        assert await c.expect_closed() == b""


async def test_one_byte_at_a_time(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path)) as c:
        c.stream.setsockopt(6, 1, 1)  # TCP_NODELAY: really separate segments
        for b in b"set q 0 0 3\r\nabc\r\nget q/open\r\n":
            await c.send(bytes([b]))
        assert await c.line() == b"STORED"
        assert await c.read_value("q/open") == b"abc"


# -- text protocol -----------------------------------------------------------------------------


async def text(server_ports: dict[str, int]) -> Conn:
    return await Conn.open(server_ports["text"], newline=b"\n")


async def reply_after_monitor(conn: Conn, command: bytes, terminator: bytes) -> bytes:
    """The reply to `command`, skipping the monitor's terminator if it was sent."""
    await conn.send(command + conn.newline)
    line = await conn.line()
    return await conn.line() if line == terminator else line


async def test_text_protocol_basics(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        t = await text(server.ports)
        await t.send(b"put q:\nA\nB\n\n")
        assert await t.line() == b"+2"
        assert await t.cmd(b"get q") == b":A"
        assert await t.cmd(b"peek q") == b":B"
        assert await t.cmd(b"get q") == b":B"
        start = trio.current_time()
        assert await t.cmd(b"get q 100") == b"*"
        assert trio.current_time() - start >= 0.09
        assert await t.cmd(b"peek q") == b"*"
        assert await t.cmd(b"version") == b":" + __version__.encode()
        assert (await t.cmd(b"bogus")).startswith(b"-")
        assert (await t.cmd(b"get a.b")).startswith(b"-")
        await t.send(b"put q:\nC\n\n")
        assert await t.line() == b"+1"
        assert await t.cmd(b"flush q") == b"+0"
        assert await t.cmd(b"get q") == b"*"
        await t.send(b"put q:\nD\n\n")
        assert await t.line() == b"+1"
        assert await t.cmd(b"delete q") == b"+0"
        assert await t.cmd(b"get q") == b"*"
        await t.send(b"quit\n")
        await t.expect_closed()


async def test_text_long_poll_gets_a_memcache_set(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        t = await text(server.ports)
        await t.send(b"get q 5000\n")
        await wait_for_stat(server.ports["memcache"], "queue_q_waiters", 1)
        m = await Conn.open(server.ports["memcache"])
        assert await m.set("q", b"cross") == b"STORED"
        assert await t.line() == b":cross"
        for c in (t, m):
            await c.aclose()


async def test_text_monitor_and_confirm(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        t = await text(server.ports)
        await t.send(b"put q:\n1\n2\n3\n4\n\n")
        assert await t.line() == b"+4"
        await t.send(b"monitor q 200 5\n")  # 4 items at once, then 200 ms for a fifth
        assert [await t.line() for _ in range(4)] == [b":1", b":2", b":3", b":4"]
        assert await reply_after_monitor(t, b"confirm q 2", b"*") == b"+2"
        await t.aclose()  # 3 and 4 were not confirmed: back to the head, in order
        m = await Conn.open(server.ports["memcache"])
        assert await m.get("q/t=2000") == b"3"
        assert await m.get("q") == b"4"
        assert await m.get("q") is None
        await m.aclose()


async def test_text_get_after_monitor_confirms_the_right_item(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        t = await text(server.ports)
        await t.send(b"put q:\nA\nB\nC\n\n")
        assert await t.line() == b"+3"
        await t.send(b"monitor q 200 1\n")
        assert await t.line() == b":A"  # A is open, unconfirmed
        assert await reply_after_monitor(t, b"get q", b"*") == b":B"  # B is taken for good
        await t.aclose()  # A was never confirmed: it must come back; B must not
        m = await Conn.open(server.ports["memcache"])
        assert [await m.get("q/t=1000") for _ in range(3)] == [b"A", b"C", None]
        await m.aclose()


async def test_text_get_refuses_an_item_with_a_newline(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        m = await Conn.open(server.ports["memcache"])
        assert await m.set("q", b"two\nlines") == b"STORED"
        t = await text(server.ports)
        assert (await t.cmd(b"get q")).startswith(b"-")
        assert (await t.cmd(b"peek q")).startswith(b"-")
        assert (await t.cmd(b"get q")).startswith(b"-")  # still there, still refused
        await t.aclose()
        assert await m.get("q") == b"two\nlines"
        stats = await m.stats()
        assert stats["queue_q_items"] == "0"
        assert stats["queue_q_open_transactions"] == "0"
        await m.aclose()


async def test_text_line_too_long_closes(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        t = await text(server.ports)
        await t.send(b"get " + b"q" * 5000 + b"\n")
        assert (await t.line()).startswith(b"-")
        assert await t.expect_closed() == b""
