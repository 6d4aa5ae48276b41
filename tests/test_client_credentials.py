"""The clients' TLS and credentials: queued.client (Client, AsyncClient) and the `queued`
client commands against real servers with trustme certificates and a users file.

In-process servers on 127.0.0.1 port 0 for the library clients (the blocking Client runs in
a worker thread), a server subprocess for the CLI (run as subprocesses). Every wait is
bounded; every process is killed by its PID. The blocking client keeps one deadline per
call, as ssl.SSLSocket does (a server trickling a record a byte at a time cannot hold a
call past its timeout), and `TlsChannel` refuses a certificate for another name.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_util import Pki, users_toml
from server_util import HOST, QUEUED, WAIT, ServerProcess, make_config, running
from wait_util import wait_until

from queued.client import (
    AsyncClient,
    AuthFailed,
    Client,
    ConnectionFailed,
    PermissionDenied,
    Timeout,
    Unauthenticated,
)
from queued.client.credentials import TlsChannel, handshake_failure
from queued.client.io_sync import Connection
from queued.client.servers import ServerState
from queued.server.listeners import Server

T = TypeVar("T")

PASSWORD = "s3cret pw"
USERS = dict(
    alice={"password": PASSWORD, "put": ["orders"], "get": ["orders"]},
    root={"password": "root-pw", "admin": True, "put": ["*"], "get": ["*"]},
)


async def in_thread(fn: Callable[[], T]) -> T:
    """Blocking client code off the event loop (the in-process server runs on it)."""
    with trio.fail_after(WAIT * 2):
        return await trio.to_thread.run_sync(fn)




@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "users.toml"
    path.write_text(users_toml(**USERS))
    return path


@asynccontextmanager
async def server(tmp_path: Path, name: str = "data", **settings: object,
                 ) -> AsyncIterator[tuple[Server, str]]:
    """An in-process server; yields it and its RPC address."""
    async with running(make_config(tmp_path / name, **settings)) as srv:
        yield srv, f"{HOST}:{srv.ports['rpc']}"


def tls(pki: Pki) -> dict[str, object]:
    return {"tls_cert": str(pki.cert), "tls_key": str(pki.key)}


# -- TLS -------------------------------------------------------------------------------------


async def test_tls_round_trip_both_clients(tmp_path: Path, pki: Pki) -> None:
    async with server(tmp_path, **tls(pki)) as (srv, address):
        with trio.fail_after(WAIT):
            async with AsyncClient(address, tls=pki.client()) as ac:
                assert await ac.put("q", [b"a", b"b"]) == 2
                assert [i.data for i in await ac.get("q", 5)] == [b"a", b"b"]

        def blocking() -> list[bytes]:
            with Client(address, tls=pki.client()) as c:
                assert c.put("q", "c") == 1
                return [i.data for i in c.get("q", 5)]

        assert await in_thread(blocking) == [b"c"]
        assert srv.protocols["rpc"].tls_handshake_failures == 0


def channel_pair(pki: Pki) -> tuple[TlsChannel, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A TlsChannel and a server SSLObject (with its BIOs) on the test CA, not yet
    connected."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.cert, pki.key)
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = ctx.wrap_bio(s_in, s_out, server_side=True)
    return TlsChannel(pki.client(), "127.0.0.1"), server_side, s_in, s_out


def connect_channel(channel: TlsChannel, srv: ssl.SSLObject, s_in: ssl.MemoryBIO,
                    s_out: ssl.MemoryBIO) -> None:
    for _ in range(10):  # a TLS 1.3 handshake takes two flights each way
        done = channel.handshake()
        s_in.write(channel.to_send())
        with contextlib.suppress(ssl.SSLWantReadError):
            srv.do_handshake()
        channel.feed(s_out.read())
        if done:
            return
    raise AssertionError("the handshake did not finish in 10 flights")


@given(st.lists(st.integers(1, 70_000), min_size=1, max_size=40))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_tls_channel_decrypts_whatever_the_chunking(tmp_path_factory: pytest.TempPathFactory,
                                                    cuts: list[int]) -> None:
    """The server's records reach the channel cut anywhere (one byte at a time too): it
    hands out every byte once, in order, then b"" after the server's close_notify."""
    pki = Pki(tmp_path_factory.mktemp("pki"))
    channel, srv, s_in, s_out = channel_pair(pki)
    connect_channel(channel, srv, s_in, s_out)
    message = bytes(range(256)) * 800  # 200 KiB: 13 records
    srv.write(message)
    srv.write(b"tail")
    with contextlib.suppress(ssl.SSLWantReadError):
        srv.unwrap()  # close_notify
    wire = s_out.read()
    got = bytearray()
    ended = False
    at = 0
    for cut in [*cuts, len(wire)]:
        channel.feed(wire[at:at + cut])
        at += cut
        while (data := channel.decrypt()) is not None:
            if not data:
                ended = True
                break
            got += data
        if at >= len(wire) or ended:
            break
    assert bytes(got) == message + b"tail"
    assert ended and channel.decrypt() == b""
    # and the other way: a request of many records leaves in one piece
    request = b"r" * 50_000
    s_in.write(channel.encrypt(request))
    assert srv.read(100_000) + srv.read(100_000) + srv.read(100_000) + srv.read(
        100_000) == request


