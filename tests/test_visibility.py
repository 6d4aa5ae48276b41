"""What each user sees of the server: `stats` (memcache, RPC), /stats.json and /metrics
show a user only the queues its grant may use and, unless it is an admin, no figure that
counts other queues; a `metrics` user reads all of /metrics and nothing else; without a
login the HTTP port names neither the server nor its version (but /livez and /readyz).

Real servers on 127.0.0.1 port 0; pymemcache-style raw memcache, msgpack RPC and
http.client as the clients.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from ops_util import NONE, basic, get, raw, samples
from security_util import mc_login, users_toml
from server_util import HOST, Conn, Rpc, make_config, running

from queued import __version__
from queued.config.users import UsersError, hash_password, parse_users
from queued.server.listeners import Server
from queued.server.readiness import Reason, told
from queued.wire.access import Grant

USERS = dict(
    alice={"password": "alice-pw", "put": ["orders"], "get": ["orders"]},
    root={"password": "root-pw", "admin": True, "put": ["*"], "get": ["*"]},
    scraper={"password": "scraper-pw", "metrics": True},
)
#: The server figures a user who is not an admin sees: they count no queue.
OWN = {"uptime", "time", "version"}


def as_(user: str) -> dict[str, str]:
    return basic(user, USERS[user]["password"])


@asynccontextmanager
async def two_queues(tmp_path: Path) -> AsyncIterator[Server]:
    """A server with users: 3 items in `secret` (root's), 1 in `orders` (alice's too)."""
    users = tmp_path / "users.toml"
    users.write_text(users_toml(**USERS))
    async with running(make_config(tmp_path / "data", users_file=str(users))) as server:
        root = await mc_login(server.ports["memcache"], "root", "root-pw")
        for data in (b"s1", b"s2", b"s3"):
            assert await root.set("secret", data) == b"STORED"
        assert await root.set("orders", b"o1") == b"STORED"
        await root.aclose()
        yield server


async def test_memcache_stats_of_a_user_count_only_its_queues(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        alice = await mc_login(server.ports["memcache"], "alice", "alice-pw")
        stats = await alice.stats()
        assert {k for k in stats if not k.startswith("queue_")} == OWN
        assert stats["version"] == __version__
        assert stats["queue_orders_items"] == "1"
        assert all(k.startswith("queue_orders_") for k in stats if k.startswith("queue_"))
        root = await mc_login(server.ports["memcache"], "root", "root-pw")
        stats = await root.stats()  # an admin sees the server's own counters
        assert (stats["curr_items"], stats["total_items"], stats["bytes"]) == ("4", "4", "8")
        assert stats["queue_secret_items"] == "3" and "cmd_get" in stats
        for conn in (alice, root):
            await conn.aclose()


async def test_rpc_stats_of_a_user_count_only_its_queues(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("auth", "alice", "alice-pw") == (None, True)
        error, stats = await rpc.call("stats")
        assert error is None and set(stats["server"]) == OWN
        assert set(stats["queues"]) == {"orders"} and stats["queues"]["orders"]["items"] == 1
        assert await rpc.call("auth", "root", "root-pw") == (None, True)
        _, stats = await rpc.call("stats")
        assert stats["server"]["curr_items"] == 4 and set(stats["queues"]) == {"orders", "secret"}
        await rpc.stream.aclose()


async def test_stats_json_of_a_user_counts_only_its_queues(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        port = server.ports["http"]
        status, _, body = await get(port, "/stats.json", as_("alice"))
        doc = json.loads(body)
        assert status == 200 and set(doc["server"]) == OWN and set(doc["queues"]) == {"orders"}
        status, _, body = await get(port, "/stats.json", as_("root"))
        doc = json.loads(body)
        assert doc["server"]["curr_items"] == 4 and set(doc["queues"]) == {"orders", "secret"}


def queues_in(exposition: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {value for (_, labels) in exposition for key, value in labels if key == "queue"}


async def scrape_as(server: Server, user: str) -> dict[tuple[str, frozenset[tuple[str, str]]],
                                                       float]:
    status, _, body = await get(server.ports["http"], "/metrics", as_(user))
    assert status == 200
    return samples(body.decode())


async def test_metrics_of_a_user_hold_only_its_queues_series(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        seen = await scrape_as(server, "alice")
        assert queues_in(seen) == {"orders"}
        # every series it gets is one of its queues' (no server-wide one: they count all)
        assert all(dict(labels).get("queue") == "orders" for _, labels in seen), sorted(
            name for name, labels in seen if "queue" not in dict(labels))
        assert seen[("queued_queue_items", frozenset({("queue", "orders"), ("reader", "")}))] == 1
        everything = await scrape_as(server, "root")
        assert queues_in(everything) == {"orders", "secret"}
        assert ("queued_queues", NONE) in everything
        assert ("queued_bytes_read_total", NONE) in everything


async def test_a_metrics_user_reads_all_of_metrics_and_nothing_else(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        seen = await scrape_as(server, "scraper")
        assert queues_in(seen) == {"orders", "secret"}
        assert seen[("queued_queues", NONE)] == 2
        assert ("queued_bytes_read_total", NONE) in seen
        status, _, body = await get(server.ports["http"], "/stats.json", as_("scraper"))
        assert status == 200 and json.loads(body)["queues"] == {}
        mc = await mc_login(server.ports["memcache"], "scraper", "scraper-pw")
        assert (await mc.set("orders", b"x")).startswith(b"CLIENT_ERROR permission denied")
        assert (await mc.cmd(b"get secret")).startswith(b"CLIENT_ERROR permission denied")
        assert set(await mc.stats()) == OWN
        await mc.aclose()


def test_a_metrics_user_has_no_other_permission() -> None:
    pw = hash_password("x", log_n=4)
    users = parse_users(f'[users.p]\npassword = "{pw}"\nmetrics = true\n', "f")
    assert users["p"].metrics and not users["p"].admin
    grant = users["p"].grant()
    assert grant.metrics and not grant.may_see("orders")
    assert not Grant("a", ("*",), ("*",)).metrics
    for extra in ('put = ["*"]', 'get = ["q"]', "admin = true"):
        with pytest.raises(UsersError, match="metrics: a metrics user may only read /metrics"):
            parse_users(f'[users.p]\npassword = "{pw}"\nmetrics = true\n{extra}\n', "f")
    with pytest.raises(UsersError, match="metrics: expected true or false"):
        parse_users(f'[users.p]\npassword = "{pw}"\nmetrics = "yes"\n', "f")


#: Requests a stranger may send: every page, an HTML one, a wrong login, a method the port
#: refuses, a HEAD, a request it cannot parse.
STRANGERS = [
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nAccept: text/html\r\nConnection: close\r\n\r\n",
    b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /stats.json HTTP/1.1\r\nHost: x\r\nAuthorization: Basic YWxpY2U6d3Jvbmc=\r\n"
    b"Connection: close\r\n\r\n",
    b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /console/console.js HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    b"DELETE / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"NONSENSE\r\n\r\n",
]


@pytest.mark.parametrize("request_bytes", STRANGERS, ids=range(len(STRANGERS)))
async def test_without_a_login_the_http_port_names_neither_server_nor_version(
        tmp_path: Path, request_bytes: bytes) -> None:
    async with two_queues(tmp_path) as server:
        reply = await raw(server.ports["http"], request_bytes)
        assert reply.startswith(b"HTTP/1.1 4"), reply
        assert b"queued" not in reply.lower() and __version__.encode() not in reply, reply
        assert b"\r\nserver:" not in reply.lower()


async def test_the_probes_stay_open_and_a_login_gets_the_index(tmp_path: Path) -> None:
    async with two_queues(tmp_path) as server:
        port = server.ports["http"]
        assert (await get(port, "/livez"))[:3:2] == (200, b"ok\n")
        assert (await get(port, "/readyz"))[:3:2] == (200, b"ready\n")
        status, _, body = await get(port, "/", as_("alice"))
        assert status == 200 and b"/metrics" in body


async def test_readyz_names_a_failed_queue_only_to_those_who_may_see_it(
        tmp_path: Path) -> None:
    """/readyz stays open, but with users its reasons name a queue only to an admin and
    to a user of that queue; a probe without a login (or with a wrong one) reads only the
    kind of trouble. The status is the same for everyone."""
    async with two_queues(tmp_path) as server:
        port = server.ports["http"]
        server.broker.queues["secret"].journal.file.set_failed(
            "fsync failed: [Errno 5] Input/output error")  # as the writer does
        server.broker.queues["orders"].journal.file.set_failed(
            "fsync failed: [Errno 5] Input/output error")
        general = b"not ready: a queue's journal refuses writes\n"
        for headers in (None, basic("root", "wrong"), basic("nobody", "x")):
            status, _, body = await get(port, "/readyz", headers)
            assert (status, body) == (503, general), headers
        failed = b"queue %s: queue '%s' refuses writes: fsync failed: [Errno 5] Input/output error"
        status, _, body = await get(port, "/readyz", as_("root"))
        assert (status, body) == (503, b"not ready: " + failed % (b"orders", b"orders") + b"\n"
                                  + failed % (b"secret", b"secret") + b"\n")
        status, _, body = await get(port, "/readyz", as_("alice"))  # orders, not secret
        assert (status, body) == (503, b"not ready: " + failed % (b"orders", b"orders") + b"\n"
                                  b"a queue's journal refuses writes\n")
        status, _, body = await get(port, "/readyz", as_("scraper"))  # metrics: no queues
        assert (status, body) == (503, general)
        status, _, body = await get(port, "/readyz", method="HEAD")
        assert (status, body) == (503, b"")


def test_readyz_reasons_told_to_a_stranger_name_nothing() -> None:
    found = [Reason("queue a: queue 'a' refuses writes: EIO", "a queue's journal refuses writes",
                    "a"),
             Reason("queue b: queue 'b' refuses writes: EIO", "a queue's journal refuses writes",
                    "b"),
             Reason("data dir /srv/q is not writable: cannot create: EROFS",
                    "the data dir is not writable"),
             Reason("data dir /srv/q: disk full (12 bytes free)", "disk full")]
    assert told(found, None) == [r.detail for r in found]
    assert told(found, lambda _: False) == [
        "a queue's journal refuses writes", "the data dir is not writable", "disk full"]
    assert told(found, lambda q: q == "b") == [
        "a queue's journal refuses writes", "queue b: queue 'b' refuses writes: EIO",
        "the data dir is not writable", "disk full"]


async def test_readyz_without_users_names_what_failed(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("q", b"x") == b"STORED"
        await conn.aclose()
        server.broker.queues["q"].journal.file.set_failed("write failed: disk on fire")
        status, _, body = await get(server.ports["http"], "/readyz")
        assert (status, body) == (503, b"not ready: queue q: queue 'q' refuses writes: "
                                       b"write failed: disk on fire\n")


async def test_without_users_the_http_port_is_as_open_as_before(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("q", b"x") == b"STORED"
        assert (await conn.stats())["curr_items"] == "1"
        await conn.aclose()
        status, headers, body = await get(server.ports["http"], "/")
        assert status == 200 and __version__.encode() in body
        assert headers["server"] == f"queued/{__version__}"
        status, _, body = await get(server.ports["http"], "/metrics")
        assert status == 200 and b"queued_bytes_read_total" in body
