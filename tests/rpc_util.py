"""A MessagePack-RPC client written from the spec alone (msgpack + a trio socket, not
`queued.client`): what any msgpack-rpc client in another language sends and sees. For
the interop tests of the RPC port (test_rpc_server) and the exactly-once puts
(test_producers); server_util.Rpc is the smaller one-call-at-a-time kind."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import trio
from server_util import WAIT


class Rpc:
    """A minimal msgpack-rpc client: send requests, read responses by msgid."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0
        self.early: dict[int, list[Any]] = {}  # responses read while looking for another
        self.notifications: list[list[Any]] = []

    @classmethod
    async def open(cls, port: int) -> Rpc:
        with trio.fail_after(WAIT):
            return cls(await trio.open_tcp_stream("127.0.0.1", port))

    def request(self, method: str, *params: Any) -> tuple[int, bytes]:
        self.msgid += 1
        return self.msgid, msgpack.packb([0, self.msgid, method, list(params)],
                                         use_bin_type=True)

    async def send_request(self, method: str, *params: Any) -> int:
        """Send one request without waiting for its reply: its msgid (for `response`)."""
        msgid, data = self.request(method, *params)
        await self.send(data)
        return msgid

    async def send_pipelined(self, requests: Iterable[Sequence[Any]]) -> list[int]:
        """Send requests, each (method, *params), in one write: their msgids, in order."""
        ids, frames = [], []
        for method, *params in requests:
            msgid, frame = self.request(method, *params)
            ids.append(msgid)
            frames.append(frame)
        await self.send(b"".join(frames))
        return ids

    async def send(self, data: bytes) -> None:
        with trio.fail_after(WAIT):
            await self.stream.send_all(data)

    async def message(self, timeout: float = WAIT) -> list[Any]:
        """The next message off the wire (EOFError when the server closed)."""
        with trio.fail_after(timeout):
            while True:
                for msg in self.unpacker:
                    return msg  # type: ignore[no-any-return]
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("closed by the server")
                self.unpacker.feed(data)

    async def response(self, msgid: int, timeout: float = WAIT) -> list[Any]:
        while msgid not in self.early:
            msg = await self.message(timeout)
            if msg[0] == 2:
                self.notifications.append(msg)
            else:
                assert msg[0] == 1 and len(msg) == 4, msg
                self.early[msg[1]] = msg
        return self.early.pop(msgid)

    async def call(self, method: str, *params: Any) -> Any:
        """The result; AssertionError with the error when the server answered one."""
        _, _, error, result = await self.response(await self.send_request(method, *params))
        assert error is None, error
        return result

    async def error(self, method: str, *params: Any) -> tuple[int, str]:
        _, _, error, result = await self.response(await self.send_request(method, *params))
        assert error is not None and result is None, (error, result)
        code, message = error
        assert isinstance(message, str) and message
        return code, message

    async def expect_closed(self) -> None:
        with trio.fail_after(WAIT):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return
                if not data:
                    return
                self.unpacker.feed(data)

    async def aclose(self) -> None:
        with trio.move_on_after(WAIT):
            await self.stream.aclose()
