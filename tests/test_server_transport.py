"""How a session reads and writes its connection (queued.server.transport): the socket
transport calls the kernel directly and yields only every YIELD_EVERY calls that did not
block, so a connection whose data is always ready leaves room for the others."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from queued.server.transport import YIELD_EVERY, SocketTransport


async def test_the_socket_transport_yields_while_data_is_always_ready() -> None:
    """The socket transport enters the event loop only when a call would block, and
    yields every YIELD_EVERY calls that did not: a connection whose data is always
    ready leaves room for the others."""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x" * 4096)
        transport = SocketTransport(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
        ran = 0

        async def other() -> None:
            nonlocal ran
            while True:
                ran += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            got = b"".join([await transport.receive(16) for _ in range(16 * YIELD_EVERY)])
            assert got == b"x" * 16 * 16 * YIELD_EVERY  # every call found data ready
            assert ran >= 15  # yet the other task ran about once every YIELD_EVERY calls
            for _ in range(16 * YIELD_EVERY):
                await transport.send(b"y" * 16)
            assert ran >= 31
            nursery.cancel_scope.cancel()
        assert b.recv(1 << 16) == b"y" * 16 * 16 * YIELD_EVERY
        b.close()
        assert await transport.receive(4096) == b"x" * (4096 - 16 * 16 * YIELD_EVERY)
        assert await transport.receive(100) == b""  # the peer is gone: b""
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):  # the first send after a reset may still succeed
                await transport.send(b"z" * 1024)
