"""TLS for every listener (queued.server.tls) with certificates made by trustme: every
protocol over TLS, plaintext and stalled handshakes closed while others carry on, client
certificates required when configured, certificates re-read on reload with open
connections carrying on, big items and many records through the transport, garbage after
the handshake. Real servers on 127.0.0.1 port 0, real TLS clients."""

from __future__ import annotations

import contextlib
import http.client
import logging
import ssl
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trustme
from compiled_util import not_compiled
from hypothesis import given, settings
from hypothesis import strategies as st
from pymemcache.client.base import Client as MemcacheClient
from security_util import Pki, tls_conn, tls_open, tls_settings
from server_util import (
    HOST,
    WAIT,
    Conn,
    Rpc,
    make_config,
    only_the_failing_one_closes,
    running,
)
from wait_util import wait_until

from queued.config import ConfigError
from queued.server.tls import TlsChannel, server_context


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
        await wait_until(lambda: not server.connections())


class BioClient:
    """A TLS client over memory BIOs on a trio stream: what it sends is written as the
    test says (records of its own together with other bytes, in one write)."""

    def __init__(self, stream: trio.SocketStream, ctx: ssl.SSLContext) -> None:
        self.stream = stream
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")

    @classmethod
    async def connect(cls, port: int, ctx: ssl.SSLContext) -> BioClient:
        """Connected, the handshake done but for the client's last flight (still in
        `outgoing`: the next `records` carry it)."""
        client = cls(await trio.open_tcp_stream(HOST, port), ctx)
        with trio.fail_after(WAIT):
            while True:
                try:
                    client.tls.do_handshake()
                    return client
                except ssl.SSLWantReadError:
                    pass
                if client.outgoing.pending:
                    await client.stream.send_all(client.outgoing.read())
                client.incoming.write(await client.stream.receive_some(65536))

    def records(self, data: bytes) -> bytes:
        """Whatever the client owes the server, then `data` encrypted."""
        self.tls.write(data)
        return self.outgoing.read()

    async def receive_until(self, end: bytes) -> bytes:
        got = b""
        with trio.fail_after(WAIT):
            while not got.endswith(end):
                self.incoming.write(await self.stream.receive_some(65536))
                with contextlib.suppress(ssl.SSLWantReadError):
                    while chunk := self.tls.read(65536):
                        got += chunk
        return got


@pytest.mark.parametrize("waiting", [False, True])  # read by a pass; by a waiting peek's task
async def test_garbage_after_the_handshake_closes_only_that_connection(
        tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture, waiting: bool) -> None:
    """An application record that is not the peer's ends its connection quietly (a debug
    line, no error logged); a request decrypted before it in the same read runs; the
    others carry on."""
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        port = server.ports["memcache"]
        good = tls_conn(await tls_open(port, pki.client()))
        bad = await BioClient.connect(port, pki.client())
        if waiting:
            await bad.stream.send_all(bad.records(b"get w/peek/t=5000\r\n"))
            await wait_until(lambda: server.broker.reader_info("w").get("waiters") == 1)
        forged = b"\x17\x03\x03\x00\x10" + b"\x00" * 16  # an application record, not theirs
        with caplog.at_level(logging.DEBUG, logger="queued.server"):
            # A set, then the forged record, in one write (one read for the server).
            await bad.stream.send_all(bad.records(b"set q 0 0 5\r\nfirst\r\n") + forged)
            with trio.fail_after(WAIT):
                with contextlib.suppress(trio.BrokenResourceError):
                    while await bad.stream.receive_some(65536):
                        pass  # (an alert, perhaps; then the end)
            await wait_until(lambda: server.connections() == 1)
        assert "TLS error from the peer" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        if not waiting:  # (behind a peek, the set waits its turn: the connection ends first)
            assert await good.get("q") == b"first"
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


async def test_items_across_record_and_read_boundaries(tmp_path: Path, pki: Pki) -> None:
    """Each set alone in flight, sized around a TLS record (16 KiB of plaintext) and the
    server's read (64 KiB): a record that a read cuts in two is decrypted once its rest
    arrives, with nothing after it to push it along."""
    sizes = [1, 16_383, 16_384, 16_385, 65_000, 65_536, 70_000, 131_077, 300_000]
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        mc = tls_conn(await tls_open(server.ports["memcache"], pki.client()))
        for size in sizes:
            data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            assert await mc.set("q", data) == b"STORED", size
            assert await mc.get("q") == data, size
        await mc.stream.aclose()


async def test_a_request_sent_with_the_handshakes_last_flight_is_answered(
        tmp_path: Path, pki: Pki) -> None:
    """The client's Finished and its first requests in one write: the server's handshake
    reads them together, and the requests are run without waiting for more bytes."""
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        client = await BioClient.connect(server.ports["memcache"], pki.client())
        # Finished, then the requests, in one write
        await client.stream.send_all(client.records(b"set q 0 0 2\r\nhi\r\nget q\r\n"))
        assert await client.receive_until(b"END\r\n") == (
            b"STORED\r\nVALUE q 0 2\r\nhi\r\nEND\r\n")
        await client.stream.aclose()


