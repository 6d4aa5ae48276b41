"""Decrypting what a TLS object (ssl.SSLObject over memory BIOs) has buffered: the loop the
server's and the clients' TlsChannel share. No I/O: the caller feeds the
ciphertext and sends what the object owes."""

from __future__ import annotations

import ssl
from typing import Any


def read_records(tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 view: memoryview) -> tuple[int, bool, ssl.SSLError | None]:
    """Decrypt into `view` while ciphertext or plaintext is buffered (asking, not waiting
    for SSLWantReadError: raising it costs more than asking). Returns the bytes decrypted,
    whether the session ended (close_notify, or the stream's end), and the error if the
    peer's bytes are not TLS (or not its); what came before the error is counted."""
    n, limit = 0, len(view)
    # With a buffer, read returns a count (typeshed says bytes: compiled, a call typed so
    # would have its result checked as one).
    read: Any = tls.read
    while n < limit and (incoming.pending or tls.pending()):
        try:
            got: int = read(limit - n, view[n:])
        except ssl.SSLWantReadError:  # the rest of a record is on its way
            break
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return n, True, None
        except ssl.SSLError as exc:
            # (without its traceback: the frames in it hold a slice of `view`, and the
            # caller's buffer could not be resized while the error lives)
            return n, True, exc.with_traceback(None)
        if not got:  # close_notify
            return n, True, None
        n += got
    return n, False, None
