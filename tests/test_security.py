"""Security: users and permissions, TLS, deadlines for half-sent requests, max_queues,
and the refusal to listen beyond loopback without users.

Real servers on 127.0.0.1 port 0, real TLS with certificates made by trustme, real
clients (pymemcache, msgpack over raw sockets, http.client).
"""

from __future__ import annotations

import base64
import gc
import http.client
import logging
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trustme
from pymemcache.client.base import Client as MemcacheClient

from queued.config import ConfigError
from queued.config.users import PasswordHash, UsersError, hash_password, parse_users
from queued.server.app import check_exposure, is_loopback, open_security
from queued.server.listeners import Server
from queued.wire import commands as c
from queued.wire.access import ANONYMOUS, Grant, Permission, needed
from tests.server_util import (
    HOST,
    QUEUED,
    WAIT,
    Conn,
    Rpc,
    ServerProcess,
    make_config,
    running,
)

REFUSED = b"CLIENT_ERROR authentication failure"
#: Cheap hashes for tests (the default cost is ~50 ms a check).
FAST = 4


def users_toml(**users: dict[str, Any]) -> str:
    lines = []
    for name, spec in users.items():
        lines.append(f"[users.{name}]")
        lines.append(f'password = "{hash_password(spec["password"], log_n=FAST)}"')
        for key in ("put", "get"):
            if key in spec:
                lines.append(f"{key} = {spec[key]!r}".replace("'", '"'))
        for flag in ("admin", "metrics"):
            if spec.get(flag):
                lines.append(f"{flag} = true")
    return "\n".join(lines) + "\n"


USERS = dict(
    alice={"password": "alice pw", "put": ["orders", "jobs-*"], "get": ["orders"]},
    bob={"password": "bob-pw", "get": ["jobs-*"]},
    root={"password": "root-pw", "admin": True, "put": ["*"], "get": ["*"]},
)


# -- the users file and the hashes ---------------------------------------------------------


def test_hash_verifies_its_password_only() -> None:
    h = PasswordHash.parse(hash_password("s3cret word", log_n=FAST))
    assert h.verify("s3cret word")
    assert not h.verify("s3cret word ")
    assert not h.verify("")
    assert hash_password("x", log_n=FAST) != hash_password("x", log_n=FAST)  # salted


def test_default_hash_cost() -> None:
    assert hash_password("x").startswith("$scrypt$ln=14,r=8,p=1$")


@pytest.mark.parametrize(("text", "message"), [
    ('[users.a]\npassword = "hunter2"\n', "not a plaintext password"),
    ("[users.a]\nput = []\n", "password: missing"),
    ('[users.a]\npassword = "$scrypt$ln=30,r=8,p=1$AAAAAAAAAAAAAAAAAAAAAA$'
     'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"\n', "cost out of range"),
    ("[users.a]\npassword = 'H'\nadmin = 'yes'\n", "password"),
    ("[users.\"a b\"]\npassword = 'x'\n", "user name"),
    ("[users.a]\npasword = 'x'\n", "unknown key"),
    ("[other]\n", "unknown top-level key"),
    ("[users.a\n", "invalid TOML"),
])
def test_bad_users_files_are_refused_with_the_key_named(text: str, message: str) -> None:
    with pytest.raises(UsersError, match=message):
        parse_users(text, "users.toml")


def test_bad_permission_lists_are_refused() -> None:
    good = hash_password("x", log_n=FAST)
    with pytest.raises(UsersError, match="put: expected a list"):
        parse_users(f'[users.a]\npassword = "{good}"\nput = "orders"\n', "f")
    with pytest.raises(UsersError, match="admin: expected true or false"):
        parse_users(f'[users.a]\npassword = "{good}"\nadmin = "yes"\n', "f")


def test_parsed_users_carry_their_permissions(users_file: Path) -> None:
    users = parse_users(users_file.read_text(), "f")
    assert set(users) == {"alice", "bob", "root"}
    assert users["alice"].put == ("orders", "jobs-*") and not users["alice"].admin
    assert users["root"].admin and users["alice"].password.verify("alice pw")


# -- permissions ---------------------------------------------------------------------------


def test_every_command_needs_a_known_permission() -> None:
    examples: list[c.Command] = [
        c.Put("q", [b"x"]), c.Get("q"), c.Peek("q"), c.Confirm("q"), c.Abort("q"),
        c.Flush("q"), c.FlushAll(), c.FlushExpired("q"), c.FlushAllExpired(), c.Delete("q"),
        c.Stats(), c.Stats(dump=True), c.Version(), c.Reload(), c.Shutdown(), c.Quit(),
        c.Monitor("q", None, 10), c.Auth("u", "p"), c.Touch("q", None, 1000), c.Reject("q"),
        c.Browse("q"), c.Pause("q"), c.Move("q", None, "d"),
    ]
    kinds = {type(e) for e in examples}
    assert kinds == set(c.Command.__args__)  # type: ignore[attr-defined]  # every command
    wants = {type(e).__name__ + ("+dump" if getattr(e, "dump", False) else ""): needed(e)
             for e in examples}
    assert wants["Put"] == (Permission.PUT, "q")
    assert wants["Get"] == wants["Confirm"] == wants["Monitor"] == (Permission.GET, "q")
    assert wants["Touch"] == wants["Reject"] == wants["Browse"] == (Permission.GET, "q")
    assert wants["Pause"] == wants["Move"] == (Permission.ADMIN, "q")
    assert wants["Delete"] == (Permission.ADMIN, "q")
    assert wants["FlushAll"] == wants["Stats+dump"] == (Permission.ADMIN, None)
    assert wants["Stats"] is None and wants["Version"] is None and wants["Auth"] is None


