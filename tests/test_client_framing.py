"""A client connection's protocol side (queued.client.framing), pure: request frames with
fresh msgids, replies read in any chunking, an error notification
raised as its exception, bytes that are not replies, the server's close, the reasons
given for a connection that ends before any reply (a TLS port, a client certificate), and
which error replies close the connection. With real sockets: test_client.py."""

from __future__ import annotations

import msgpack
import pytest

from queued.client.common import BadResponse, ConnectionFailed, ShuttingDown
from queued.client.framing import ClientConnection, closes
from queued.wire.rpc_protocol import MAX_MSGID, ErrorCode, Response


def conn(*, tls: bool = False) -> ClientConnection:
    return ClientConnection("h:1", 1 << 20, 1000, tls=tls)


def test_requests_carry_fresh_msgids() -> None:
    c = conn()
    msgid, frame = c.request("put", ["q", [b"x"]])
    assert msgid == 1 and msgpack.unpackb(frame) == [0, 1, "put", ["q", [b"x"]]]
    assert [c.request("get", ["q"])[0] for _ in range(3)] == [2, 3, 4]
    assert all(0 < c.request("peek", ["q"])[0] <= MAX_MSGID for _ in range(100))


def test_replies_in_any_chunking_and_an_error_notification() -> None:
    data = msgpack.packb([1, 1, None, 3]) + msgpack.packb([1, 2, [4, "no such"], None])
    c = conn()
    got = []
    for i in range(len(data)):  # one byte at a time
        c.receive_data(data[i:i + 1])
        while (reply := c.next_reply()) is not None:
            got.append(reply)
    assert got == [Response(1, None, 3), Response(2, [4, "no such"], None)] and c.answered
    c = conn()
    c.receive_data(data)  # whole
    assert c.next_reply() == Response(1, None, 3)
    assert c.next_reply() == Response(2, [4, "no such"], None)
    assert c.next_reply() is None  # until more bytes come
    c.receive_data(msgpack.packb([2, "error", [[int(ErrorCode.SHUTTING_DOWN), "bye"]]]))
    with pytest.raises(ShuttingDown):
        c.next_reply()


def test_a_request_from_the_server_or_garbage_is_a_bad_response() -> None:
    c = conn()
    c.receive_data(msgpack.packb([0, 5, "get", ["q"]]))
    with pytest.raises(BadResponse, match="the server sent a request"):
        c.next_reply()
    c = conn()
    c.receive_data(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(BadResponse):
        c.next_reply()


def test_a_close_before_any_reply_says_what_is_likely_wrong() -> None:
    plain = conn()
    plain.receive_data(b"")
    with pytest.raises(ConnectionFailed, match="is the server's port TLS") as info:
        plain.next_reply()
    assert not info.value.refused
    tls = conn(tls=True)
    failed = tls.lost("h:1: closed")
    assert "client certificate" in str(failed) and failed.refused  # (not sent again)
    answered = conn(tls=True)
    answered.receive_data(msgpack.packb([1, 1, None, 0]))
    assert answered.next_reply() is not None
    later = answered.lost("h:1: closed")
    assert str(later) == "h:1: closed" and not later.refused
    assert "is the server's port TLS" in str(conn().no_reply("get", 2.0))


def test_the_first_reason_a_connection_ended_stays() -> None:
    c = conn()
    first, second = ConnectionFailed("one"), ConnectionFailed("two")
    c.end(first)
    c.end(second)
    assert c.closed and c.error is first


@pytest.mark.parametrize("code", list(ErrorCode))
def test_which_error_replies_close_the_connection(code: ErrorCode) -> None:
    # the codes the protocol says close the connection (queued.wire.rpc_protocol.ErrorCode)
    closing = {ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.UNAUTHENTICATED,
               ErrorCode.AUTH_FAILED}
    assert closes(Response(1, [int(code), "why"], None)) is (code in closing)
    assert not closes(Response(1, None, 0))
