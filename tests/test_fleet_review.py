"""Regression tests for the review of the fleet client (issue 20): one incident backs a
server off once, a silent server costs one connect_timeout, an empty DNS answer is asked
again after back-off; plus the smaller findings (L1, L2, L5) on their pure or real parts.

Real servers and sockets on loopback, the DNS server of fleet_util.
"""

from __future__ import annotations

import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from fleet_util import FLEET_HOSTS, common_free_port, fake_dns
from server_util import make_config, running

from queued.client import AsyncClient, Client, ConnectionFailed, Item, parse_servers
from queued.client.servers import Pool

NAME = "queued.review.test"


def refused_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


async def test_one_incident_backs_a_server_off_by_one_backoff(tmp_path: Path) -> None:
    """10 pipelined puts meet one refused server once: each failing task doubles the
    back-off, so one incident benches the server for 2**(k-1) s instead of `backoff`."""
    async with running(make_config(tmp_path / "d")) as server:
        live = f"127.0.0.1:{server.ports['rpc']}"
        dead = refused_address()
        async with AsyncClient([dead, live], backoff=1.0, max_backoff=30.0) as client:
            async with trio.open_nursery() as nursery:
                for n in range(10):
                    nursery.start_soon(client.put, "q", b"%d" % n)
            st = next(s for s in client.statistics().servers if s.server == dead)
            print(f"\nfailures={st.failures} down_for={st.backoff:.1f}s")
            assert st.backoff <= 1.5, f"one incident benched it {st.backoff:.1f} s"