def test_tls_channel_end_of_stream_mid_handshake_and_garbage(pki: Pki) -> None:
    channel, _, _, _ = channel_pair(pki)
    assert channel.handshake() is False and channel.to_send()  # the ClientHello
    channel.feed(b"")  # the server hung up: OpenSSL's EOF error (or ours, if it has none)
    with pytest.raises((ssl.SSLEOFError, ConnectionResetError)) as eof:
        channel.handshake()
    why = handshake_failure("h:1", eof.value)  # the hint for a peer that hung up
    assert why.startswith("h:1: TLS handshake failed") and "is the server's port TLS" in why
    channel, srv, s_in, s_out = channel_pair(pki)
    connect_channel(channel, srv, s_in, s_out)
    srv.write(b"x" * 1000)
    wire = s_out.read()
    channel.feed(wire[:-10])  # a record torn by the end of the stream
    channel.feed(b"")
    channel.feed(b"")  # fed twice: still one end
    assert channel.decrypt() == b"" and channel.decrypt() == b""
    channel, _, _, _ = channel_pair(pki)
    assert channel.handshake() is False
    channel.feed(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # not TLS
    with pytest.raises(ssl.SSLError) as info:
        channel.handshake()
    assert "does not speak TLS" in handshake_failure("h:1", info.value)


async def test_batches_of_many_records_both_clients(tmp_path: Path, pki: Pki) -> None:
    """Batches spanning many TLS records each way, through both clients' channels."""
    items = [bytes([i]) * 30_000 for i in range(20)]  # 600 KB: ~37 records per frame
    async with server(tmp_path, **tls(pki)) as (_, address):
        with trio.fail_after(WAIT):
            async with AsyncClient(address, tls=pki.client()) as ac:
                assert await ac.put("q", items) == len(items)
                got = await ac.get("q", 100, 0, 30_000)
                assert [i.data for i in got] == items
                assert await ac.confirm(got) == len(items)

        def blocking() -> list[bytes]:
            with Client(address, tls=pki.client()) as c:
                assert c.put("q", items) == len(items)
                return [i.data for i in c.get("q", 100)]

        assert await in_thread(blocking) == items


async def test_mutual_tls_with_a_client_certificate(tmp_path: Path, pki: Pki) -> None:
    async with server(tmp_path, tls_client_ca=str(pki.ca_file), **tls(pki)) as (_, address):
        with trio.fail_after(WAIT):
            async with AsyncClient(address, tls=pki.client(cert=True)) as ac:
                assert await ac.put("q", b"x") == 1
            async with AsyncClient(address, tls=pki.client(), read_timeout=WAIT) as ac:
                with pytest.raises(ConnectionFailed, match="certificate"):
                    await ac.put("q", b"y")

        def blocking() -> None:
            with Client(address, tls=pki.client(cert=True)) as c:
                assert [i.data for i in c.get("q")] == [b"x"]
            with Client(address, tls=pki.client(), read_timeout=WAIT) as c, \
                    pytest.raises(ConnectionFailed, match="certificate"):
                c.put("q", b"y")

        await in_thread(blocking)


async def test_untrusted_certificate_is_a_clear_connection_failure(tmp_path: Path,
                                                                   pki: Pki) -> None:
    other = trustme.CA()
    async with server(tmp_path, **tls(pki)) as (srv, address):
        with trio.fail_after(WAIT):
            for wrong in (pki.client(other), True):  # another CA; the system's CAs
                async with AsyncClient(address, tls=wrong) as ac:
                    with pytest.raises(ConnectionFailed, match="not trusted") as info:
                        await ac.put("q", b"x")
                    assert ac.statistics().calls == 0  # nothing was sent

        def blocking() -> str:
            with Client(address, tls=pki.client(other)) as c, \
                    pytest.raises(ConnectionFailed, match="not trusted") as err:
                c.version()
            return str(err.value)

        message = await in_thread(blocking)
        assert "TLS handshake failed" in message and "unable to get local issuer" in message
        assert "TLS handshake failed" in str(info.value)
        await wait_until(lambda: srv.protocols["rpc"].tls_handshake_failures >= 3)


async def test_tls_client_on_a_plaintext_port_and_back(tmp_path: Path, pki: Pki) -> None:
    async with server(tmp_path, "plain") as (_, plain), \
            server(tmp_path, "tls", **tls(pki)) as (_, secure):
        options: dict[str, Any] = {"connect_timeout": 2.0, "read_timeout": 2.0}
        # A TLS port waits for a handshake in silence: a plaintext call ends by its read
        # timeout (or the server's close), which needs no 2 s to show.
        silent: dict[str, Any] = {"connect_timeout": 2.0, "read_timeout": 0.5}
        with trio.fail_after(WAIT):
            async with AsyncClient(plain, tls=pki.client(), **options) as ac:
                with pytest.raises(ConnectionFailed, match="does not speak TLS on this port"):
                    await ac.version()
            async with AsyncClient(secure, **silent) as ac:
                # the server waits in silence for a handshake (then closes): either way
                with pytest.raises((Timeout, ConnectionFailed), match="server's port TLS"):
                    await ac.version()

        def blocking() -> None:
            with Client(plain, tls=pki.client(), **options) as c, \
                    pytest.raises(ConnectionFailed, match="does not speak TLS on this port"):
                c.version()
            with Client(secure, **silent) as c, \
                    pytest.raises((Timeout, ConnectionFailed), match="server's port TLS"):
                c.version()

        await in_thread(blocking)


# -- credentials -----------------------------------------------------------------------------


async def test_login_then_permissions(tmp_path: Path, users_file: Path) -> None:
    async with server(tmp_path, users_file=str(users_file)) as (srv, address):
        with trio.fail_after(WAIT):
            async with AsyncClient(address, user="alice", password=PASSWORD) as ac:
                assert await ac.put("orders", b"o1") == 1
                with pytest.raises(PermissionDenied, match="lacks 'put' on queue 'secret'"):
                    await ac.put("secret", b"x")
                with pytest.raises(PermissionDenied):
                    await ac.flush("orders")
                # the connection stays usable: same connection, no new login
                assert [i.data for i in await ac.get("orders")] == [b"o1"]
                stats = ac.statistics()
                assert stats.connects == 1 and stats.servers[0].connected

        def blocking() -> int:
            with Client(address, user="alice", password=PASSWORD) as c:
                assert c.put("orders", b"o2") == 1
                with pytest.raises(PermissionDenied):
                    c.get("secret")
                assert [i.data for i in c.get("orders")] == [b"o2"]
                return c.statistics().connects

        assert await in_thread(blocking) == 1
        assert srv.protocols["rpc"].permission_denied == 3
        assert srv.protocols["rpc"].auth_failures == 0


async def test_wrong_password_fails_at_once_on_every_client(tmp_path: Path,
                                                           users_file: Path) -> None:
    async with server(tmp_path, "a", users_file=str(users_file)) as (srv, first), \
            server(tmp_path, "b", users_file=str(users_file)) as (_, second):
        servers = [first, second]
        with trio.fail_after(WAIT):
            async with AsyncClient(servers, user="alice", password="wrong") as ac:
                with pytest.raises(AuthFailed):
                    await ac.put("orders", b"x")
                # not failed over to the second server, nor backed off: a second call
                # tries again (and fails the same way) instead of waiting
                with pytest.raises(AuthFailed):
                    await ac.put("orders", b"x")
                stats = ac.statistics()
                assert stats.connects == 2 and stats.retries == 0
                assert all(s.failures == 0 and not s.connected for s in stats.servers)

        def blocking() -> None:
            with Client(first, user="nobody", password=PASSWORD) as c, \
                    pytest.raises(AuthFailed) as err:
                c.stats()
            assert PASSWORD not in str(err.value) and "nobody" not in str(err.value)

        await in_thread(blocking)
        assert srv.protocols["rpc"].auth_failures == 2


async def test_no_credentials_on_a_server_with_users(tmp_path: Path, users_file: Path) -> None:
    async with server(tmp_path, users_file=str(users_file)) as (_, address):
        with trio.fail_after(WAIT):
            async with AsyncClient(address) as ac:
                with pytest.raises(Unauthenticated, match="log in first"):
                    await ac.put("orders", b"x")

        def blocking() -> None:
            with Client(address) as c, pytest.raises(Unauthenticated):
                c.get("orders")

        await in_thread(blocking)


def test_credentials_must_come_in_pairs() -> None:
    with pytest.raises(ValueError, match="both"):
        Client("h:1", user="alice")
    with pytest.raises(ValueError, match="both"):
        AsyncClient("h:1", password="pw")
    with pytest.raises(TypeError, match="tls"):
        Client("h:1", tls="yes")  # type: ignore[arg-type]


async def test_reconnect_after_a_restart_logs_in_again_over_tls(tmp_path: Path, pki: Pki,
                                                                 users_file: Path) -> None:
    settings: dict[str, object] = {"users_file": str(users_file), **tls(pki)}
    login: dict[str, Any] = {"tls": pki.client(), "user": "alice", "password": PASSWORD}
    with trio.fail_after(WAIT * 3):
        async with AsyncClient(f"{HOST}:1", **login) as unused:  # never connects
            assert unused.statistics().connects == 0
        async with server(tmp_path, **settings) as (_, address):
            port = int(address.rpartition(":")[2])
            async with AsyncClient(address, **login) as ac:
                assert await ac.put("orders", b"before") == 1
                blocking = Client(address, **login)
                assert await in_thread(lambda: blocking.put("orders", b"b1")) == 1
        # The server is gone; a new one on the same port with the same data dir.
        async with server(tmp_path, rpc_port=port, **settings) as (srv, again):
            assert again == address
            async with AsyncClient(address, **login) as ac:
                assert await ac.put("orders", b"after") == 1
            assert await in_thread(lambda: blocking.put("orders", b"b2")) == 1
            stats = blocking.statistics()
            assert stats.connects == 2 and stats.retries == 1
            items = await in_thread(lambda: blocking.get("orders", 10))
            assert [i.data for i in items] == [b"before", b"b1", b"after", b"b2"]
            blocking.close()
            assert srv.protocols["rpc"].auth_failures == 0


# -- the command-line client -----------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pki]]:
    """A server subprocess with TLS (no client certificates) and users."""
    base = tmp_path_factory.mktemp("cli-security")
    pki = Pki(base)
    users = base / "users.toml"
    users.write_text(users_toml(**USERS))
    config = base / "queued.toml"
    config.write_text(f'[server]\ntls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
                      f'users_file = "{users}"\n')
    proc = ServerProcess(base / "data", base / "server.log", config)
    try:
        proc.start()
        yield f"{HOST}:{proc.rpc}", pki
    finally:
        proc.kill()


def queued(*args: str, password: str | None = None,
           stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "QUEUED_PASSWORD"}
    if password is not None:
        env["QUEUED_PASSWORD"] = password
    return subprocess.run([str(QUEUED), *args], input=stdin, capture_output=True, env=env,
                          timeout=WAIT * 2, check=False)


def test_cli_tls_and_login(secure_server: tuple[str, Pki]) -> None:
    address, pki = secure_server
    ca = ["--server", address, "--ca", str(pki.ca_file)]
    r = queued("put", *ca, "--user", "alice", "orders", "one", "two", password=PASSWORD)
    assert (r.returncode, r.stderr) == (0, b"stored 2 items\n")
    r = queued("get", *ca, "--user", "alice", "orders", "-n", "5", password=PASSWORD)
    assert (r.returncode, r.stdout) == (0, b"one\ntwo\n")
    r = queued("stats", *ca, "--user", "root", password="root-pw")
    assert r.returncode == 0 and b"orders" in r.stdout


def test_cli_auth_failures_and_refusals(secure_server: tuple[str, Pki]) -> None:
    address, pki = secure_server
    ca = ["--server", address, "--ca", str(pki.ca_file)]
    r = queued("put", *ca, "--user", "alice", "orders", "x", password="bad-pw-x1")
    assert r.returncode == 1
    assert b"authentication failed" in r.stderr and b"bad-pw-x1" not in r.stderr + r.stdout
    r = queued("flush", *ca, "--user", "alice", "orders", password=PASSWORD)
    assert r.returncode == 1 and b"permission denied" in r.stderr
    r = queued("peek", *ca, "orders")
    assert r.returncode == 1 and b"--user" in r.stderr
    outputs = []
    for args, why in ((["--tls"], b"not trusted"), ([], b"is the server's port TLS")):
        r = queued("peek", "--server", address, *args, "--user", "root", "orders",
                   "--timeout", "1000", password="root-pw")
        assert r.returncode == 3 and why in r.stderr, r.stderr
        outputs += [r.stdout, r.stderr]
    assert not [out for out in outputs if b"root-pw" in out]


def test_cli_password_needs_a_terminal_or_the_environment(
        secure_server: tuple[str, Pki]) -> None:
    address, pki = secure_server
    r = queued("put", "--server", address, "--ca", str(pki.ca_file), "--user", "alice",
               "orders", "x")
    assert r.returncode == 2
    assert b"QUEUED_PASSWORD" in r.stderr and r.stdout == b""


def test_cli_tls_flags_are_checked(tmp_path: Path, secure_server: tuple[str, Pki]) -> None:
    address, pki = secure_server
    r = queued("peek", "--server", address, "--key", str(pki.key), "q")
    assert r.returncode == 2 and b"--key needs --cert" in r.stderr
    r = queued("peek", "--server", address, "--ca", str(tmp_path / "missing.pem"), "q")
    assert r.returncode == 2 and b"missing.pem" in r.stderr


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pki, Path]]:
    """A server subprocess that wants client certificates; yields a client cert + key too."""
    base = tmp_path_factory.mktemp("cli-mtls")
    pki = Pki(base)
    config = base / "queued.toml"
    config.write_text(f'[server]\ntls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
                      f'tls_client_ca = "{pki.ca_file}"\n')
    client = pki.ca.issue_cert("client.example")
    client.cert_chain_pems[0].write_to_path(str(base / "client.crt"))
    client.private_key_pem.write_to_path(str(base / "client.key"))
    proc = ServerProcess(base / "data", base / "server.log", config)
    try:
        proc.start()
        yield f"{HOST}:{proc.rpc}", pki, base
    finally:
        proc.kill()


