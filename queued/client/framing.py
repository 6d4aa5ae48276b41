"""A client connection's protocol side, without I/O: request framing, reply reading, its end.

Pure (no sockets, no trio, no clock): the blocking connection (io_sync) and the trio one
(io_trio) extend `ClientConnection` and only move its bytes, so both frame requests, read
replies and decide that a connection is over in one way.
"""

from __future__ import annotations

import itertools
from typing import Any, Final

from queued.client.common import (
    CLOSING,
    BadResponse,
    ClientError,
    ConnectionFailed,
    Timeout,
    call_error,
)
from queued.wire.rpc_protocol import (
    MAX_MSGID,
    NEED_DATA,
    ConnectionClosed,
    Notification,
    Response,
    RpcError,
    RpcParser,
    encode_request,
)

#: Bytes asked of the socket per receive.
RECV: Final = 256 * 1024
#: Connection serials, unique in the process: Item.connection names the one holding a read.
SERIALS: Final = itertools.count(1)
_TLS_PORT_HINT: Final = " (before any reply: is the server's port TLS? then give tls=)"


class ClientConnection:
    """One connection's requests and replies; the I/O subclass calls end() when it is over."""

    def __init__(self, address: str, max_frame: int, max_batch: int, *, tls: bool) -> None:
        self.address = address
        self.tls = tls
        self.answered = False  # a reply came: the server speaks our protocol on this port
        self.serial = next(SERIALS)
        self.error: ClientError | None = None  # why the connection is over; None while open
        # Maps are stats tables (one entry per queue), so they get the batch cap, not 1024.
        self._parser = RpcParser(max_frame=max_frame, max_batch=max_batch,
                                 max_map_len=max_batch)
        self._msgid = 0

    @property
    def closed(self) -> bool:
        return self.error is not None

    def end(self, error: ClientError) -> None:
        """Remember why the connection is over; the first reason stays."""
        if self.error is None:
            self.error = error

    def lost(self, message: str) -> ConnectionFailed:
        """ConnectionFailed(message) for a connection that broke or was closed; when it
        ends before any reply, the likely reason is said too (under TLS 1.3 a server
        refuses a missing client certificate only after the handshake)."""
        if not self.answered:
            message += (" (before any reply: does the server want a client certificate?)"
                        if self.tls else _TLS_PORT_HINT)
        # A TLS 1.3 server refuses a missing client certificate after the handshake (an
        # alert, or just its end of the stream): a TLS connection that ends before any
        # reply counts as refused (so an idempotent put is not sent there again).
        return ConnectionFailed(message, self.address, refused=self.tls and not self.answered)

    def no_reply(self, method: str, wait: float) -> Timeout:
        """The Timeout of a call not answered within `wait` seconds (a TLS port waits for
        a handshake in silence, so a plaintext connection never answered says so)."""
        hint = "" if self.tls or self.answered else _TLS_PORT_HINT
        return Timeout(f"{self.address}: no reply to {method} within {wait:.3g} s{hint}",
                       self.address)

    def request(self, method: str, params: list[Any]) -> tuple[int, bytes]:
        """A fresh msgid, and the frame calling `method` with it."""
        self._msgid = self._msgid % MAX_MSGID + 1
        return self._msgid, encode_request(self._msgid, method, params)

    def receive_data(self, data: bytes | bytearray) -> None:
        """Bytes from the server; b"" when it closed the connection."""
        self._parser.receive_data(data)

    def next_reply(self) -> Response | None:
        """The next reply received, or None until more bytes come.

        Raises what ends the connection: ConnectionFailed when the server closed it,
        BadResponse for bytes that are not replies, the mapped RpcCallError for an error
        notification (the server's answer to a frame it could not read).
        """
        while True:
            try:
                event = self._parser.next_event()
            except RpcError as exc:
                raise BadResponse(f"{self.address}: {exc}") from None
            if event is NEED_DATA:
                return None
            if isinstance(event, ConnectionClosed):
                raise self.lost(f"{self.address}: the server closed the connection")
            if isinstance(event, Response):
                self.answered = True
                return event
            if not isinstance(event, Notification):
                raise BadResponse(f"{self.address}: the server sent a request")
            if event.method == "error" and event.params:
                raise call_error(event.params[0], self.address)


def closes(response: Response) -> bool:
    """Whether the server closes the connection after this reply."""
    return response.error is not None and call_error(response.error, "").code in CLOSING
