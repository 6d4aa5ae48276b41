"""The clients' TLS (found in review of the SSLObject-based channel): the blocking client
keeps one deadline per call, as ssl.SSLSocket does (a server trickling a record a byte at a
time cannot hold a call past its timeout), and a certificate for another name is refused."""
from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
import trustme

from queued.client.common import ConnectionFailed, Timeout
from queued.client.credentials import TlsChannel
from queued.client.io_sync import Connection
from queued.client.servers import ServerState


@pytest.fixture
def pki(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
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


def test_blocking_client_read_timeout_under_a_trickle(pki) -> None:
    """A reply record trickled a byte per 0.1 s: the call must end with Timeout after its
    0.5 s wait (ssl.SSLSocket did), not run until the server gives up 3 s later."""
    sctx, cctx = pki
    port, thread = trickling_server(sctx, in_handshake=False, stop_after=3.0, gap=0.1)
    conn = Connection(ServerState(f"127.0.0.1:{port}", "127.0.0.1", port), 5.0, 1 << 20,
                      1000, cctx)
    try:
        with pytest.raises(Timeout):
            conn.call("stats", [], 0.5)
    finally:
        conn.sock.close()
        thread.join(10)


def test_blocking_client_connect_timeout_under_a_trickled_handshake(pki) -> None:
    sctx, cctx = pki
    port, thread = trickling_server(sctx, in_handshake=True, stop_after=3.0, gap=0.1)
    try:
        with pytest.raises(ConnectionFailed, match="timed out"):
            Connection(ServerState(f"127.0.0.1:{port}", "127.0.0.1", port), 0.5, 1 << 20,
                       1000, cctx)
    finally:
        thread.join(10)


def test_channel_checks_the_name(pki) -> None:
    """The certificate (for 127.0.0.1) is refused under another name: server_hostname is
    what the channel verifies."""
    sctx, cctx = pki
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