def test_cli_client_certificate(mtls_server: tuple[str, Pki, Path]) -> None:
    address, pki, base = mtls_server
    ca = ["--server", address, "--ca", str(pki.ca_file)]
    mine = ["--cert", str(base / "client.crt"), "--key", str(base / "client.key")]
    r = queued("put", *ca, *mine, "m", "x")
    assert (r.returncode, r.stderr) == (0, b"stored 1 item\n")
    r = queued("get", *ca, "m")
    assert r.returncode == 3 and b"certificate" in r.stderr
    r = queued("get", *ca, *mine, "m")
    assert (r.returncode, r.stdout) == (0, b"x\n")


def test_cli_asks_the_password_at_a_terminal_without_echo(
        secure_server: tuple[str, Pki]) -> None:
    address, pki = secure_server
    env = {k: v for k, v in os.environ.items() if k != "QUEUED_PASSWORD"}
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(QUEUED), "put", "--server", address, "--ca", str(pki.ca_file), "--user", "alice",
         "orders", "typed"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, start_new_session=True)  # no controlling terminal: getpass uses stdin
    try:
        assert proc.stderr is not None
        prompt = b""
        deadline = time.monotonic() + WAIT
        while not prompt.endswith(b"password for alice: ") and time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 0.1)[0]:
                prompt += os.read(proc.stderr.fileno(), 1024)
        assert prompt.endswith(b"password for alice: ")
        os.write(master, PASSWORD.encode() + b"\n")  # echo is off once the prompt is out
        out, err = proc.communicate(timeout=WAIT * 2)
        echoed = os.read(master, 4096) if select.select([master], [], [], 0.2)[0] else b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
        os.close(master)
        os.close(slave)  # open until here: reading the master fails once no slave is open
    assert (proc.returncode, err) == (0, b"\nstored 1 item\n")
    assert PASSWORD.encode() not in out + err + echoed