async def test_blackholed_server_costs_one_connect_timeout(tmp_path: Path) -> None:
    """A server whose SYNs are dropped (node gone): docs/fleet.md says a call pays
    connect_timeout, then the next server. Pipelined tasks queue on the connect lock and
    each pays its own connect_timeout in turn."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = socket.create_connection(hole.getsockname())  # accept queue now full
    try:
        async with running(make_config(tmp_path / "d")) as server:
            live = f"127.0.0.1:{server.ports['rpc']}"
            dead = f"127.0.0.1:{hole.getsockname()[1]}"
            async with AsyncClient([dead, live], connect_timeout=1.0) as client:
                took: list[float] = []

                async def put(n: int) -> None:
                    t = trio.current_time()
                    await client.put("q", b"%d" % n)
                    took.append(trio.current_time() - t)

                with trio.fail_after(30):
                    async with trio.open_nursery() as nursery:
                        for n in range(10):
                            nursery.start_soon(put, n)
                print(f"\nslowest put {max(took):.1f} s; "
                      f"{sorted(round(t, 1) for t in took)}")
                assert max(took) < 2.0
    finally:
        filler.close()
        hole.close()


async def test_an_empty_answer_is_not_final_for_a_whole_refresh(tmp_path: Path) -> None:
    """NXDOMAIN once (a headless Service with no ready pod for a moment): the client then
    has no server and does not ask DNS again for `refresh` (30 s), even though a failed
    look-up is retried after `backoff`; puts raise "no server" all that time."""
    port = common_free_port(FLEET_HOSTS[:1])
    with fake_dns() as dns_server:
        (tmp_path / "s").mkdir()
        config = make_config(tmp_path / "s" / "data", host=FLEET_HOSTS[0], rpc_port=port)
        async with running(config):
            url = f"dns://{NAME}:{port}?nameserver={dns_server.nameserver}"
            async with AsyncClient(url, backoff=0.1, max_backoff=0.2) as client:
                with pytest.raises(ConnectionFailed, match="resolved to no address"):
                    await client.put("q", b"x")  # no pod ready
                dns_server.a = {NAME: [FLEET_HOSTS[0]]}  # the pod is ready again
                await trio.sleep(1.0)  # ten back-offs
                asked = dns_server.queries
                try:
                    assert await client.put("q", b"y") == 1
                finally:
                    print(f"\nDNS queries since the pod came back: "
                          f"{dns_server.queries - asked}")


def test_a_failure_from_the_same_incident_keeps_the_backoff() -> None:
    """Pure: calls that began before the failure that set the back-off count, but do not
    double it; a call that began after it does."""
    pool = Pool("a:1", backoff=1.0, max_backoff=30.0)
    server = pool.servers[0]
    pool.failed(server, 10.0, started=9.0)
    assert (server.delay, server.down_until) == (1.0, 11.0)
    for n in range(9):  # nine pipelined calls that began with the first
        pool.failed(server, 10.0 + n / 100, started=9.0)
    assert server.failures == 10 and server.delay == 1.0
    assert server.down_until == pytest.approx(11.08)
    pool.failed(server, 12.0, started=11.5)  # a new incident
    assert (server.delay, server.down_until) == (2.0, 14.0)
    pool.ok(server)
    assert (server.delay, server.down_until) == (0.0, 0.0)


def test_an_empty_answer_is_asked_again_after_backoff() -> None:
    pool = Pool("dns://n:1?refresh=30", backoff=0.5, max_backoff=1.0)
    name = pool.names[0]
    assert pool.resolved(name, [], 100.0) == []
    assert pool.due(100.4) == [] and pool.due(100.5) == [name]
    with pytest.raises(ConnectionFailed, match="resolved to no address"):
        pool.require()
    pool.resolved(name, [("10.0.0.1", 1, "n")], 101.0)
    assert pool.due(130.9) == [] and pool.due(131.0) == [name]
    assert pool.resolved(name, [], 131.0) == ["10.0.0.1:1"]  # it left; asked again soon
    assert pool.due(131.5) == [name]


def test_dns_schemes_match_in_any_case() -> None:
    assert parse_servers("DNS+SRV://_q._tcp.x.svc") == [
        ("dns+srv://_q._tcp.x.svc", "_q._tcp.x.svc", 0)]
    assert parse_servers("Dns://x.svc:7") == [("dns://x.svc:7", "x.svc", 7)]


async def test_confirm_goes_on_when_one_server_is_gone(tmp_path: Path) -> None:
    """Open reads from two servers; one server stops; the blocking client (which notices
    a broken connection only when it uses it) confirms both: the live server's counts,
    the gone one's counts 0 (its server returned the item), nothing raises."""
    async with AsyncExitStack() as stack_a, running(make_config(tmp_path / "b")) as b:
        a = await stack_a.enter_async_context(running(make_config(tmp_path / "a")))
        addresses = [f"127.0.0.1:{a.ports['rpc']}", f"127.0.0.1:{b.ports['rpc']}"]
        client = Client(addresses, read_timeout=5.0)
        try:
            def get_both() -> list[Item]:
                for address in addresses:
                    client.call("put", "q", [b"x"], 0, server=address)
                got = client.get("q", 1, 0, 60_000) + client.get("q", 1, 0, 60_000)
                assert sorted(i.server for i in got) == sorted(addresses)
                return got

            items = await trio.to_thread.run_sync(get_both)
            await stack_a.aclose()  # server a shuts down
            assert await trio.to_thread.run_sync(client.confirm, items) == 1
        finally:
            await trio.to_thread.run_sync(client.close)


def test_blocking_client_stalls_while_dns_is_down(tmp_path: Path) -> None:
    """Servers healthy, nameserver silent: every back-off, one put waits the whole
    look-up timeout (connect_timeout with nameserver=, the system resolver's own timeout
    without it), though the client has working servers."""
    port = common_free_port(FLEET_HOSTS[:1])

    async def main() -> None:
        with fake_dns() as dns_server:
            dns_server.a = {NAME: [FLEET_HOSTS[0]]}
            (tmp_path / "s").mkdir()
            config = make_config(tmp_path / "s" / "data", host=FLEET_HOSTS[0],
                                 rpc_port=port)
            async with running(config):
                url = f"dns://{NAME}:{port}?refresh=1&nameserver={dns_server.nameserver}"

                def blocking() -> list[float]:
                    with Client(url, connect_timeout=1.0, backoff=0.2) as c:
                        c.put("q", b"first")
                        dns_server.silent = True
                        took = []
                        deadline = time.monotonic() + 4.0
                        for _ in range(200_000):
                            if time.monotonic() > deadline:
                                break
                            t = time.monotonic()
                            c.put("q", b"x")
                            took.append(time.monotonic() - t)
                        return took

                took = await trio.to_thread.run_sync(blocking)
                slow = [t for t in took if t > 0.5]
                print(f"\n{len(took)} puts in 4 s, {len(slow)} took > 0.5 s "
                      f"({sum(slow):.1f} s stalled on DNS)")
                assert not slow

    trio.run(main)
