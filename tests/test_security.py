"""Security over the wire: logins and permissions on every protocol and on the HTTP port,
deadlines for half-sent requests and logins, max_queues, SIGHUP re-reading certificates
and users in a running server, and refused connections leaving nothing behind.

Real servers on 127.0.0.1 port 0, real TLS with certificates made by trustme, real
clients (pymemcache, msgpack over raw sockets, http.client). The users file itself:
test_config_users.py; permissions, pure: test_wire_access.py; TLS: test_server_tls.py;
the refusal to listen beyond loopback: test_server_app.py.
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
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
import trustme
from pymemcache.client.base import Client as MemcacheClient
from security_util import REFUSED, Pki, mc_login, secured, users_toml
from server_util import (
    HOST,
    QUEUED,
    WAIT,
    Conn,
    Rpc,
    ServerProcess,
    make_config,
    running,
)
from wait_util import autojumping, wait_until, wait_until_blocking

from queued.config import ConfigError
from queued.config.users import PasswordHash

# -- the users file and the hashes ---------------------------------------------------------


# -- permissions ---------------------------------------------------------------------------


# -- authentication on each protocol -------------------------------------------------------


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


# -- deadlines and limits ------------------------------------------------------------------


async def test_trickling_request_is_closed_after_request_timeout(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    config = make_config(tmp_path / "data", request_timeout=400)
    async with running(config) as server:
        with autojumping(trio_clock):  # (no thread at work in this test)
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
            await trio.sleep(0.5)  # (trio time) past the deadline for an idle connection too
            assert await idle.get("q") == b"0"  # the idle one is still served
            for conn in (idle, other):
                await conn.aclose()


@pytest.mark.parametrize(("proto", "partial"), [
    ("text", b"put q:\nab"),
    ("rpc", msgpack.packb([0, 1, "put", ["q", [b"x" * 100]]])[:20]),
])
async def test_half_sent_requests_time_out_on_every_protocol(

        tmp_path: Path, proto: str, partial: bytes, trio_clock: trio.testing.MockClock) -> None:
    async with running(make_config(tmp_path / "data", request_timeout=300)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            conn = await Conn.open(server.ports[proto])
            await conn.send(partial)
            await conn.expect_closed(timeout=5)
            assert server.protocols[proto].request_timeouts == 1


async def test_long_poll_is_not_a_half_sent_request(
        tmp_path: Path, trio_clock: trio.testing.MockClock) -> None:
    async with running(make_config(tmp_path / "data", request_timeout=200)) as server:
        with autojumping(trio_clock):  # (no thread works in this test)
            conn = await Conn.open(server.ports["memcache"])
            await conn.send(b"get q/t=800\r\n")
            assert await conn.line() == b"END"  # answered after 0.8 s, not closed at 0.2
            assert server.protocols["memcache"].request_timeouts == 0
            await conn.aclose()


async def test_login_must_come_within_auth_timeout(
        tmp_path: Path, users_file: Path, trio_clock: trio.testing.MockClock) -> None:
    async with secured(tmp_path, users_file, auth_timeout=300) as server:
        conn = await Conn.open(server.ports["memcache"])
        with autojumping(trio_clock):
            await conn.expect_closed(timeout=5)
        assert server.protocols["memcache"].auth_failures == 1
        ok = await mc_login(server.ports["memcache"], "alice", "alice pw")  # (held: scrypt
        with autojumping(trio_clock):                                       # in a thread)
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


def test_passwd_prints_a_hash_that_verifies() -> None:
    proc = subprocess.run([str(QUEUED), "passwd"], input=b"correct horse\n",
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.decode().strip()
    assert PasswordHash.parse(text).verify("correct horse")
    assert "correct horse" not in text
    empty = subprocess.run([str(QUEUED), "passwd"], input=b"\n", capture_output=True, timeout=60)
    assert empty.returncode == 2 and b"empty password" in empty.stderr


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
        wait_until_blocking(lambda: b"reloaded (SIGHUP)" in server.log(), why="the reload")
        with pytest.raises(ssl.SSLError):
            login(pki.client(), "dave", "d")  # the old CA no longer vouches for it
        assert login(pki.client(new_ca), "dave", "d") == b"STORED\r\n"
        assert login(pki.client(new_ca), "alice", "alice pw") == (
            b"CLIENT_ERROR authentication failure\r\n")
        assert b"alice pw" not in server.log()
    finally:
        server.kill()


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
            await wait_until(lambda: not server.connections())
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
