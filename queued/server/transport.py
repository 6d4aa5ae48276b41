"""How a connection's task reads and writes its socket: two calls (`Transport`).

`SocketTransport` calls the kernel directly on the non-blocking socket and enters the
event loop only when the kernel says the call would block (trio's own socket methods
yield to the scheduler on every call, ready or not: a third of a small request's cost).
So that a connection that always has data ready cannot starve the others, it yields once
every `YIELD_EVERY` calls that did not block. It turns a peer that is gone into b""
(receive) or `trio.BrokenResourceError` (send). The reactor's transport (sends through
the reactor, TLS decrypted) builds on it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Protocol, TypeVar

import trio

#: Calls that did not block, after which a transport yields to the scheduler once.
YIELD_EVERY = 8

#: errno values of a peer that went away (or a socket closed under us).
_GONE = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT,
                   errno.EBADF, errno.ESHUTDOWN, errno.ECONNABORTED})
_A = TypeVar("_A")
_R = TypeVar("_R")


def _read_into(fd: int, buffer: memoryview) -> int:
    return os.readv(fd, (buffer,))


class Transport(Protocol):
    async def receive(self, max_bytes: int) -> bytes | bytearray:
        """Up to `max_bytes` (the codecs take bytes or bytearray); b"" once the peer ended
        its side or is gone."""

    async def send(self, data: bytes) -> None:
        """All of `data`; raises trio.BrokenResourceError if the peer is gone."""


class SocketTransport:
    """A connected TCP socket, called directly (see the module docstring).

    The socket stays the stream's: the listener closes it, which wakes a wait here
    with ClosedResourceError (taken as the peer gone).
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.socket = stream.socket
        self.fd = stream.socket.fileno()
        self._ready = 0  # calls in a row that did not block
        #: the last read was short: the socket is most likely empty, so the next read
        #: waits for it first (a read that fails with EAGAIN costs a syscall and an
        #: exception, about a tenth of a small request)
        self._drained = False

    async def _checkpoint_every_nth_call(self) -> None:
        """Before a call: every YIELD_EVERY-th call in a row that did not block yields
        first (so a cancellation never falls between a read and its caller)."""
        self._ready += 1
        if self._ready >= YIELD_EVERY:
            self._ready = 0
            await trio.lowlevel.checkpoint()

    async def receive(self, max_bytes: int) -> bytes | bytearray:
        data = await self._read(os.read, max_bytes, b"")
        self._drained = len(data) < max_bytes
        return data

    async def receive_into(self, buffer: memoryview) -> int:
        """Like `receive`, into `buffer` (no allocation): the count, 0 once the peer is gone."""
        n = await self._read(_read_into, buffer, 0)
        self._drained = n < len(buffer)
        return n

    async def _read(self, read: Callable[[int, _A], _R], arg: _A, gone: _R) -> _R:
        """`read(fd, arg)` once the socket is readable; `gone` once the peer is."""
        fd = self.fd
        if self._drained:
            self._ready = 0
            try:
                await trio.lowlevel.wait_readable(fd)
            except trio.ClosedResourceError:
                return gone
        else:
            await self._checkpoint_every_nth_call()
        while True:
            try:
                return read(fd, arg)
            except BlockingIOError:
                self._ready = 0
                try:
                    await trio.lowlevel.wait_readable(fd)
                except trio.ClosedResourceError:
                    return gone
            except OSError as exc:
                if exc.errno in _GONE:
                    return gone
                raise

    async def send(self, data: bytes) -> None:
        fd = self.fd
        await self._checkpoint_every_nth_call()
        view = memoryview(data)
        while view:
            try:
                sent = os.write(fd, view)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                if exc.errno in _GONE:
                    raise trio.BrokenResourceError(f"socket gone: {exc}") from exc
                raise
            view = view[sent:]
            if view:
                self._ready = 0
                try:
                    await trio.lowlevel.wait_writable(fd)
                except trio.ClosedResourceError as exc:
                    raise trio.BrokenResourceError("socket closed") from exc


def peer_name(stream: trio.SocketStream) -> str:
    """"host:port" of the peer, for log lines ("?" once it is gone)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


