"""TLS and credentials for both clients: the `tls=` and `user=`/`password=` arguments checked
and turned into what io_trio / io_sync need, and what a failed handshake means.

Owns no socket: the I/O modules wrap their own streams with the context made here. Never
puts a password into a message, a repr or a log.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import TypeAlias

#: `tls=`: None or False = plaintext; True = verify the server with the system's CAs;
#: an `ssl.SSLContext` = as given (your CA, a client certificate for mutual TLS, ...).
TlsOption: TypeAlias = bool | ssl.SSLContext | None


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
