"""Lease extension and the retry policy, over real sockets on every protocol.

touch (memcache, text), extend (RPC, the clients' item.extend and reserve's heartbeat),
retry_backoff (an aborted or timed-out read waits the next step), delivery counts, and
reject (to error_queue at once, or dropped). Each runs its own server on free ports.
Waits are long polls bounded by server_util.WAIT: real time is the point here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from server_util import HOST, WAIT, Conn, Rpc, make_config, pymc, running, running_conn
from wait_util import autojumping, wait_for

from queued.client import AsyncClient, Client, NotOpen
from queued.config import ServerConfig


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


SHORT = '[queues.t]\nopen_transaction_timeout = "300ms"\n'


async def held_job(port: int) -> tuple[Conn, Conn]:
    """Two connections: a worker that holds the item `job` of queue t open, and another."""
    worker, other = await Conn.open(port), await Conn.open(port)
    assert await worker.set("t", b"job") == b"STORED"
    assert await worker.get("t/open") == b"job"
    return worker, other


# -- lease extension ---------------------------------------------------------------------------


async def test_memcache_touch_extends_an_open_read_past_its_first_timeout(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(cfg(tmp_path, SHORT)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            worker, other = await held_job(server.ports["memcache"])
            assert await worker.cmd(b"touch t 5000") == b"TOUCHED"
            # Without the touch the read would be back after 300 ms: a 1.5 s long poll gets nothing.
            assert await other.get("t/t=1500") is None
            assert await worker.get("t/close") is None  # still ours to confirm
            assert await other.get("t") is None
            for c in (worker, other):
                await c.aclose()


async def test_memcache_touch_without_an_open_read_is_not_found(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        port = server.ports["memcache"]
        mc = pymc(port)
        try:
            assert await trio.to_thread.run_sync(mc.set, "q", b"x")
            assert await trio.to_thread.run_sync(mc.touch, "q", 1000) is False  # NOT_FOUND
        finally:
            mc.close()
        c = await Conn.open(port)
        assert await c.cmd(b"touch q 1000") == b"NOT_FOUND"
        assert await c.cmd(b"touch q soon") == b"CLIENT_ERROR bad ms"
        await c.aclose()


async def test_touched_read_still_times_out_at_its_new_deadline(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(cfg(tmp_path, SHORT)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            worker, other = await held_job(server.ports["memcache"])
            start = trio.current_time()
            assert await worker.cmd(b"touch t 800") == b"TOUCHED"
            assert await other.get("t/t=5000") == b"job"
            assert trio.current_time() - start >= 0.75
            for c in (worker, other):
                await c.aclose()


async def test_text_touch_extends_a_monitor_read(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(cfg(tmp_path, SHORT)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            text = await Conn.open(server.ports["text"], b"\n")
            other = await Conn.open(server.ports["memcache"])
            assert await other.set("t", b"job") == b"STORED"
            await text.send(b"monitor t 1000 1\n")
            assert await text.line() == b":job"
            assert await text.line() == b"*"
            assert await text.cmd(b"touch t 5000") == b"+1"
            assert await other.get("t/t=1500") is None
            assert await text.cmd(b"confirm t 1") == b"+1"
            assert await text.cmd(b"touch t 5000") == b"+0"
            for c in (text, other):
                await c.aclose()


async def test_rpc_extend_and_a_read_the_connection_does_not_hold(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(cfg(tmp_path, SHORT)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            port = server.ports["rpc"]
            a, b = await Rpc.open(port), await Rpc.open(port)
            assert await a.call("put", "t", [b"x", b"y"]) == (None, 2)
            err, got = await a.call("get", "t", 2, 0, 300)
            assert err is None and isinstance(got, list) and [i for i, _ in got] == [1, 2]
            assert await a.call("extend", "t", [1, 2], 5000) == (None, 2)
            err, _ = await b.call("extend", "t", [1], 5000)  # not b's
            assert err == [17, "not open on this connection: t id 1"]
            err, _ = await a.call("extend", "t", [1, 99], 5000)
            assert err == [17, "not open on this connection: t id 99"]
            assert (await b.call("get", "t", 2, 1500, 0)) == (None, [])
            assert await a.call("confirm", "t", [1, 2]) == (None, 2)
            err, _ = await a.call("extend", "t", [1], 5000)  # confirmed: no longer held
            assert err is not None and err[0] == 17  # type: ignore[index]
            await a.aclose()
            await b.aclose()


async def test_client_item_extend_and_reserve_heartbeat(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c, AsyncClient(address) as other:
            await c.put("hb", [b"long job"])
            async with c.reserve("hb", auto_abort_ms=300, heartbeat=True) as item:
                assert item is not None and item.deliveries == 1
                # The job outlives its lease four times over; nobody else gets the item.
                assert await other.get("hb", 1, 1200) == []
            assert await other.get("hb", 1, 500, 1000) == []  # confirmed at the end
            await c.put("hb", [b"short"])
            [got] = await c.get("hb", 1, 0, 300)
            assert await got.extend(3000) == 1
            assert await other.get("hb", 1, 800) == []
            assert await c.confirm(got) == 1
            with pytest.raises(NotOpen):
                await got.extend(3000)


def test_blocking_client_reserve_heartbeat(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(cfg(tmp_path)) as server:
            address = f"{HOST}:{server.ports['rpc']}"

            def work() -> None:
                with Client(address) as c, Client(address) as other:
                    c.put("hb", b"job")
                    with c.reserve("hb", auto_abort_ms=300, heartbeat=True) as item:
                        assert item is not None
                        assert other.get("hb", 1, 1200) == []
                    assert other.get("hb", 1, 500) == []

            with trio.fail_after(WAIT * 2):
                await trio.to_thread.run_sync(work)

    trio.run(main)


async def test_heartbeats_of_many_reserves_go_out_together(tmp_path: Path) -> None:
    """40 reserve blocks of one client, each with heartbeat=True and a 600 ms lease, held
    for 1.5 s: every item keeps its lease, and the beats, which fall due together, go out
    as one extend per beat for all of them (not one per item); an item aborted meanwhile
    (its read no longer held: NotOpen for its batch) does not cost the others theirs."""
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        rpc = server.protocols["rpc"]
        async with AsyncClient(address) as c, AsyncClient(address) as other:
            await c.put("hb", [b"job %d" % i for i in range(40)])
            held = 0
            all_held = trio.Event()
            done = trio.Event()

            async def hold(lose: bool) -> None:
                nonlocal held
                async with c.reserve("hb", auto_abort_ms=600, heartbeat=True) as item:
                    assert item is not None
                    held += 1
                    if held == 40:
                        all_held.set()
                    if lose:
                        await all_held.wait()
                        assert await c.abort(item) == 1  # returned: its beats get NotOpen
                    await done.wait()

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(hold, i == 0)
                with trio.fail_after(WAIT):
                    await all_held.wait()
                before = rpc.commands.get("extend", 0)
                await trio.sleep(1.5)  # 7 or 8 beats of 200 ms, 2.5 leases
                calls = rpc.commands.get("extend", 0) - before
                info = await other.peek("hb")
                assert (info.items, info.open_transactions) == (1, 39)  # the aborted one
                done.set()
            # One extend per beat for all 40, but the beat that first meets the lost read:
            # refused whole, then sent one by one (40 calls), and the lost read is left
            # out after that. One call per item would be 40 a beat, 280 or more.
            assert 6 <= calls <= 9 + 40, calls
        assert server.broker.reader_info("hb")["items"] == 1  # the 39 were confirmed


def test_blocking_client_heartbeats_of_many_reserves_go_out_together(tmp_path: Path) -> None:
    """The blocking client's reserves (one heartbeat thread each) in 10 threads sharing one
    Client: their beats fall due together and go out as one extend, not 10."""
    async def main() -> None:
        async with running(cfg(tmp_path)) as server:
            address = f"{HOST}:{server.ports['rpc']}"
            rpc = server.protocols["rpc"]

            def work() -> tuple[int, int]:
                with Client(address) as c, Client(address) as other:
                    c.put("hb", [b"job %d" % i for i in range(10)])
                    barrier = threading.Barrier(11, timeout=WAIT)

                    def hold() -> None:
                        with c.reserve("hb", auto_abort_ms=600, heartbeat=True) as item:
                            assert item is not None
                            barrier.wait()  # all held
                            barrier.wait()  # the count is taken

                    threads = [threading.Thread(target=hold) for _ in range(10)]
                    for t in threads:
                        t.start()
                    barrier.wait()
                    before = rpc.commands.get("extend", 0)
                    time.sleep(1.5)  # 7 or 8 beats of 200 ms, 2.5 leases
                    calls = rpc.commands.get("extend", 0) - before
                    held = other.peek("hb").open_transactions
                    barrier.wait()
                    for t in threads:
                        t.join(WAIT)
                    return calls, held

            with trio.fail_after(WAIT * 2):
                calls, held = await trio.to_thread.run_sync(work)
            assert held == 10  # every lease kept
            assert 6 <= calls <= 3 * 9, calls  # one call per item would be 70 or more
            assert server.broker.reader_info("hb")["items"] == 0  # all confirmed

    trio.run(main)


# -- retry policy ------------------------------------------------------------------------------


BACKOFF = '[queues.r]\nretry_backoff = ["600ms", "1h"]\n'


async def test_retry_backoff_delays_an_aborted_read_by_the_next_step(tmp_path: Path) -> None:
    async with running_conn(cfg(tmp_path, BACKOFF)) as c:
        await c.store("r", b"flaky", b"next")
        assert await c.get("r/open") == b"flaky"
        start = trio.current_time()
        assert await c.get("r/abort") is None
        assert await c.get("r") == b"next"  # the flaky one waits its first step
        assert await c.get("r/t=5000/open") == b"flaky"
        assert trio.current_time() - start >= 0.55
        assert await c.get("r/abort") is None  # second step: an hour
        assert await c.get("r/t=1000") is None
        stats = await c.stats()
        assert stats["queue_r_items"] == "1" and stats["queue_r_delayed"] == "1"


async def test_retry_backoff_applies_to_a_timed_out_read(tmp_path: Path) -> None:
    toml = '[queues.r]\nretry_backoff = ["1h"]\nopen_transaction_timeout = "100ms"\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        assert await c.set("r", b"slow") == b"STORED"
        assert await c.get("r/open") == b"slow"
        # until the timeout has returned it (delayed)
        await wait_for(c.stats, lambda stats: stats["queue_r_delayed"] == "1")
        assert await c.get("r/t=500") is None


async def test_backoff_state_survives_a_restart(tmp_path: Path) -> None:
    config = cfg(tmp_path, BACKOFF)
    async with running_conn(config) as c:
        assert await c.set("r", b"flaky") == b"STORED"
        assert await c.get("r/open") == b"flaky"
        assert await c.get("r/abort") is None
        assert await c.get("r/t=1000/open") == b"flaky"
        assert await c.get("r/abort") is None  # now waits an hour
    async with running_conn(config) as c:
        stats = await c.stats()
        assert stats["queue_r_items"] == "1" and stats["queue_r_delayed"] == "1"
        assert await c.get("r/t=300") is None


async def test_deliveries_count_every_return(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c:
            await c.put("d", [b"a"])
            for n in (1, 2, 3):
                [it] = await c.get("d", 1, 0, 10_000, with_deliveries=True)
                assert it.deliveries == n
                await c.abort(it)
            [it] = await c.get("d", 1, 0, 10_000)
            assert it.deliveries == 0  # not asked for
            await c.abort(it)
        text = await Conn.open(server.ports["text"], b"\n")
        assert await text.cmd(b"get d deliveries") == b":5 a"
        await text.aclose()


async def test_reject_sends_to_the_error_queue_at_once(tmp_path: Path) -> None:
    toml = '[queues.w]\nerror_queue = "dead"\nmax_errors = 5\n'
    async with running_conn(cfg(tmp_path, toml)) as c:
        assert await c.set("w", b"poison") == b"STORED"
        assert await c.get("w/open") == b"poison"
        assert await c.get("w/reject") is None
        assert await c.get("dead/t=2000") == b"poison"
        assert await c.get("w") is None
        assert (await c.stats())["queue_w_rejected"] == "1"
        assert await c.get("w/reject") is None  # nothing open: nothing happens


async def test_reject_without_an_error_queue_drops_the_item(tmp_path: Path) -> None:
    config = cfg(tmp_path)
    async with running(config) as server:
        rpc = await Rpc.open(server.ports["rpc"])
        assert await rpc.call("put", "w", [b"a", b"b"]) == (None, 2)
        err, got = await rpc.call("get", "w", 2, 0, 10_000)
        assert err is None and got == [[1, b"a"], [2, b"b"]]
        assert await rpc.call("reject", "w", [1]) == (None, 1)
        err, _ = await rpc.call("reject", "w", [1])
        assert err is not None and err[0] == 17  # type: ignore[index]
        assert await rpc.call("abort", "w", [2]) == (None, 1)
        await rpc.aclose()
    async with running_conn(config) as c:  # the drop was journaled
        assert await c.get("w") == b"b"
        assert await c.get("w") is None


async def test_max_errors_keeps_its_meaning_with_a_backoff(tmp_path: Path) -> None:
    toml = '[queues.w]\nerror_queue = "dead"\nmax_errors = 2\nretry_backoff = ["1h"]\n'
    async with running(cfg(tmp_path, toml)) as server:
        address = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(address) as c:
            await c.put("w", [b"p"])
            [it] = await c.get("w", 1, 0, 10_000)
            await c.abort(it, delay_ms=1)  # an explicit delay: 1 ms, not the back-off
            [it] = await c.get("w", 1, 2000, 10_000)
            await c.abort(it)  # the second error: to the dead letters, whatever the back-off
            [dead] = await c.get("dead", 1, 2000, with_deliveries=True)
            assert dead.data == b"p" and dead.deliveries == 3
