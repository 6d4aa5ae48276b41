"""TLS for every listener: the server's context, its reload, and the handshake.

Owns the `ssl.SSLContext` (TLS 1.2 or newer; client certificates required and checked
against `tls_client_ca` when it is set), re-reading the certificate files on reload /
SIGHUP (new connections get the new context, open ones carry on; a bad file keeps the
old context), and the handshake under a deadline: a plaintext client or one that
stalls is closed and logged, nothing else is disturbed.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import trio

log = logging.getLogger("queued.server")


class TlsError(Exception):
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