async def test_a_peer_that_stops_inside_a_record_is_closed_at_request_timeout(
        tmp_path: Path, pki: Pki) -> None:
    """Half a record decrypts to nothing, but a request has begun to arrive: its
    connection is closed at request_timeout like a plain one that stops mid-request,
    while the others carry on (and an idle one stays open)."""
    config = make_config(tmp_path / "data", **tls_settings(pki), request_timeout=300)
    async with running(config) as server:
        port = server.ports["memcache"]
        idle = tls_conn(await tls_open(port, pki.client()))
        assert await idle.set("q", b"0") == b"STORED"
        staller = await BioClient.connect(port, pki.client())
        await staller.stream.send_all(staller.records(b"get q\r\n"))  # (its last flight)
        assert await staller.receive_until(b"END\r\n") == b"VALUE q 0 1\r\n0\r\nEND\r\n"
        record = staller.records(b"set q 0 0 5\r\nhello\r\n")
        await staller.stream.send_all(record[: len(record) // 2])  # and nothing more
        with trio.fail_after(WAIT):
            assert await staller.stream.receive_some(65536) == b""  # closed
        assert server.protocols["memcache"].request_timeouts == 1
        assert await idle.set("q", b"1") == b"STORED"  # the other carries on
        assert server.broker.reader_info("q")["items"] == 1
        await idle.stream.aclose()


def test_the_channel_follows_the_record_framing_of_what_it_is_fed(pki: Pki) -> None:
    """`mid_record` is true from a record's first byte to its last, however the bytes
    are cut (one at a time here), and through the handshake's records too."""
    server = TlsChannel(server_context(pki.cert, pki.key, None))
    c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = pki.client().wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    for _ in range(10):  # the handshake, fed whole
        with contextlib.suppress(ssl.SSLWantReadError):
            client.do_handshake()
        server.feed(c_out.read())
        assert not server.mid_record()
        with contextlib.suppress(ssl.SSLWantReadError):
            server.tls.do_handshake()
        c_in.write(server.to_send())
    assert server.tls.version() is not None and not server.mid_record()
    client.write(b"set q 0 0 2\r\nhi\r\n")
    client.write(b"get q\r\n")  # (two records)
    records = c_out.read()
    got = bytearray()
    ends = 0
    for i in range(len(records)):
        server.feed(records[i:i + 1])
        more = server.decrypt(1 << 20)
        got += more
        ends += bool(more)
        # mid-record at every byte but the one that ends a record (which decrypts)
        assert server.mid_record() == (not more), i
    assert got == b"set q 0 0 2\r\nhi\r\nget q\r\n" and ends == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6),
       st.lists(st.integers(1, 400), max_size=12))
def test_the_record_framing_holds_wherever_the_reads_cut(sizes: list[int],
                                                         cuts: list[int]) -> None:
    """Records (empty ones too) cut into reads anywhere (a header split, a record's tail
    and the next one's head in one read): `mid_record` is false exactly at the records'
    ends."""
    channel = TlsChannel(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    wire = b"".join(bytes([23, 3, 3]) + n.to_bytes(2, "big") + b"\xab" * n for n in sizes)
    ends, at = set(), 0
    for n in sizes:
        at += 5 + n
        ends.add(at)
    fed = 0
    for cut in [*cuts, len(wire)]:
        piece = wire[fed:fed + cut]
        channel.feed(piece)
        fed += len(piece)
        assert channel.mid_record() == (fed not in ends and fed > 0), fed
        if fed == len(wire):
            break
    assert fed == len(wire) and not channel.mid_record()


def test_a_hello_in_the_old_sslv2_form_turns_the_framing_off() -> None:
    """A first record that is not a TLS record's header (an SSLv2-format hello, 2-byte
    header) is not followed: no record is said to be under way from then on, rather than
    lengths read from the wrong bytes."""
    channel = TlsChannel(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    channel.feed(b"\x80\x2e\x01\x03\x03" + b"\x00" * 20)  # (cut short)
    assert not channel.mid_record()
    channel.feed(b"\x17\x03\x03\x00\x10" + b"\x00" * 3)  # a TLS header after it: not read
    assert not channel.mid_record()


@not_compiled("replaces a method of TlsChannel, which a compiled class does not allow")
async def test_a_decrypt_that_fails_closes_only_its_connection(
        tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure out of a TLS connection's decrypt other than the peer's bad bytes (a bug:
    here, for the connection that sends `boom`) is logged and ends that connection; the
    others are served on."""
    decrypt = TlsChannel.decrypt

    def failing(self: TlsChannel, max_bytes: int) -> bytearray:
        data = decrypt(self, max_bytes)
        if b"boom" in data:
            raise RuntimeError("a bug")
        return data

    monkeypatch.setattr(TlsChannel, "decrypt", failing)
    async with running(make_config(tmp_path / "data", **tls_settings(pki))) as server:
        port = server.ports["memcache"]
        bad = tls_conn(await tls_open(port, pki.client()))
        good = tls_conn(await tls_open(port, pki.client()))
        await only_the_failing_one_closes(bad, good, "decrypting failed; closing the connection",
                                          caplog)