# -- one deadline per call under a trickle; a certificate for another name ---------------------


Contexts = tuple[ssl.SSLContext, ssl.SSLContext]


@pytest.fixture
def contexts(tmp_path: Path) -> Contexts:
    """A server and a client context: a leaf for 127.0.0.1 and a client trusting its CA."""
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    leaf.private_key_pem.write_to_path(str(tmp_path / "k.pem"))
    (tmp_path / "c.pem").write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    cctx = ssl.create_default_context()
    ca.configure_trust(cctx)
    return sctx, cctx


def trickling_server(sctx: ssl.SSLContext, *, in_handshake: bool, stop_after: float,
                     gap: float) -> tuple[int, threading.Thread]:
    """A TLS server that sends one record (a handshake flight, or a reply) a byte every
    `gap` s, then closes the connection after `stop_after` s."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def drip(conn: socket.socket, data: bytes) -> None:
        t0 = time.monotonic()
        for b in data:
            if time.monotonic() - t0 > stop_after:
                break
            conn.sendall(bytes([b]))
            time.sleep(gap)
        conn.close()

    def serve() -> None:
        conn, _ = lsock.accept()
        lsock.close()
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = sctx.wrap_bio(inc, out, server_side=True)
        with contextlib.suppress(OSError):
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    pass
                if out.pending:
                    if in_handshake:
                        return drip(conn, out.read())
                    conn.sendall(out.read())
                inc.write(conn.recv(65536))
            conn.sendall(out.read())
            while True:  # the request
                try:
                    tls.read(65536)
                    break
                except ssl.SSLWantReadError:
                    inc.write(conn.recv(65536))
            tls.write(b"\x94" + b"x" * 200)  # one record
            drip(conn, out.read())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lsock.getsockname()[1], thread


def test_blocking_client_read_timeout_under_a_trickle(contexts: Contexts) -> None:
    """A reply record trickled a byte per 0.1 s: the call must end with Timeout after its
    0.5 s wait (ssl.SSLSocket did), not run until the server gives up 3 s later."""
    sctx, cctx = contexts
    port, thread = trickling_server(sctx, in_handshake=False, stop_after=3.0, gap=0.1)
    conn = Connection(ServerState(f"127.0.0.1:{port}", "127.0.0.1", port), 5.0, 1 << 20,
                      1000, cctx)
    try:
        with pytest.raises(Timeout):
            conn.call("stats", [], 0.5)
    finally:
        conn.sock.close()
        thread.join(10)


def test_blocking_client_connect_timeout_under_a_trickled_handshake(contexts: Contexts) -> None:
    sctx, cctx = contexts
    port, thread = trickling_server(sctx, in_handshake=True, stop_after=3.0, gap=0.1)
    try:
        with pytest.raises(ConnectionFailed, match="timed out"):
            Connection(ServerState(f"127.0.0.1:{port}", "127.0.0.1", port), 0.5, 1 << 20,
                       1000, cctx)
    finally:
        thread.join(10)


def test_channel_checks_the_name(contexts: Contexts) -> None:
    """The certificate (for 127.0.0.1) is refused under another name: server_hostname is
    what the channel verifies."""
    sctx, cctx = contexts
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = sctx.wrap_bio(s_in, s_out, server_side=True)
    channel = TlsChannel(cctx, "queue-0.example")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        for _ in range(10):
            channel.handshake()
            s_in.write(channel.to_send())
            with contextlib.suppress(ssl.SSLWantReadError):
                srv.do_handshake()
            channel.feed(s_out.read())
