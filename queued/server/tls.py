"""TLS for every listener: the server's context, its reload, the handshake, a transport.

Owns the `ssl.SSLContext` (TLS 1.2 or newer; client certificates required and checked
against `tls_client_ca` when it is set), re-reading the certificate files on reload /
SIGHUP (new connections get the new context, open ones carry on; a bad file keeps the
old context), and the handshake under a deadline: a plaintext client or one that
stalls is closed and logged, nothing else is disturbed.

The queue protocols' sessions get a `TlsTransport`: `ssl.SSLObject` over memory BIOs
on the direct socket calls of `SocketTransport`, handing the session everything
decrypted so far in one call (trio.SSLStream gives one TLS record, 16 KiB at most,
per receive: a 100-item RPC put of 1 KiB items took seven trips through the
session's loop). The operations port keeps `trio.SSLStream` (`accept`).
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import trio

from queued.errors import QueuedError
from queued.server.transport import SocketTransport
from queued.wire.tls_records import read_records

log = logging.getLogger("queued.server")


class TlsError(QueuedError):
    """The certificate, key or CA files cannot be used; the message names them."""


def server_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"tls_cert {cert} / tls_key {key}: cannot load: {exc}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"tls_client_ca {client_ca}: cannot load: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ServerTls:
    """The listeners' TLS settings; `context` is what a new connection gets."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.context = server_context(cert, key, client_ca)

    def reload(self) -> None:
        """Re-read the files; raises TlsError and keeps the old context if they are bad."""
        self.context = server_context(self.cert, self.key, self.client_ca)
        log.info("TLS certificate %s reloaded", self.cert)

    async def accept(self, stream: trio.SocketStream, peer: str, timeout: float,
                     ) -> trio.SSLStream[trio.SocketStream] | None:
        """`stream` after a server handshake, or None (logged; the caller counts it and
        closes `stream`) if the handshake fails or does not finish within `timeout`
        seconds."""
        tls = trio.SSLStream(stream, self.context, server_side=True)
        why = ""
        with trio.move_on_after(timeout) as timer:
            try:
                await tls.do_handshake()
                return tls
            except trio.BrokenResourceError as exc:
                cause = exc.__cause__
                why = str(cause) if cause is not None else "connection closed"
        if timer.cancelled_caught:
            why = f"not finished after {timeout:g} s"
        log.info("%s: TLS handshake failed: %s", peer, why,
                 extra={"event": "tls_handshake_failed", "peer": peer})
        return None


#: Bytes of ciphertext read from the socket at once.
RECEIVE_SIZE = 256 * 1024

#: Where every connection of an event loop reads ciphertext into (one buffer per loop,
#: not per connection: each copies its bytes out before it next awaits anything).
_SCRATCH: trio.lowlevel.RunVar[memoryview] = trio.lowlevel.RunVar("tls_scratch")


class TlsTransport:
    """A server-side TLS connection as a session's transport (see the module doc).

    One receiver at a time (the session's loop, or its long-poll watcher) and one
    sender at a time (the session's `_flush`); records the receive side must answer
    (a TLS 1.3 key update) are sent by it, or by a send under way, never by both.
    """

    def __init__(self, raw: SocketTransport, context: ssl.SSLContext) -> None:
        self.raw = raw
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.writing = False  # ciphertext is being written to the socket
        self.closed = False  # the peer ended the TLS session, or broke it

    async def handshake(self) -> None:
        """The server handshake; raises ssl.SSLError or trio.BrokenResourceError."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            await self._write_out()
            if not await self._read_in():
                raise trio.BrokenResourceError("connection closed during the handshake")
        await self._write_out()  # the last flight (TLS 1.3: and the session tickets)

    async def receive(self, max_bytes: int) -> bytes | bytearray:
        """Every byte decrypted so far, up to `max_bytes`; b"" once the peer is gone.

        A fresh bytearray (the session's codecs take bytes or bytearray), decrypted into
        in place: no chunk per record to join (~6 of ~39 us per 100 KiB here).
        """
        tls, incoming = self.tls, self.incoming
        while True:
            n = 0
            # Ciphertext is never shorter than its plaintext: this much room holds it all.
            room = min(max_bytes, incoming.pending + tls.pending())
            buf = bytearray(room if not self.closed else 0)
            if buf:
                with memoryview(buf) as view:
                    n, ended, error = read_records(tls, incoming, view)
                if error is not None:  # not TLS: the peer is done for
                    log.debug("TLS error from the peer: %s", error)
                self.closed = self.closed or ended
            if self.outgoing.pending:
                await self._write_out()
            if n:
                del buf[n:]
                return buf
            if self.closed or not await self._read_in():
                self.closed = True
                return b""

    async def send(self, data: bytes) -> None:
        """All of `data`, encrypted; raises trio.BrokenResourceError if the peer is gone."""
        if self.closed and not data:
            return
        try:
            self.tls.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS: {exc}") from exc
        await self._write_out()

    async def _read_in(self) -> bool:
        """Ciphertext from the socket into the TLS object; False once the peer is gone."""
        try:
            scratch = _SCRATCH.get()
        except LookupError:
            scratch = memoryview(bytearray(RECEIVE_SIZE))
            _SCRATCH.set(scratch)
        got = await self.raw.receive_into(scratch)
        # No checkpoint from the read to here: the scratch buffer is the event loop's.
        if got:
            self.incoming.write(scratch[:got])
        return got > 0

    async def _write_out(self) -> None:
        if self.writing:
            return  # the write under way loops until nothing is pending
        self.writing = True
        try:
            while self.outgoing.pending:
                await self.raw.send(self.outgoing.read())
        finally:
            self.writing = False


async def accept_transport(tls: ServerTls, stream: trio.SocketStream, peer: str,
                           timeout: float) -> TlsTransport | None:
    """A session's transport for `stream` after the server handshake, or None (logged;
    the caller counts it and closes `stream`) if it fails or takes over `timeout` s."""
    transport = TlsTransport(SocketTransport(stream), tls.context)
    why = ""
    with trio.move_on_after(timeout) as timer:
        try:
            await transport.handshake()
            return transport
        except (ssl.SSLError, trio.BrokenResourceError) as exc:
            why = str(exc) or type(exc).__name__
    if timer.cancelled_caught:
        why = f"not finished after {timeout:g} s"
    log.info("%s: TLS handshake failed: %s", peer, why,
             extra={"event": "tls_handshake_failed", "peer": peer})
    return None