def test_grant_patterns_and_fanout_names() -> None:
    g = Grant("alice", put=["orders", "jobs-*"], get=["orders"])
    assert g.denied(c.Put("orders", [b"x"])) is None
    assert g.denied(c.Put("jobs-eu", [b"x"])) is None
    assert g.denied(c.Get("orders", "audit")) is None  # reader of queue orders
    assert g.denied(c.Get("orders+audit")) is None  # the fanout name counts as its queue
    why = g.denied(c.Get("jobs-eu"))
    assert why == "permission denied: user 'alice' lacks 'get' on queue 'jobs-eu'"
    assert "'admin'" in (g.denied(c.FlushAll()) or "")
    assert g.denied(c.Put("Orders", [b"x"])) is not None  # case-sensitive
    assert ANONYMOUS.denied(c.Shutdown()) is None


# -- authentication on each protocol -------------------------------------------------------


@asynccontextmanager
async def secured(tmp_path: Path, users_file: Path, **settings: object,
                  ) -> AsyncIterator[Server]:
    config = make_config(tmp_path / "data", users_file=str(users_file), **settings)
    async with running(config) as server:
        yield server


async def mc_login(port: int, user: str, password: str) -> Conn:
    conn = await Conn.open(port)
    assert await conn.set("auth", f"{user} {password}".encode()) == b"STORED"
    return conn


