"""TLS for every listener: the server's context, its reload, the handshake, a transport.

Owns the `ssl.SSLContext` (TLS 1.2 or newer; client certificates required and checked
against `tls_client_ca` when it is set), re-reading the certificate files on reload /
SIGHUP (new connections get the new context, open ones carry on; a bad file keeps the
old context), and the handshake under a deadline: a plaintext client or one that
stalls is closed and logged, nothing else is disturbed.

The queue protocols' connections get a `TlsChannel`: `ssl.SSLObject` over memory BIOs,
with no I/O of its own, so that the reactor serves a TLS connection in its passes as
it does a plain one (it decrypts what a pass reads, encrypts what it sends), and the
session sees everything decrypted so far at once (trio.SSLStream gives one TLS record,
16 KiB at most, per receive). The handshake runs in the connection's task, under its
deadline. The operations port keeps `trio.SSLStream` (`accept`).
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


#: Bytes of ciphertext read from the socket at once during a handshake.
RECEIVE_SIZE = 64 * 1024

#: Where every handshake of an event loop reads ciphertext into (one buffer per loop,
#: not per connection: each copies its bytes out before it next awaits anything).
_SCRATCH: trio.lowlevel.RunVar[memoryview] = trio.lowlevel.RunVar("tls_scratch")


class TlsChannel:
    """A server-side TLS session with no I/O of its own: `ssl.SSLObject` over memory
    BIOs. Whoever owns the socket feeds it the ciphertext it reads (`feed`), takes the
    plaintext (`decrypt`), encrypts what it sends (`encrypt`) and sends what the session
    owes the peer unasked (`to_send`: a TLS 1.3 key update's answer), all in one order.
    """

    __slots__ = ("ended", "framed", "head", "incoming", "left", "outgoing", "tls")

    def __init__(self, context: ssl.SSLContext) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.ended = False  # the peer ended the TLS session (close_notify), or broke it
        # The record framing of what was fed (OpenSSL may take in part of a record, so
        # neither BIO says whether one has begun): the next record's header bytes seen
        # so far, and the bytes still to come of the record under way. `framed` turns
        # False for good at a header that is not a TLS record's (an SSLv2-format hello,
        # which OpenSSL may still take; garbage, which ends the session): no record is
        # said to be under way from then on.
        self.framed = True
        self.head = b""
        self.left = 0

    def feed(self, ciphertext: bytes | bytearray | memoryview) -> None:
        self.incoming.write(ciphertext)
        if not self.framed:
            return
        # Follow the record framing: a 5-byte header (type 20-24, version 3.x) whose
        # last two bytes are the length of what follows.
        n = len(ciphertext)
        i = 0
        head, left = self.head, self.left
        while i < n:
            if left:
                step = min(left, n - i)
                left -= step
                i += step
                continue
            if not head and n - i >= 5:  # (the usual case: a whole header at hand)
                kind, major, high, low = (ciphertext[i], ciphertext[i + 1],
                                          ciphertext[i + 3], ciphertext[i + 4])
                i += 5
            else:
                piece = bytes(ciphertext[i:i + 5 - len(head)])
                head += piece
                i += len(piece)
                if len(head) < 5:
                    break
                kind, major, high, low = head[0], head[1], head[3], head[4]
                head = b""
            if not (20 <= kind <= 24 and major == 3):
                self.framed = False
                left = 0
                break
            left = (high << 8) | low
        self.head, self.left = head, left

    def mid_record(self) -> bool:
        """Part of a record has come, and not the rest: a request may be under way."""
        return not self.ended and bool(self.head or self.left)

    def has_input(self) -> bool:
        """Ciphertext or plaintext is buffered (perhaps only part of a record)."""
        return not self.ended and bool(self.incoming.pending or self.tls.pending())

    def decrypt(self, max_bytes: int) -> bytearray:
        """Every byte decrypted so far, up to `max_bytes`: empty if only part of a record
        is buffered, or once the session `ended` (the peer's close_notify, or bytes that
        are not TLS: logged at debug, the connection is done for).

        A fresh bytearray (the codecs take bytes or bytearray), decrypted into in place:
        no chunk per record to join (~6 of ~39 us per 100 KiB here).
        """
        tls, incoming = self.tls, self.incoming
        # Ciphertext is never shorter than its plaintext, so this much room holds what
        # is buffered, but for a record whose first part OpenSSL took in already (it is
        # in neither count): a second round takes that one.
        room = min(max_bytes, incoming.pending + tls.pending())
        if self.ended or room <= 0:
            return bytearray()
        buf = bytearray(room)
        n = 0
        while True:
            with memoryview(buf) as whole, whole[n:] as view:
                got, ended, error = read_records(tls, incoming, view)
            if error is not None:
                log.debug("TLS error from the peer: %s", error)
            n += got
            self.ended = ended
            if ended or n < len(buf):
                break  # (the rest of a record is on its way, or the session ended)
            room = min(max_bytes - n, incoming.pending + tls.pending())
            if room <= 0:
                break
            buf.extend(bytes(room))
        if n < len(buf):
            del buf[n:]
        return buf

    def encrypt(self, data: bytes | bytearray) -> bytes:
        """`data` as TLS records (after anything owed); raises ssl.SSLError."""
        self.tls.write(data)
        return self.outgoing.read()

    def to_send(self) -> bytes:
        """The records to send that no `encrypt` carried (b"": none)."""
        return self.outgoing.read() if self.outgoing.pending else b""

    async def handshake(self, raw: SocketTransport) -> None:
        """The server handshake over `raw`; raises ssl.SSLError or
        trio.BrokenResourceError. Ciphertext read past it (a request sent along with the
        client's last flight) stays buffered: `has_input` says so."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            await self._write_out(raw)
            try:
                scratch = _SCRATCH.get()
            except LookupError:
                scratch = memoryview(bytearray(RECEIVE_SIZE))
                _SCRATCH.set(scratch)
            got = await raw.receive_into(scratch)
            # No checkpoint from the read to here: the scratch buffer is the event loop's.
            if not got:
                raise trio.BrokenResourceError("connection closed during the handshake")
            self.feed(scratch[:got])
        await self._write_out(raw)  # the last flight (TLS 1.3: and the session tickets)

    async def _write_out(self, raw: SocketTransport) -> None:
        while self.outgoing.pending:
            await raw.send(self.outgoing.read())


async def accept_channel(tls: ServerTls, stream: trio.SocketStream, peer: str,
                         timeout: float) -> TlsChannel | None:
    """The connection's TLS session after the server handshake on `stream`, or None
    (logged; the caller counts it and closes `stream`) if it fails or takes over
    `timeout` s."""
    channel = TlsChannel(tls.context)
    why = ""
    with trio.move_on_after(timeout) as timer:
        try:
            await channel.handshake(SocketTransport(stream))
            return channel
        except (ssl.SSLError, trio.BrokenResourceError) as exc:
            why = str(exc) or type(exc).__name__
    if timer.cancelled_caught:
        why = f"not finished after {timeout:g} s"
    log.info("%s: TLS handshake failed: %s", peer, why,
             extra={"event": "tls_handshake_failed", "peer": peer})
    return None
