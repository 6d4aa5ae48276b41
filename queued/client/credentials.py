"""TLS and credentials for both clients: the `tls=` and `user=`/`password=` arguments checked
and turned into what io_trio / io_sync need, what a failed handshake means, and `TlsChannel`,
the TLS connection both I/O modules run over their own sockets.

Owns no socket: the I/O modules move the bytes. Never puts a password into a message, a repr
or a log.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import TypeAlias

from queued.wire.tls_records import read_records

#: `tls=`: None or False = plaintext; True = verify the server with the system's CAs;
#: an `ssl.SSLContext` = as given (your CA, a client certificate for mutual TLS, ...).
TlsOption: TypeAlias = bool | ssl.SSLContext | None

#: The most plaintext handed out at once (as wire.RECV: the clients' receive size).
PLAINTEXT_MAX = 256 * 1024


class TlsChannel:
    """A client TLS connection without I/O: `ssl.SSLObject` over memory BIOs.

    The I/O module sends `to_send()` after each step and feeds what its socket receives.
    Not `ssl.SSLSocket` or `trio.SSLStream`: those write each TLS record (16 KiB at most)
    with a call of its own and return one record per receive (a 100 KiB batch took seven
    trips through the client's receive loop); here a request goes out in one send, and a
    receive returns everything decrypted so far.
    """

    def __init__(self, context: ssl.SSLContext, host: str) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        self.plain = bytearray(PLAINTEXT_MAX)  # decrypted, before it is copied out
        self.ended = False  # the server ended the TLS session (or the stream)
        self.stream_ended = False  # the end of the stream was fed

    def handshake(self) -> bool:
        """One step of the client handshake: True once it is done; False: send `to_send()`
        and feed the reply. Raises ssl.SSLError, or ConnectionResetError if the server
        closed the connection."""
        try:
            self.tls.do_handshake()
            return True
        except ssl.SSLWantReadError:
            if self.stream_ended:
                raise ConnectionResetError("the server closed the connection") from None
            return False

    def encrypt(self, data: bytes) -> bytes:
        """The records carrying `data`, after anything else owed to the server."""
        self.tls.write(data)
        return self.outgoing.read()

    def to_send(self) -> bytes:
        """Records owed to the server (handshake flights, a key update's answer), or b""."""
        return self.outgoing.read() if self.outgoing.pending else b""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Ciphertext received; empty: the end of the stream."""
        if data:
            self.incoming.write(data)
        elif not self.stream_ended:
            self.stream_ended = True
            self.incoming.write_eof()

    def decrypt(self) -> bytes | None:
        """Everything decrypted from what was fed, up to PLAINTEXT_MAX bytes; b"" once the
        session is over; None if the next bytes need more ciphertext. Raises ssl.SSLError
        if the server's bytes are not TLS (or not its)."""
        n = 0
        if not self.ended:
            with memoryview(self.plain) as view:
                n, self.ended, error = read_records(self.tls, self.incoming,
                                                    view[:PLAINTEXT_MAX])
                if error is not None:
                    raise error
                if n:
                    return bytes(view[:n])
        if self.ended or self.stream_ended:  # nothing more will come (a torn record: gone)
            self.ended = True
            return b""
        return None


def tls_context(tls: TlsOption) -> ssl.SSLContext | None:
    """The client context `tls=` asks for, or None for plaintext."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, ssl.SSLContext):
        return tls
    raise TypeError(f"tls must be None, a bool or an ssl.SSLContext, not {type(tls).__name__}")


def tls_files_context(ca: str | None = None, cert: str | None = None,
                      key: str | None = None) -> ssl.SSLContext:
    """A client context trusting the system's CAs, or the PEM bundle `ca`; with `cert`
    (and its `key`, unless in the same file) presenting a client certificate. ValueError
    naming the file that cannot be loaded."""
    if key and not cert:
        raise ValueError("a client key needs its client certificate")
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"CA bundle {ca}: cannot load: {exc}") from None
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            files = f"{cert} / key {key}" if key else cert
            raise ValueError(f"client certificate {files}: cannot load: {exc}") from None
    return ctx


#: OpenSSL's reasons for a handshake failing because the port does not speak TLS.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})


def handshake_failure(address: str, exc: BaseException | None) -> str:
    """Why a TLS handshake with `address` failed, in words that say what to check."""
    prefix = f"{address}: TLS handshake failed"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"{prefix}: the server's certificate is not trusted ({exc.verify_message}; "
                "give the CA that signed it)")
    reason = getattr(exc, "reason", None)
    if reason in _NOT_TLS:
        return f"{prefix}: {exc} (the server does not speak TLS on this port?)"
    if isinstance(reason, str) and "CERTIFICATE_REQUIRED" in reason:
        return f"{prefix}: {exc} (the server wants a client certificate)"
    why = str(exc) if exc is not None and str(exc) else "the server closed the connection"
    return (f"{prefix}: {why} (is the server's port TLS, and does it want a client "
            "certificate?)")


@dataclass(frozen=True, slots=True)
class Login:
    """The credentials sent by the `auth` call on every new connection."""

    user: str
    password: str = field(repr=False)

    def params(self) -> list[str]:
        return [self.user, self.password]


def login(user: str | None, password: str | None) -> Login | None:
    if user is None and password is None:
        return None
    if user is None or password is None:
        raise ValueError("give both user= and password=, or neither")
    if not isinstance(user, str) or not isinstance(password, str):
        raise TypeError("user and password must be strings")
    if not user:
        raise ValueError("user must not be empty")
    return Login(user, password)