async def test_memcache_command_before_login_is_refused_and_closes(
        tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.cmd(b"get orders") == b"CLIENT_ERROR unauthenticated"
        await conn.expect_closed()
        assert server.protocols["memcache"].auth_failures == 1
        assert "orders" not in server.broker.queues  # nothing was created


async def test_memcache_wrong_password_closes_and_is_logged_without_it(
        tmp_path: Path, users_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with secured(tmp_path, users_file) as server:
        with caplog.at_level(logging.DEBUG):
            conn = await Conn.open(server.ports["memcache"])
            assert await conn.set("x", b"alice not-the-pw") == REFUSED
            await conn.expect_closed()
            conn = await Conn.open(server.ports["memcache"])
            assert await conn.set("x", b"mallory whatever") == REFUSED
            await conn.expect_closed()
        assert server.protocols["memcache"].auth_failures == 2
    assert "not-the-pw" not in caplog.text and "whatever" not in caplog.text
    assert "authentication failed for user 'alice'" in caplog.text
    assert "127.0.0.1:" in caplog.text  # the peer's address


async def test_memcache_permissions(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["memcache"]
        alice = await mc_login(port, "alice", "alice pw")  # a password with a space
        assert await alice.set("orders", b"o1") == b"STORED"
        assert await alice.set("jobs-eu", b"j1") == b"STORED"
        assert await alice.set("other", b"x") == (
            b"CLIENT_ERROR permission denied: user 'alice' lacks 'put' on queue 'other'")
        assert await alice.get("orders") == b"o1"
        assert await alice.cmd(b"get jobs-eu") == (
            b"CLIENT_ERROR permission denied: user 'alice' lacks 'get' on queue 'jobs-eu'")
        for admin in (b"flush_all", b"delete orders", b"shutdown", b"reload", b"dump_stats"):
            reply = await alice.cmd(admin)
            assert reply.startswith(b"CLIENT_ERROR permission denied") and b"'admin'" in reply
        stats = await alice.stats()  # only the queues alice may use
        assert "queue_orders_items" in stats and "queue_jobs-eu_items" in stats
        assert await alice.set("orders", b"o2") == b"STORED"  # still usable

        bob = await mc_login(port, "bob", "bob-pw")
        assert await bob.get("jobs-eu") == b"j1"
        stats = await bob.stats()
        assert "queue_jobs-eu_items" in stats and "queue_orders_items" not in stats

        root = await mc_login(port, "root", "root-pw")
        assert await root.cmd(b"delete jobs-eu") == b"DELETED"
        assert server.protocols["memcache"].permission_denied == 7
        for conn in (alice, bob, root):
            await conn.aclose()


async def test_memcache_joined_sets_are_each_checked(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        alice = await mc_login(server.ports["memcache"], "alice", "alice pw")
        # pipelined: allowed, denied, allowed (the codec joins sets of one queue)
        await alice.send(b"set orders 0 0 1\r\na\r\nset orders 0 0 1\r\nb\r\n"
                         b"set nope 0 0 1\r\nc\r\nset orders 0 0 1\r\nd\r\n")
        assert [await alice.line() for _ in range(4)] == [
            b"STORED", b"STORED",
            b"CLIENT_ERROR permission denied: user 'alice' lacks 'put' on queue 'nope'",
            b"STORED"]
        assert [await alice.get("orders") for _ in range(3)] == [b"a", b"b", b"d"]
        await alice.aclose()


async def test_pymemcache_logs_in_with_a_plain_set(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["memcache"]

        def client_work() -> tuple[Any, Any]:
            mc = MemcacheClient((HOST, port), default_noreply=False, connect_timeout=WAIT,
                                timeout=WAIT)
            try:
                assert mc.set("auth", "alice alice pw") is True
                mc.set("orders", b"hello")
                return mc.get("orders"), mc.get("orders")
            finally:
                mc.close()

        assert await trio.to_thread.run_sync(client_work) == (b"hello", None)


async def test_text_protocol_auth(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["text"]
        conn = await Conn.open(port, b"\n")
        assert await conn.cmd(b"get orders") == b"-unauthenticated: log in first (see " \
            b"docs/security.md)"
        await conn.expect_closed()
        conn = await Conn.open(port, b"\n")
        assert (await conn.cmd(b"AUTH alice wrong")).startswith(b"-authentication failure")
        await conn.expect_closed()
        conn = await Conn.open(port, b"\n")
        assert await conn.cmd(b"auth alice alice pw") == b"+1"
        await conn.send(b"put orders:\nt1\n\n")
        assert await conn.line() == b"+1"
        assert await conn.cmd(b"get orders") == b":t1"
        assert await conn.cmd(b"flush orders") == (
            b"-permission denied: user 'alice' lacks 'admin' on queue 'orders'")
        assert await conn.cmd(b"version") != b""  # still usable
        await conn.aclose()


async def test_rpc_auth(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["rpc"]
        rpc = Rpc(await trio.open_tcp_stream(HOST, port))
        error, _ = await rpc.call("put", "orders", [b"x"])
        assert error[0] == 13 and "unauthenticated" in error[1]
        assert await rpc.closed()
        rpc = Rpc(await trio.open_tcp_stream(HOST, port))
        assert (await rpc.call("auth", "alice", "nope"))[0] == [14, "authentication failure"]
        assert await rpc.closed()
        rpc = Rpc(await trio.open_tcp_stream(HOST, port))
        assert await rpc.call("auth", "alice", "alice pw") == (None, True)
        assert await rpc.call("put", "orders", [b"r1", b"r2"]) == (None, 2)
        error, _ = await rpc.call("put", "secret", [b"x"])
        assert error == [15, "permission denied: user 'alice' lacks 'put' on queue 'secret'"]
        assert (await rpc.call("get", "orders", 5))[1] == [[1, b"r1"], [2, b"r2"]]
        assert (await rpc.call("flush_all"))[0][0] == 15
        # a second auth switches user
        assert await rpc.call("auth", "root", "root-pw") == (None, True)
        assert await rpc.call("flush_all") == (None, 0)
        await rpc.stream.aclose()
        assert server.protocols["rpc"].permission_denied == 2


async def test_without_users_auth_is_accepted_and_everything_allowed(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("auth", "anyone", "x") == (None, True)
        assert await rpc.call("flush_all") == (None, 0)
        await rpc.stream.aclose()


async def test_reload_rereads_the_users_file(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["memcache"]
        alice = await mc_login(port, "alice", "alice pw")
        users_file.write_text(users_toml(carol={"password": "c", "put": ["*"]}))
        root = await mc_login(port, "root", "root-pw")
        assert await root.cmd(b"reload") == b"Reloaded config."
        carol = await mc_login(port, "carol", "c")
        assert await carol.set("anything", b"x") == b"STORED"
        conn = await Conn.open(port)  # alice is gone for new connections
        assert await conn.set("a", b"alice alice pw") == b"CLIENT_ERROR authentication failure"
        users_file.write_text("not toml [")
        assert (await carol.cmd(b"reload")).startswith(b"CLIENT_ERROR permission denied")
        with pytest.raises(ConfigError, match="invalid TOML"):
            server.reload()
        carol2 = await mc_login(port, "carol", "c")  # the old users stay
        for conn in (alice, root, carol, carol2):
            await conn.aclose()


async def test_http_needs_basic_auth_except_probes(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        port = server.ports["http"]

        def fetch(path: str, user: str | None = None, pw: str = "") -> tuple[int, str, bytes]:
            conn = http.client.HTTPConnection(HOST, port, timeout=WAIT)
            headers = {}
            if user is not None:
                token = base64.b64encode(f"{user}:{pw}".encode()).decode()
                headers["Authorization"] = f"Basic {token}"
            try:
                conn.request("GET", path, headers=headers)
                r = conn.getresponse()
                return r.status, r.getheader("WWW-Authenticate") or "", r.read()
            finally:
                conn.close()

        run = trio.to_thread.run_sync
        assert (await run(fetch, "/livez"))[0] == 200
        assert (await run(fetch, "/readyz"))[0] == 200
        status, challenge, _ = await run(fetch, "/metrics")
        assert status == 401 and challenge.startswith('Basic realm="login"')
        assert (await run(fetch, "/stats.json"))[0] == 401
        assert (await run(fetch, "/metrics", "bob", "wrong"))[0] == 401
        assert (await run(fetch, "/metrics", "bob", "bob-pw"))[0] == 200
        status, _, body = await run(fetch, "/metrics", "root", "root-pw")
        assert status == 200
        assert b'queued_auth_failures_total{protocol="http"} 3.0' in body
        assert (await run(fetch, "/stats.json", "bob", "bob-pw"))[0] == 200


# -- TLS -------------------------------------------------------------------------------------


class Pki:
    """A CA, a server certificate for 127.0.0.1 in files, and client contexts."""

    def __init__(self, where: Path) -> None:
        self.ca = trustme.CA()
        self.dir = where
        self.cert, self.key, self.ca_file = where / "server.crt", where / "server.key", \
            where / "ca.crt"
        self.issue(self.ca)
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def issue(self, ca: trustme.CA) -> None:
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        leaf.private_key_pem.write_to_path(str(self.key))
        self.cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))

    def client(self, ca: trustme.CA | None = None, *, cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        (ca or self.ca).configure_trust(ctx)
        if cert:
            self.ca.issue_cert("client.example").configure_cert(ctx)
        return ctx


async def tls_open(port: int, ctx: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
    with trio.fail_after(WAIT):
        stream = trio.SSLStream(await trio.open_tcp_stream(HOST, port), ctx,
                                server_hostname="127.0.0.1")
        await stream.do_handshake()
        return stream


def tls_conn(stream: trio.SSLStream[trio.SocketStream], newline: bytes = b"\r\n") -> Conn:
    return Conn(stream, newline)  # type: ignore[arg-type]  # any trio stream serves


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def tls_settings(pki: Pki, **more: object) -> dict[str, object]:
    return {"tls_cert": str(pki.cert), "tls_key": str(pki.key), **more}


async def test_tls_on_every_protocol(tmp_path: Path, pki: Pki) -> None:
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        ctx = pki.client()
        mc = tls_conn(await tls_open(server.ports["memcache"], ctx))
        assert await mc.set("q", b"over tls") == b"STORED"
        assert await mc.get("q") == b"over tls"
        text = tls_conn(await tls_open(server.ports["text"], ctx), b"\n")
        await text.send(b"put q:\nt\n\n")
        assert await text.line() == b"+1"
        rpc = Rpc(await tls_open(server.ports["rpc"], ctx))
        assert await rpc.call("get", "q", 1) == (None, [[2, b"t"]])
        assert version_ok(await rpc.call("version"))
        for conn in (mc.stream, text.stream, rpc.stream):
            await conn.aclose()

        def https() -> int:
            conn = http.client.HTTPSConnection(HOST, server.ports["http"], timeout=WAIT,
                                               context=ctx)
            try:
                conn.request("GET", "/livez")
                return conn.getresponse().status
            finally:
                conn.close()

        assert await trio.to_thread.run_sync(https) == 200


def version_ok(reply: tuple[Any, Any]) -> bool:
    return reply[0] is None and isinstance(reply[1], str)


async def test_plaintext_on_a_tls_port_is_closed_and_others_carry_on(
        tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        port = server.ports["memcache"]
        good = tls_conn(await tls_open(port, pki.client()))
        assert await good.set("q", b"1") == b"STORED"
        with caplog.at_level(logging.INFO):
            plain = await Conn.open(port)
            await plain.send(b"set q 0 0 1\r\nx\r\nget q\r\n")
            rest = await plain.expect_closed()
            assert b"STORED" not in rest and b"VALUE" not in rest
        assert await good.set("q", b"2") == b"STORED"
        assert await good.get("q") == b"1"
        assert await good.get("q") == b"2"
        assert server.protocols["memcache"].tls_handshake_failures == 1
        assert "TLS handshake failed" in caplog.text
        await good.stream.aclose()


async def test_stalled_handshake_is_closed_after_auth_timeout(tmp_path: Path, pki: Pki) -> None:
    config = make_config(tmp_path / "data", auth_timeout=300, **tls_settings(pki))
    async with running(config) as server:
        idle = await Conn.open(server.ports["rpc"])  # connects, never says hello
        await idle.expect_closed(timeout=5)
        assert server.protocols["rpc"].tls_handshake_failures == 1


async def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path: Path,
                                                                 pki: Pki) -> None:
    config = make_config(tmp_path / "data", **tls_settings(pki, tls_client_ca=str(pki.ca_file)))
    async with running(config) as server:
        port = server.ports["memcache"]
        with pytest.raises(trio.BrokenResourceError):
            stream = await tls_open(port, pki.client())
            # TLS 1.3: the refusal of the client's certificate arrives after its handshake
            conn = tls_conn(stream)
            await conn.set("q", b"x")
        assert server.protocols["memcache"].tls_handshake_failures == 1
        conn = tls_conn(await tls_open(port, pki.client(cert=True)))
        assert await conn.set("q", b"x") == b"STORED"
        await conn.stream.aclose()


async def test_reload_reads_new_certificates_open_connections_carry_on(
        tmp_path: Path, pki: Pki) -> None:
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        port = server.ports["memcache"]
        old = tls_conn(await tls_open(port, pki.client()))
        assert await old.set("q", b"1") == b"STORED"
        new_ca = trustme.CA()
        pki.issue(new_ca)
        server.reload()
        with pytest.raises(trio.BrokenResourceError):  # the old CA no longer vouches
            await tls_open(port, pki.client())
        new = tls_conn(await tls_open(port, pki.client(new_ca)))
        assert await new.get("q") == b"1"
        assert await old.set("q", b"2") == b"STORED"  # the open connection carries on
        pki.key.write_text("garbage")
        with pytest.raises(ConfigError, match="cannot load"):
            server.reload()
        again = tls_conn(await tls_open(port, pki.client(new_ca)))  # the last good one
        assert await again.get("q") == b"2"
        for conn in (old, new, again):
            await conn.stream.aclose()


async def test_pymemcache_over_tls_with_auth(tmp_path: Path, pki: Pki, users_file: Path) -> None:
    config = make_config(tmp_path / "data", users_file=str(users_file), **tls_settings(pki))
    async with running(config) as server:
        port = server.ports["memcache"]
        ctx = pki.client()

        def client_work() -> Any:
            mc = MemcacheClient((HOST, port), default_noreply=False, connect_timeout=WAIT,
                                timeout=WAIT, tls_context=ctx)
            try:
                assert mc.set("login", "alice alice pw") is True
                assert mc.set("orders", b"secret order") is True
                return mc.get("orders")
            finally:
                mc.close()

        assert await trio.to_thread.run_sync(client_work) == b"secret order"


# -- deadlines and limits ------------------------------------------------------------------


async def test_trickling_request_is_closed_after_request_timeout(tmp_path: Path) -> None:
    config = make_config(tmp_path / "data", request_timeout=400)
    async with running(config) as server:
        port = server.ports["memcache"]
        idle = await Conn.open(port)  # between requests: never timed out
        assert await idle.set("q", b"0") == b"STORED"
        slow = await Conn.open(port)
        other = await Conn.open(port)
        await slow.send(b"set q 0 0 10\r\nabc")
        with trio.fail_after(5):
            closed = trio.Event()

            async def watch() -> None:
                await slow.expect_closed()
                closed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                # meanwhile another client is served, byte by byte too but complete
                for i in range(5):
                    for b in b"set q 0 0 1\r\n%d\r\n" % i:
                        await other.send(bytes([b]))
                        await trio.sleep(0.005)
                    assert await other.line() == b"STORED"
                await closed.wait()
        assert server.protocols["memcache"].request_timeouts == 1
        await trio.sleep(0.5)  # past the deadline for an idle connection too
        assert await idle.get("q") == b"0"  # the idle one is still served
        for conn in (idle, other):
            await conn.aclose()


@pytest.mark.parametrize(("proto", "partial"), [
    ("text", b"put q:\nab"),
    ("rpc", msgpack.packb([0, 1, "put", ["q", [b"x" * 100]]])[:20]),
])
async def test_half_sent_requests_time_out_on_every_protocol(
        tmp_path: Path, proto: str, partial: bytes) -> None:
    async with running(make_config(tmp_path / "data", request_timeout=300)) as server:
        conn = await Conn.open(server.ports[proto])
        await conn.send(partial)
        await conn.expect_closed(timeout=5)
        assert server.protocols[proto].request_timeouts == 1


async def test_long_poll_is_not_a_half_sent_request(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data", request_timeout=200)) as server:
        conn = await Conn.open(server.ports["memcache"])
        await conn.send(b"get q/t=800\r\n")
        assert await conn.line() == b"END"  # answered after 0.8 s, not closed at 0.2
        assert server.protocols["memcache"].request_timeouts == 0
        await conn.aclose()


async def test_login_must_come_within_auth_timeout(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file, auth_timeout=300) as server:
        conn = await Conn.open(server.ports["memcache"])
        await conn.expect_closed(timeout=5)
        assert server.protocols["memcache"].auth_failures == 1
        ok = await mc_login(server.ports["memcache"], "alice", "alice pw")
        await trio.sleep(0.5)  # logged in: the login deadline no longer applies
        assert await ok.set("orders", b"x") == b"STORED"
        await ok.aclose()


async def test_before_login_items_are_capped_small(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        conn = await Conn.open(server.ports["memcache"])
        await conn.send(b"set q 0 0 100000\r\n")  # a stranger may not make us buffer this
        assert await conn.line() == b"NOT_STORED"  # (memcache's reply to an item too large)
        await conn.expect_closed()
        rpc = await Conn.open(server.ports["rpc"])
        await rpc.send(msgpack.packb([0, 1, "auth", ["a", "x" * 10_000]]))
        assert (await rpc.expect_closed())  # an error reply, then closed
        assert server.broker.queues == {}


async def test_max_queues(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data", max_queues=3)) as server:
        conn = await Conn.open(server.ports["memcache"])
        for q in ("a", "b", "c"):
            assert await conn.set(q, b"x") == b"STORED"
        assert await conn.set("d", b"x") == (
            b"SERVER_ERROR cannot create queue 'd': the server holds max_queues (3) queues "
            b"and fanout readers")
        assert (await conn.cmd(b"get d")).startswith(b"SERVER_ERROR cannot create queue 'd'")
        assert "d" not in server.broker.queues
        assert await conn.set("a", b"y") == b"STORED"  # existing queues still work
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert (await rpc.call("get", "a+r1", 1))[0] is None  # takes over the default reader
        assert (await rpc.call("get", "a+r2", 1))[0][0] == 16  # a second reader counts
        await rpc.stream.aclose()
        await conn.aclose()


async def test_max_queues_counts_every_reader(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data", max_queues=2)) as server:
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("put", "q", [b"x"]) == (None, 1)
        assert (await rpc.call("get", "q+r1", 1))[0] is None  # takes over: still one name
        assert (await rpc.call("get", "q", 1))[0] is None  # the default reader again: two
        assert (await rpc.call("get", "q+r2", 1))[0][0] == 16
        assert (await rpc.call("put", "other", [b"x"]))[0][0] == 16
        assert await rpc.call("delete", "q+r1") == (None, True)  # room for one again
        assert await rpc.call("put", "other", [b"x"]) == (None, 1)
        assert len(server.broker.queue_stats()) == 2
        await rpc.stream.aclose()


# -- listening beyond loopback -------------------------------------------------------------


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")


def test_non_loopback_host_needs_users_or_an_explicit_risk(tmp_path: Path,
                                                           users_file: Path) -> None:
    with pytest.raises(ConfigError, match="allow_anonymous") as info:
        check_exposure(make_config(tmp_path / "d", host="0.0.0.0"))
    assert "users_file" in str(info.value)
    check_exposure(make_config(tmp_path / "d", host="0.0.0.0", allow_anonymous="true"))
    check_exposure(make_config(tmp_path / "d", host="0.0.0.0", users_file=str(users_file)))
    check_exposure(make_config(tmp_path / "d"))  # loopback: fine


def test_serve_refuses_to_listen_beyond_loopback_without_users(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(QUEUED), "serve", "--data-dir", str(tmp_path / "d"), "--host", "0.0.0.0",
         "--memcache-port", "0", "--text-port", "0", "--rpc-port", "0", "--http-port", "0"],
        capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert b"QUEUED_ALLOW_ANONYMOUS=1" in proc.stderr and b"--users-file" in proc.stderr
    assert b"listening for" not in proc.stderr


def test_passwd_prints_a_hash_that_verifies() -> None:
    proc = subprocess.run([str(QUEUED), "passwd"], input=b"correct horse\n",
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.decode().strip()
    assert PasswordHash.parse(text).verify("correct horse")
    assert "correct horse" not in text
    empty = subprocess.run([str(QUEUED), "passwd"], input=b"\n", capture_output=True, timeout=60)
    assert empty.returncode == 2 and b"empty password" in empty.stderr


def test_tls_settings_must_come_in_pairs(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match="set both"):
        make_config(tmp_path / "d", tls_cert=str(pki.cert))
    with pytest.raises(ConfigError, match="needs tls_cert"):
        make_config(tmp_path / "d", tls_client_ca=str(pki.ca_file))


def test_bad_certificate_or_users_files_stop_the_start(tmp_path: Path, pki: Pki) -> None:
    pki.key.write_text("not a key")
    with pytest.raises(ConfigError, match=r"server\.key: cannot load"):
        open_security(make_config(tmp_path / "data", **tls_settings(pki)))
    with pytest.raises(ConfigError, match="cannot read the users file"):
        open_security(make_config(tmp_path / "data", users_file=str(tmp_path / "none")))


def test_sighup_reloads_certificates_and_users_in_a_running_server(
        tmp_path: Path, pki: Pki, users_file: Path) -> None:
    config = tmp_path / "queued.toml"
    config.write_text(f'[server]\ntls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
                      f'users_file = "{users_file}"\n')
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", config)
    server.start()
    try:
        def login(ctx: ssl.SSLContext, user: str, pw: str) -> bytes:
            raw = socket.create_connection((HOST, server.memcache), timeout=WAIT)
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                data = f"{user} {pw}".encode()
                s.sendall(b"set auth 0 0 %d\r\n%s\r\n" % (len(data), data))
                return s.recv(100)

        assert login(pki.client(), "alice", "alice pw") == b"STORED\r\n"
        new_ca = trustme.CA()
        pki.issue(new_ca)
        users_file.write_text(users_toml(dave={"password": "d", "get": ["*"]}))
        server.signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT
        while b"reloaded (SIGHUP)" not in server.log():
            assert time.monotonic() < deadline, server.log().decode()
            time.sleep(0.05)
        with pytest.raises(ssl.SSLError):
            login(pki.client(), "dave", "d")  # the old CA no longer vouches for it
        assert login(pki.client(new_ca), "dave", "d") == b"STORED\r\n"
        assert login(pki.client(new_ca), "alice", "alice pw") == (
            b"CLIENT_ERROR authentication failure\r\n")
        assert b"alice pw" not in server.log()
    finally:
        server.kill()


async def test_tls_transport_carries_big_items_and_many_records(tmp_path: Path,
                                                                pki: Pki) -> None:
    """Items spanning many TLS records (16 KiB each) both ways, pipelined requests in
    one flight, an RPC batch; then a clean TLS close (close_notify) ends the session."""
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        ctx = pki.client()
        mc = tls_conn(await tls_open(server.ports["memcache"], ctx))
        big = bytes(range(256)) * 4096  # 1 MiB
        await mc.send(b"".join(b"set big 0 0 %d\r\n%s\r\n" % (len(big), big) for _ in range(3)))
        assert [await mc.line() for _ in range(3)] == [b"STORED"] * 3
        await mc.send(b"get big\r\nget big\r\nget big\r\n")
        for _ in range(3):
            assert await mc.read_value("big") == big
        rpc = Rpc(await tls_open(server.ports["rpc"], ctx))
        items = [bytes([i]) * 1024 for i in range(100)]
        assert await rpc.call("put", "r", items) == (None, 100)
        _, got = await rpc.call("get", "r", 100)
        assert [data for _, data in got] == items
        await rpc.stream.aclose()  # sends close_notify
        await mc.stream.aclose()
        with trio.fail_after(WAIT):
            while server.connections():
                await trio.sleep(0.01)


async def test_garbage_after_the_handshake_closes_only_that_connection(
        tmp_path: Path, pki: Pki) -> None:
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        port = server.ports["memcache"]
        good = tls_conn(await tls_open(port, pki.client()))
        bad = await tls_open(port, pki.client())
        forged = b"\x17\x03\x03\x00\x10" + b"\x00" * 16  # an application record, not theirs
        await bad.transport_stream.send_all(forged)
        with trio.fail_after(WAIT):
            with pytest.raises(trio.BrokenResourceError):
                while await bad.receive_some(100):
                    pass
                raise trio.BrokenResourceError("closed")
        assert await good.set("q", b"still here") == b"STORED"
        await good.stream.aclose()


@pytest.mark.parametrize(("proto", "hello"), [
    ("memcache", b"get q\r\n"),
    ("text", b"get q\n"),
    ("rpc", msgpack.packb([0, 1, "get", ["q", 1]])),
    ("http", b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"),
])
async def test_every_tls_port_refuses_plaintext_and_a_missing_client_certificate(
        tmp_path: Path, pki: Pki, proto: str, hello: bytes) -> None:
    # (msgpack's first byte has the high bit set: OpenSSL reads an SSLv2 hello header
    # announcing 5 KiB and waits for it, so that handshake ends at auth_timeout)
    config = make_config(tmp_path / "data", auth_timeout=1000,
                         **tls_settings(pki, tls_client_ca=str(pki.ca_file)))
    async with running(config) as server:
        port = server.ports[proto]
        plain = await Conn.open(port)
        await plain.send(hello)
        rest = await plain.expect_closed()
        assert not rest.startswith((b"END", b"*", b"HTTP")), rest  # no plaintext answer
        with pytest.raises(trio.BrokenResourceError):
            stream = await tls_open(port, pki.client())  # no client certificate
            await stream.send_all(hello)
            with trio.fail_after(WAIT):
                while await stream.receive_some(100):
                    pass
        ok = await tls_open(port, pki.client(cert=True))
        await ok.send_all(hello)
        with trio.fail_after(WAIT):
            assert await ok.receive_some(100)  # answered
        await ok.aclose()
        stats = (server.protocols[proto] if proto != "http" else None)
        if stats is not None:
            assert stats.tls_handshake_failures == 2


async def test_text_and_rpc_permissions_each_way(tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        bob = await Conn.open(server.ports["text"], b"\n")  # get jobs-*, nothing else
        assert await bob.cmd(b"auth bob bob-pw") == b"+1"
        await bob.send(b"put jobs-1:\nx\n\n")
        assert await bob.line() == b"-permission denied: user 'bob' lacks 'put' on queue 'jobs-1'"
        assert await bob.cmd(b"get jobs-1") == b"*"  # allowed, empty
        assert await bob.cmd(b"peek orders") == (
            b"-permission denied: user 'bob' lacks 'get' on queue 'orders'")
        assert await bob.cmd(b"confirm jobs-1 1") == b"+0"
        assert await bob.cmd(b"delete jobs-1") == (
            b"-permission denied: user 'bob' lacks 'admin' on queue 'jobs-1'")
        await bob.aclose()
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("auth", "bob", "bob-pw") == (None, True)
        assert (await rpc.call("put", "jobs-1", [b"x"]))[0][0] == 15
        assert await rpc.call("get", "jobs-1", 1) == (None, [])
        assert (await rpc.call("peek", "orders"))[0][0] == 15
        assert (await rpc.call("abort", "orders", [1]))[0][0] == 15
        assert await rpc.call("confirm", "jobs-1", []) == (None, 0)
        assert (await rpc.call("delete", "jobs-1"))[0][0] == 15
        assert (await rpc.call("flush", "jobs-1"))[0][0] == 15
        stats = (await rpc.call("stats"))[1]
        assert set(stats["queues"]) <= {"jobs-1"}
        await rpc.stream.aclose()


# -- refused connections leave nothing behind -----------------------------------------------

REFUSED_INPUTS = [
    ("memcache", b"get orders\r\n"),  # before logging in
    ("memcache", b"set k 0 0 3\r\nabc\r\n"),  # a login that is not one
    ("memcache", b"\x00\xff junk\r\n"),
    ("text", b"get orders\n"),
    ("text", b"\x00\xff\n"),
    ("rpc", msgpack.packb([0, 1, "get", ["orders"]])),
    ("rpc", msgpack.packb([0, 1, "get", []])),  # bad params
    ("rpc", b"\xc1\xc1\xc1"),  # not MessagePack
]


@pytest.mark.parametrize(("proto", "data"), REFUSED_INPUTS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(REFUSED_INPUTS)])
async def test_a_refused_connection_leaves_no_garbage_cycle(
        tmp_path: Path, users_file: Path, proto: str, data: bytes) -> None:
    """A refused connection's session, codec and buffers are freed when it closes, not at
    the next full garbage collection: an exception kept with its traceback (the parser's
    failure, a refusal in the list of parsed requests) made a cycle through their frames,
    and a stream of hostile connections grew RSS by ~35 KiB each until one ran."""
    async with secured(tmp_path, users_file) as server:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                conn = await Conn.open(server.ports[proto])
                await conn.send(data)
                await conn.expect_closed()
            with trio.fail_after(WAIT):  # the sessions end (a refused login after its delay)
                while server.connections():
                    await trio.sleep(0.05)
            gc.collect()
            kinds = {type(o).__name__ for o in gc.garbage}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert not kinds & {"Session", "RpcParser", "MemcacheCodec", "TextCodec", "frame"}


async def test_consumer_commands_need_their_permissions(tmp_path: Path, users_file: Path) -> None:
    """touch, reject and browse take `get` on the queue; pause, resume and move take admin.
    Refused each way on each protocol that has them; allowed with the permission."""
    async with secured(tmp_path, users_file) as server:
        denied_get = b"CLIENT_ERROR permission denied: user 'alice' lacks 'get' on queue 'jobs-1'"
        alice = await mc_login(server.ports["memcache"], "alice", "alice pw")  # no get jobs-*
        assert await alice.cmd(b"touch jobs-1 1000") == denied_get
        assert await alice.cmd(b"get jobs-1/reject") == denied_get
        assert await alice.cmd(b"touch orders 1000") == b"NOT_FOUND"  # get on orders: allowed
        for admin in (b"pause orders", b"resume orders"):
            reply = await alice.cmd(admin)
            assert reply.startswith(b"CLIENT_ERROR permission denied") and b"'admin'" in reply
        root = await mc_login(server.ports["memcache"], "root", "root-pw")
        assert await root.cmd(b"pause orders") == b"OK"
        assert await root.cmd(b"resume orders") == b"OK"

        text = await Conn.open(server.ports["text"], b"\n")
        assert await text.cmd(b"auth alice alice pw") == b"+1"
        assert await text.cmd(b"touch jobs-1 1000") == (
            b"-permission denied: user 'alice' lacks 'get' on queue 'jobs-1'")
        assert (await text.cmd(b"pause orders")).startswith(b"-permission denied")

        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("auth", "bob", "bob-pw") == (None, True)  # get jobs-*, no admin
        assert await rpc.call("put", "jobs-1", [b"x"]) == (
            [15, "permission denied: user 'bob' lacks 'put' on queue 'jobs-1'"], None)
        assert await rpc.call("browse", "jobs-1") == (None, [])
        assert await rpc.call("extend", "jobs-1", [1], 1000) == (
            [17, "not open on this connection: jobs-1 id 1"], None)  # allowed, not held
        for call in (("extend", "orders", [1], 1000), ("reject", "orders", [1]),
                     ("browse", "orders")):
            assert (await rpc.call(*call))[0][0] == 15
        for call in (("pause", "jobs-1"), ("resume", "jobs-1"), ("move", "jobs-1", "jobs-2")):
            err = (await rpc.call(*call))[0]
            assert err[0] == 15 and "'admin'" in err[1]
        await rpc.stream.aclose()
        for c in (alice, root, text):
            await c.aclose()
