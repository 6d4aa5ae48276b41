"""The MessagePack-RPC port's table of commands (queued.wire.rpc_commands), pure:
notifications, flags on puts and gets, and what a get asks of the broker. All three
tables against the protocol-neutral commands: test_wire_commands.py."""

from __future__ import annotations

from wire_util import LIMITS, decode_all

from queued.errors import (
    ProtocolError,
)
from queued.reader.state import Item
from queued.wire import commands as c
from queued.wire import rpc_commands as rpcc
from queued.wire import rpc_protocol as rp


def test_rpc_notifications_get_no_reply_and_refused_ones_are_errors_without_one() -> None:
    codec = rpcc.RpcCodec(LIMITS)
    put, refused, bad = decode_all(codec, rp.encode_notification("put", ["q", [b"x"]])
                                   + rp.encode_notification("get", ["q", 1])
                                   + rp.encode_notification("put", ["q"]))
    assert isinstance(put, c.Request) and put.context is None
    assert codec.encode(put, c.Stored(1)) == b""
    assert isinstance(refused, ProtocolError) and refused.reply == b"" and not refused.close
    assert isinstance(bad, ProtocolError) and bad.reply == b"" and not bad.close


def test_rpc_put_flags_and_get_items_with_their_flags_only_when_asked() -> None:
    codec = rpcc.RpcCodec(LIMITS)
    put, plain, flagged = decode_all(codec, rp.encode_request(1, "put", ["q", [b"a"], 0, 16])
                                     + rp.encode_request(2, "get", ["q", 5])
                                     + rp.encode_request(3, "get", ["q", 5, 0, 0, True]))
    assert isinstance(put, c.Request) and put.command == c.Put("q", [b"a"], flags=16)
    items = c.Items([Item(7, b"a", 0, flags=16), Item(8, b"b", 0)])
    assert isinstance(plain, c.Request) and isinstance(flagged, c.Request)
    assert plain.command == flagged.command  # the same get; only its reply differs
    assert codec.encode(plain, items) == rp.encode_response(2, [[7, b"a"], [8, b"b"]])
    assert codec.encode(flagged, items) == rp.encode_response(3, [[7, b"a", 16], [8, b"b", 0]])
    assert codec.encode(flagged, c.Failure(c.ErrorKind.BUSY, "busy")) == rp.encode_error(
        3, rp.ErrorCode.BUSY, "busy")


def test_rpc_get_is_open_with_auto_abort_and_capped_to_half_a_frame() -> None:
    codec = rpcc.RpcCodec(LIMITS)
    (get,) = decode_all(codec, rp.encode_request(4, "get", ["q+r", 10, 100, 5000]))
    assert isinstance(get, c.Request) and get.context == 4
    assert get.command == c.Get("q", "r", 10, 100, open=True, open_timeout_ms=5000,
                                max_bytes=LIMITS.max_frame // 2)
    assert codec.encode(get, c.Failure(c.ErrorKind.BUSY, "busy")) == rp.encode_error(
        4, rp.ErrorCode.BUSY, "busy")
