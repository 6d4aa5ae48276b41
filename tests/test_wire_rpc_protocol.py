"""The MessagePack-RPC parser and calls: round trips in any chunking, caps, garbage, params."""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterable
from typing import Any

import msgpack
import pytest
import wire_util
from hypothesis import example, given, settings
from hypothesis import strategies as st

from queued.errors import QueuedError
from queued.wire import rpc_protocol as rp
from queued.wire.rpc_protocol import (
    DEFAULT_MAX_BATCH,
    MAX_MAP_LEN,
    MAX_MS,
    MAX_MSGID,
    METHODS,
    NEED_DATA,
    Abort,
    Auth,
    Browse,
    Confirm,
    ConnectionClosed,
    Delete,
    ErrorCode,
    Extend,
    Flush,
    FlushAll,
    Get,
    Move,
    Notification,
    Pause,
    Peek,
    Put,
    Reject,
    Request,
    Response,
    RpcError,
    RpcParser,
    Stats,
    Version,
    encode_error,
    encode_notification,
    encode_request,
    encode_response,
    parse_call,
)

Message = Request | Notification | Response
FAST = settings(max_examples=60, deadline=None)
MiB = 1024 * 1024

# -- helpers ----------------------------------------------------------------------------------


def packb(obj: Any) -> bytes:
    """What a foreign client sends: plain msgpack with the bin type."""
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def feed(parser: RpcParser, chunks: Iterable[bytes]) -> list[Message]:
    """Feeds each chunk and drains the parser to NEED_DATA after it."""
    out: list[Message] = []
    for chunk in chunks:
        assert chunk, "b'' would mean end of stream"
        parser.receive_data(chunk)
        while (event := parser.next_event()) is not NEED_DATA:
            assert isinstance(event, Request | Notification | Response), event
            out.append(event)
    return out


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    bounds = zip([0, *points], [*points, len(data)], strict=True)
    return [data[a:b] for a, b in bounds if a < b]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def every_chunking(data: bytes) -> list[list[bytes]]:
    """Whole, one byte at a time, and fixed 7-byte steps (deterministic tests)."""
    return [[data], bytewise(data), [data[i : i + 7] for i in range(0, len(data), 7)]]


@st.composite
def chunkings(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """Whole, one byte at a time, or cut at random points."""
    if not data:
        return []
    mode = draw(st.sampled_from(["whole", "bytes", "random"]))
    if mode == "whole":
        return [data]
    if mode == "bytes":
        return bytewise(data)
    return split(data, draw(st.lists(st.integers(1, len(data) - 1), max_size=12))
                 if len(data) > 1 else [])


def error_of(parser: RpcParser) -> RpcError:
    with pytest.raises(RpcError) as info:
        parser.next_event()
    return info.value


def assert_reply_shape(err: RpcError) -> None:
    """A reply is a response to err.msgid, or an `error` notification when it is unknown."""
    reply = unpackb(err.reply)
    if err.msgid is None:
        assert reply == [2, "error", [[int(err.code), err.message]]]
    else:
        assert reply == [1, err.msgid, [int(err.code), err.message], None]
    assert isinstance(err.message, str) and err.message


def frame_of_size(size: int, msgid: int = 5) -> bytes:
    """A put request whose encoding is exactly `size` bytes."""
    for n in range(max(0, size - 40), size + 1):
        for extra in ([], [b""], [b"", b""]):
            frame = encode_request(msgid, "put", ["q", [b"x" * n, *extra]])
            if len(frame) == size:
                return frame
    raise AssertionError(f"no frame of {size} bytes")


# -- strategies -------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=12,
)
msgids = st.integers(0, MAX_MSGID)
methods = st.text(max_size=16)
param_lists = st.lists(values, max_size=4)


@st.composite
def encoded_messages(draw: st.DrawFn) -> tuple[bytes, Message]:
    """One frame, encoded by our encoders or by plain msgpack, and what it must parse to."""
    kind = draw(st.sampled_from(
        ["request", "notification", "response", "error", "foreign response"]))
    foreign = draw(st.booleans())
    if kind == "request":
        msgid, method, params = draw(msgids), draw(methods), draw(param_lists)
        frame = (packb([0, msgid, method, params]) if foreign
                 else encode_request(msgid, method, params))
        return frame, Request(msgid, method, params)
    if kind == "notification":
        method, params = draw(methods), draw(param_lists)
        frame = packb([2, method, params]) if foreign else encode_notification(method, params)
        return frame, Notification(method, params)
    if kind == "response":
        msgid, result = draw(msgids), draw(values)
        frame = packb([1, msgid, None, result]) if foreign else encode_response(msgid, result)
        return frame, Response(msgid, None, result)
    if kind == "error":
        msgid, code, text = draw(msgids), draw(st.sampled_from(ErrorCode)), draw(st.text())
        frame = (packb([1, msgid, [int(code), text], None]) if foreign
                 else encode_error(msgid, code, text))
        return frame, Response(msgid, [int(code), text], None)
    msgid, error, result = draw(msgids), draw(values), draw(values)
    return packb([1, msgid, error, result]), Response(msgid, error, result)


# -- round trip -------------------------------------------------------------------------------


@FAST
@given(st.data())
def test_any_messages_in_any_chunking_come_out_the_same_in_order(data: st.DataObject) -> None:
    frames = data.draw(st.lists(encoded_messages(), max_size=8))
    stream = b"".join(f for f, _ in frames)
    # The cap exactly at the largest frame also exercises feeding no more than the cap allows.
    cap = data.draw(st.sampled_from(
        [rp.DEFAULT_MAX_FRAME, max([64, *(len(f) for f, _ in frames)])]))
    parser = RpcParser(max_frame=cap)
    assert feed(parser, data.draw(chunkings(stream))) == [m for _, m in frames]
    assert parser.next_event() is NEED_DATA
    assert parser.frames == len(frames)
    assert parser.buffered_bytes == 0
    parser.receive_data(b"")
    assert parser.next_event() == ConnectionClosed(0)
    assert parser.next_event() == ConnectionClosed(0)


@FAST
@given(st.data())
def test_end_of_stream_inside_a_frame_reports_its_bytes(data: st.DataObject) -> None:
    frames = data.draw(st.lists(encoded_messages(), max_size=4))
    last, _ = data.draw(encoded_messages())
    partial = last[: data.draw(st.integers(1, len(last) - 1))]
    stream = b"".join(f for f, _ in frames) + partial
    parser = RpcParser()
    assert feed(parser, data.draw(chunkings(stream))) == [m for _, m in frames]
    assert parser.buffered_bytes == len(partial)
    parser.receive_data(b"")
    assert parser.next_event() == ConnectionClosed(len(partial))


def test_end_of_stream_before_anything() -> None:
    parser = RpcParser()
    assert parser.next_event() is NEED_DATA
    parser.receive_data(b"")
    assert parser.next_event() == ConnectionClosed(0)


def test_messages_are_returned_before_the_data_runs_out() -> None:
    stream = (encode_request(1, "get", ["q", 1]) + encode_notification("hi", [1])
              + encode_response(2, {"a": b"b"}) + encode_error(3, ErrorCode.BUSY, "busy"))
    expected = [
        Request(1, "get", ["q", 1]),
        Notification("hi", [1]),
        Response(2, None, {"a": b"b"}),
        Response(3, [12, "busy"], None),
    ]
    for chunks in every_chunking(stream):
        assert feed(RpcParser(), chunks) == expected


def test_encoders_follow_the_spec() -> None:
    assert unpackb(encode_request(9, "put", ["q", [b"x"]])) == [0, 9, "put", ["q", [b"x"]]]
    assert unpackb(encode_notification("error", [[1, "m"]])) == [2, "error", [[1, "m"]]]
    assert unpackb(encode_response(9, [1, 2])) == [1, 9, None, [1, 2]]
    assert unpackb(encode_error(9, ErrorCode.TOO_LARGE, "big")) == [1, 9, [7, "big"], None]
    # bytes stay bin, str stays str: a foreign client can tell them apart
    assert encode_request(1, "m", [b"a", "a"]).endswith(b"\x92\xc4\x01a\xa1a")


def test_old_clients_without_the_bin_type_can_still_put_text() -> None:
    frame = msgpack.packb([0, 4, "put", ["q", [b"hello"]]], use_bin_type=False)
    [request] = feed(RpcParser(), [frame])
    assert isinstance(request, Request)
    assert parse_call(request) == Put(4, "q", [b"hello"], 0)


def test_constructor_refuses_silly_caps() -> None:
    with pytest.raises(ValueError):
        RpcParser(max_frame=63)
    with pytest.raises(ValueError):
        RpcParser(max_batch=0)
    RpcParser(max_frame=64, max_batch=1)


# -- garbage ----------------------------------------------------------------------------------


def run_garbage(parser: RpcParser, chunks: Iterable[bytes]) -> RpcError | None:
    """Feeds garbage (wire_util.run): only messages or RpcErrors of a shape a client can
    read may come out. Returns the closing error, if one ended the stream."""
    out = wire_util.run(parser, chunks, raw_errors=True)
    for event in out:
        if not isinstance(event, RpcError):
            assert isinstance(event, Request | Notification | Response), event
            continue
        assert isinstance(event, QueuedError)
        assert event.code in ErrorCode
        assert_reply_shape(event)
        if not event.close:
            # A request that is whole but not [0, msgid, str, list]: the stream goes on.
            assert event.code is ErrorCode.MALFORMED and event.msgid is not None
    last = out[-1] if out else None
    return last if isinstance(last, RpcError) and last.close else None


def assert_sticky(parser: RpcParser, err: RpcError) -> None:
    for more in (encode_request(1, "version", []), b""):
        parser.receive_data(more)
        with pytest.raises(RpcError) as again:
            parser.next_event()
        # the same failure (a new exception each time: see RpcParser._failed)
        assert (str(again.value), again.value.reply) == (str(err), err.reply)
        assert again.value.close


@FAST
@given(st.binary(max_size=300), st.data())
@example(b"\xc1", None)  # the one byte msgpack never uses
@example(b"\x91" * 3000, None)  # nested deeper than msgpack's stack
@example(b"\x81\x91\x01\x02", None)  # a map keyed by a list: unhashable
@example(b"\xa2\xff\xfe", None)  # a str that is not UTF-8
@example(b"\xd7\xff" + bytes(8), None)  # a timestamp ext
@example(b"\xd6\xff" + bytes(3), None)  # an incomplete timestamp
@example(b"\xc7\x00\x05", None)  # an empty ext
@example(b"\xc7\x00\xff", None)  # an empty timestamp ext
@example(b"\xcb\x7f\xf8" + bytes(6), None)  # a NaN
def test_garbage_gives_only_rpc_errors_and_they_are_sticky(
        garbage: bytes, data: st.DataObject | None) -> None:
    cap = data.draw(st.sampled_from([64, 100, 1024])) if data else 64
    batch = data.draw(st.sampled_from([1, 4, 10])) if data else 4
    chunks = data.draw(chunkings(garbage)) if data else [garbage]
    parser = RpcParser(max_frame=cap, max_batch=batch)
    err = run_garbage(parser, chunks)
    if err is not None:
        assert_sticky(parser, err)
    else:
        parser.receive_data(b"")
        closed = parser.next_event()
        assert isinstance(closed, ConnectionClosed)
        assert 0 <= closed.unparsed <= len(garbage)


@FAST
@given(st.lists(encoded_messages(), min_size=1, max_size=4), st.data())
def test_damaged_valid_streams_give_only_rpc_errors(
        frames: list[tuple[bytes, Message]], data: st.DataObject) -> None:
    stream = bytearray(b"".join(f for f, _ in frames))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(stream) - 1))
        action = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if action == "flip":
            stream[at] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=6))
        elif len(stream) > 1:
            del stream[at]
    parser = RpcParser(max_frame=256, max_batch=8)
    err = run_garbage(parser, data.draw(chunkings(bytes(stream))))
    if err is not None:
        assert_sticky(parser, err)


@FAST
@given(st.lists(values, min_size=1, max_size=5))
def test_any_msgpack_value_is_a_message_or_an_rpc_error(objs: list[Any]) -> None:
    parser = RpcParser(max_batch=8)
    err = run_garbage(parser, [b"".join(packb(o) for o in objs)])
    if err is not None:
        assert_sticky(parser, err)


def test_trailing_garbage_after_good_frames() -> None:
    good = encode_request(1, "version", []) + encode_notification("n", [])
    for chunks in every_chunking(good + b"\xc1garbage"):
        parser = RpcParser()
        events: list[object] = []
        with pytest.raises(RpcError) as info:
            for chunk in chunks:
                parser.receive_data(chunk)
                while (event := parser.next_event()) is not NEED_DATA:
                    events.append(event)
        assert events == [Request(1, "version", []), Notification("n", [])]
        assert info.value.code is ErrorCode.MALFORMED and info.value.close
        assert_sticky(parser, info.value)


def test_a_str_that_is_not_utf8_closes_as_malformed() -> None:
    # An old-spec client packing binary items as raw str: not text, so not MessagePack-RPC.
    frame = msgpack.packb([0, 4, "put", ["q", [b"\xff\xfe"]]], use_bin_type=False)
    parser = RpcParser()
    parser.receive_data(frame)
    err = error_of(parser)
    assert (err.code, err.close) == (ErrorCode.MALFORMED, True)


# -- message shape ----------------------------------------------------------------------------

CLOSING_SHAPES = [
    pytest.param(5, id="int"),
    pytest.param("text", id="str"),
    pytest.param(b"bin", id="bin"),
    pytest.param(None, id="nil"),
    pytest.param({"a": 1}, id="map"),
    pytest.param([], id="empty array"),
    pytest.param([0], id="type only"),
    pytest.param([0, 1, "m"], id="request of 3"),
    pytest.param([0, 1, "m", [], 5], id="request of 5"),
    pytest.param([1, 1, None], id="response of 3"),
    pytest.param([1, 1, None, 2, 3], id="response of 5"),
    pytest.param([2, "m"], id="notification of 2"),
    pytest.param([2, "m", [], 1], id="notification of 4"),
    pytest.param([3, 1, "m", []], id="unknown type 3"),
    pytest.param([-1, 1, "m", []], id="negative type"),
    pytest.param(["0", 1, "m", []], id="str type"),
    pytest.param([True, 1, "m", []], id="bool type"),
    pytest.param([0.0, 1, "m", []], id="float type"),
    pytest.param([None, 1, "m", []], id="nil type"),
    pytest.param([0, "1", "m", []], id="str msgid"),
    pytest.param([0, 1.0, "m", []], id="float msgid"),
    pytest.param([0, True, "m", []], id="bool msgid"),
    pytest.param([0, None, "m", []], id="nil msgid"),
    pytest.param([0, b"\x01", "m", []], id="bin msgid"),
    pytest.param([0, -1, "m", []], id="negative msgid"),
    pytest.param([0, MAX_MSGID + 1, "m", []], id="msgid over 2**32-1"),
    pytest.param([0, 2**64 - 1, "m", []], id="msgid 2**64-1"),
    pytest.param([0, -(2**63), "m", []], id="msgid -2**63"),
    pytest.param([1, "1", None, None], id="response str msgid"),
    pytest.param([1, None, None, None], id="response nil msgid"),
    pytest.param([1, 1.5, None, None], id="response float msgid"),
    pytest.param([2, 1, []], id="notification int method"),
    pytest.param([2, b"m", []], id="notification bin method"),
    pytest.param([2, "m", {}], id="notification map params"),
    pytest.param([2, "m", None], id="notification nil params"),
]


@pytest.mark.parametrize("obj", CLOSING_SHAPES)
def test_not_a_message_is_malformed_and_closes(obj: Any) -> None:
    frame = packb(obj)
    for chunks in every_chunking(frame):
        parser = RpcParser()
        with pytest.raises(RpcError) as info:
            feed(parser, chunks)
        err = info.value
        assert (err.code, err.close) == (ErrorCode.MALFORMED, True)
        assert_reply_shape(err)
        assert_sticky(parser, err)


@pytest.mark.parametrize("obj", [[0, -1, "m", []], [0, MAX_MSGID + 1, "m", []], [3, 7, "m", []]])
def test_a_malformed_frame_with_no_valid_msgid_replies_with_a_notification(obj: Any) -> None:
    parser = RpcParser()
    parser.receive_data(packb(obj))
    err = error_of(parser)
    assert err.msgid is None
    assert unpackb(err.reply) == [2, "error", [[1, err.message]]]


def test_msgid_bounds_are_accepted() -> None:
    stream = encode_request(0, "m", []) + encode_request(MAX_MSGID, "m", [])
    assert feed(RpcParser(), [stream]) == [Request(0, "m", []), Request(MAX_MSGID, "m", [])]


@pytest.mark.parametrize("msgid", [-1, MAX_MSGID + 1])
def test_a_response_msgid_outside_32_bits_is_malformed(msgid: int) -> None:
    parser = RpcParser()
    parser.receive_data(packb([1, msgid, None, None]))
    err = error_of(parser)
    assert (err.code, err.close) == (ErrorCode.MALFORMED, True)


@pytest.mark.parametrize("obj", [
    pytest.param([0, 5, 1, []], id="int method"),
    pytest.param([0, 5, None, []], id="nil method"),
    pytest.param([0, 5, b"put", []], id="bin method"),
    pytest.param([0, 5, ["put"], []], id="array method"),
    pytest.param([0, 5, "put", {"a": 1}], id="map params"),
    pytest.param([0, 5, "put", "q"], id="str params"),
    pytest.param([0, 5, "put", None], id="nil params"),
    pytest.param([0, 5, "put", 3], id="int params"),
])
def test_a_whole_request_with_a_bad_method_or_params_does_not_close(obj: Any) -> None:
    stream = encode_request(4, "stats", []) + packb(obj) + encode_request(6, "version", [])
    for chunks in every_chunking(stream):
        parser = RpcParser()
        first, err, last = wire_util.run(parser, chunks, raw_errors=True)
        assert first == Request(4, "stats", [])
        assert last == Request(6, "version", [])
        assert isinstance(err, RpcError)
        assert (err.code, err.msgid, err.close) == (ErrorCode.MALFORMED, 5, False)
        assert unpackb(err.reply) == [1, 5, [1, err.message], None]
        assert parser.buffered_bytes == 0


# -- frame cap --------------------------------------------------------------------------------


def test_a_frame_exactly_at_the_cap_is_accepted_and_one_byte_more_is_not() -> None:
    for cap in (64, 1024):
        at = frame_of_size(cap, msgid=11)
        over = frame_of_size(cap + 1, msgid=12)
        for chunks in every_chunking(at + at):
            [a, b] = feed(RpcParser(max_frame=cap), chunks)
            assert a == b and isinstance(a, Request) and a.msgid == 11
        for chunks in every_chunking(over):
            parser = RpcParser(max_frame=cap)
            with pytest.raises(RpcError) as info:
                feed(parser, chunks)
            err = info.value
            assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, 12, True)
            assert unpackb(err.reply) == [1, 12, [7, err.message], None]
            assert_sticky(parser, err)


@FAST
@given(st.data())
def test_an_over_cap_request_first_in_the_stream_is_answered_by_msgid(
        data: st.DataObject) -> None:
    cap = data.draw(st.sampled_from([64, 200, 1000]))
    msgid = data.draw(msgids)
    body = data.draw(st.integers(cap, 3 * cap))
    frame = encode_request(msgid, "put", ["q", [b"x" * body]])
    parser = RpcParser(max_frame=cap)
    with pytest.raises(RpcError) as info:
        feed(parser, data.draw(chunkings(frame)))
    err = info.value
    assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, msgid, True)
    assert unpackb(err.reply) == [1, msgid, [7, err.message], None]


def test_the_cap_error_comes_as_soon_as_the_cap_is_passed() -> None:
    parser = RpcParser(max_frame=100)
    frame = encode_request(3, "put", ["q", [b"x" * 10_000]])
    parser.receive_data(frame[:100])
    assert parser.next_event() is NEED_DATA
    parser.receive_data(frame[100:101])
    err = error_of(parser)
    assert (err.code, err.msgid) == (ErrorCode.TOO_LARGE, 3)


def test_an_over_cap_notification_is_answered_by_an_error_notification() -> None:
    frame = encode_notification("log", [b"x" * 200])
    for chunks in every_chunking(frame):
        parser = RpcParser(max_frame=64)
        with pytest.raises(RpcError) as info:
            feed(parser, chunks)
        err = info.value
        assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, None, True)
        assert unpackb(err.reply) == [2, "error", [[7, err.message]]]


def test_frames_just_under_the_cap_across_many_receive_data_calls() -> None:
    cap = 4096
    frames = [frame_of_size(cap - 1, msgid=i) for i in range(1, 4)]
    stream = b"".join(frames)
    for step in (1, 7, 100, cap - 1, cap + 1):
        parser = RpcParser(max_frame=cap)
        events = feed(parser, [stream[i : i + step] for i in range(0, len(stream), step)])
        assert [e.msgid for e in events if isinstance(e, Request)] == [1, 2, 3]
        assert parser.buffered_bytes == 0


def test_frames_exactly_at_the_cap_back_to_back_in_one_chunk() -> None:
    cap = 256
    frame = frame_of_size(cap, msgid=1)
    parser = RpcParser(max_frame=cap)
    events = feed(parser, [frame * 5])
    assert len(events) == 5
    assert parser.buffered_bytes == 0


FOLLOWERS = [
    pytest.param(lambda big: [encode_request(1, "version", []) + big], id="same chunk"),
    pytest.param(lambda big: [encode_request(1, "version", []) + big[:10], big[10:]],
                 id="header with the previous frame"),
]


@pytest.mark.parametrize("chunks_of", FOLLOWERS)
def test_an_over_cap_request_after_another_frame_is_answered_by_msgid(chunks_of: Any) -> None:
    big = encode_request(7, "put", ["q", [b"x" * 100]])
    parser = RpcParser(max_frame=64)
    events: list[object] = []
    with pytest.raises(RpcError) as info:
        for chunk in chunks_of(big):
            parser.receive_data(chunk)
            while (event := parser.next_event()) is not NEED_DATA:
                events.append(event)
    assert events == [Request(1, "version", [])]
    err = info.value
    assert (err.code, err.close) == (ErrorCode.TOO_LARGE, True)
    assert err.msgid == 7


def test_an_over_cap_reply_never_names_a_msgid_taken_from_the_payload() -> None:
    item = b"\x94\x00\x63" + b"z" * 80  # looks like the start of request 99
    big = encode_request(7, "put", ["q", [item]])
    at = big.index(item)
    parser = RpcParser(max_frame=64)
    assert feed(parser, [encode_request(1, "version", []) + big[:at]]) == [
        Request(1, "version", [])]
    parser.receive_data(big[at:])
    err = error_of(parser)
    assert err.code is ErrorCode.TOO_LARGE
    assert err.msgid in (7, None)


# -- declared sizes: never allocated ----------------------------------------------------------

PUT_HEAD = b"\x94\x00\x05\xa3put\x92\xa1q"  # [0, 5, "put", ["q", ...
HUGE_BIN = b"\xc6\x80\x00\x00\x00"  # bin32 of 2 GiB
HUGE_STR = b"\xdb\x80\x00\x00\x00"  # str32 of 2 GiB
HUGE_ARRAY = b"\xdd\x80\x00\x00\x00"  # array32 of 2**31 elements
HUGE_MAP = b"\xdf\x80\x00\x00\x00"  # map32 of 2**31 pairs


def peak_of(fn: Any) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("head", [HUGE_BIN, HUGE_STR])
@pytest.mark.parametrize("prefix", [b"", PUT_HEAD + b"\x91"], ids=["bare", "in a put"])
def test_a_huge_declared_string_waits_for_data_without_allocating_it(
        head: bytes, prefix: bytes) -> None:
    parser = RpcParser()  # the default 64 MiB cap
    chunk = bytes(64 * 1024)

    def run() -> None:
        parser.receive_data(prefix + head)
        assert parser.next_event() is NEED_DATA
        for _ in range(16):
            parser.receive_data(chunk)
            assert parser.next_event() is NEED_DATA

    assert peak_of(run) < 50 * MiB
    assert parser.buffered_bytes == len(prefix + head) + 16 * len(chunk)


@pytest.mark.parametrize("head", [HUGE_BIN, HUGE_STR])
def test_a_huge_declared_string_is_refused_at_the_cap(head: bytes) -> None:
    cap = 64 * 1024
    parser = RpcParser(max_frame=cap)
    chunk = bytes(4096)

    def run() -> None:
        parser.receive_data(PUT_HEAD + b"\x91" + head)
        with pytest.raises(RpcError) as info:
            for _ in range(cap // len(chunk) + 2):
                parser.receive_data(chunk)
                assert parser.next_event() is NEED_DATA
        err = info.value
        assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, 5, True)
        assert unpackb(err.reply) == [1, 5, [7, err.message], None]

    assert peak_of(run) < 50 * MiB


@pytest.mark.parametrize("head", [HUGE_ARRAY, HUGE_MAP, b"\xdc\xff\xff", b"\xde\xff\xff"],
                         ids=["array32", "map32", "array16", "map16"])
@pytest.mark.parametrize("prefix", [b"", PUT_HEAD], ids=["bare", "in a put"])
def test_a_huge_declared_container_allocates_nothing_and_is_refused_at_the_cap(
        head: bytes, prefix: bytes) -> None:
    # The parser decodes whole frames only: a declared size costs nothing while the
    # frame is incomplete, and the frame cap ends the wait.
    def run() -> None:
        for chunks in every_chunking(prefix + head):
            p = RpcParser(max_frame=4096, max_batch=1000)
            assert feed(p, chunks) == []
            p.receive_data(b"\x00" * 4096)
            with pytest.raises(RpcError) as info:
                p.next_event()
            err = info.value
            assert (err.code, err.close) == (ErrorCode.TOO_LARGE, True)
            assert err.msgid == (5 if prefix else None)
            assert_reply_shape(err)

    assert peak_of(run) < 50 * MiB


def test_nested_declared_arrays_do_not_allocate_their_declared_size() -> None:
    nested = b"\xdc\x27\x10" * 1000  # 1000 nested arrays, each declaring 10_000 elements
    parser = RpcParser()

    def run() -> None:
        parser.receive_data(nested)
        with contextlib.suppress(RpcError):
            assert parser.next_event() is NEED_DATA

    assert peak_of(run) < 50 * MiB


# -- batch and map caps -----------------------------------------------------------------------


def test_an_array_longer_than_max_batch_is_too_large() -> None:
    at = encode_request(8, "put", ["q", [b"x"] * 10])
    over = encode_request(9, "put", ["q", [b"x"] * 11])
    nested = encode_request(10, "m", [[[0] * 11]])
    for chunks in every_chunking(at):
        assert len(feed(RpcParser(max_batch=10), chunks)) == 1
    for frame, msgid in ((over, 9), (nested, 10)):
        for chunks in every_chunking(frame):
            parser = RpcParser(max_batch=10)
            with pytest.raises(RpcError) as info:
                feed(parser, chunks)
            err = info.value
            assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, msgid, True)
            assert_sticky(parser, err)


def test_the_default_max_batch_is_accepted_and_one_more_is_not() -> None:
    ok = encode_request(1, "confirm", ["q", [1] * DEFAULT_MAX_BATCH])
    [request] = feed(RpcParser(), [ok])
    assert isinstance(request, Request) and len(request.params[1]) == DEFAULT_MAX_BATCH
    parser = RpcParser()
    parser.receive_data(encode_request(2, "confirm", ["q", [1] * (DEFAULT_MAX_BATCH + 1)]))
    err = error_of(parser)
    assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, 2, True)


def test_a_map_over_max_map_len_is_too_large() -> None:
    at = encode_request(1, "m", [{str(i): i for i in range(MAX_MAP_LEN)}])
    over = encode_request(2, "m", [{str(i): i for i in range(MAX_MAP_LEN + 1)}])
    assert len(feed(RpcParser(), [at])) == 1
    parser = RpcParser()
    parser.receive_data(over)
    err = error_of(parser)
    assert (err.code, err.msgid, err.close) == (ErrorCode.TOO_LARGE, 2, True)
    small = RpcParser(max_map_len=2)
    small.receive_data(packb([2, "n", [{"a": 1, "b": 2, "c": 3}]]))
    assert error_of(small).code is ErrorCode.TOO_LARGE


@pytest.mark.parametrize("follow", [
    # (arrays of up to 9 pass the parser whatever max_batch: a put's params are 9)
    pytest.param(lambda: encode_request(9, "put", ["q", [b"x"] * 10]), id="long array"),
    pytest.param(lambda: encode_request(9, "m", [{str(i): 0 for i in range(5)}]), id="big map"),
])
def test_a_pipelined_request_over_max_batch_is_answered_by_msgid(follow: Any) -> None:
    parser = RpcParser(max_batch=4, max_map_len=4)
    parser.receive_data(encode_request(1, "version", []) + follow())
    assert parser.next_event() == Request(1, "version", [])
    err = error_of(parser)
    assert err.code is ErrorCode.TOO_LARGE
    assert err.msgid == 9


# -- parse_call -------------------------------------------------------------------------------

#: Every method with a full set of valid params (all optional ones given).
FULL: dict[str, list[Any]] = {
    "put": ["q", [b"a"], 0, 0, 0, None, 1, None, None],  # (nil producer, key, headers)
    "get": ["q", 1, 0, 0, False, False, False],
    "confirm": ["q", [1]],
    "abort": ["q", [1], 0],
    "peek": ["q"],
    "flush": ["q"],
    "delete": ["q"],
    "flush_all": [],
    "auth": ["alice", "secret"],
    "stats": [],
    "version": [],
    "extend": ["q", [1], 1000],
    "reject": ["q", [1]],
    "pause": ["q"],
    "resume": ["q"],
    "move": ["q", "dead", 10, 100],
    "browse": ["q", 0, 10, False],
}
ARITY: dict[str, tuple[int, int]] = {
    "put": (2, 9), "get": (2, 7), "confirm": (2, 2), "abort": (2, 3), "peek": (1, 1),
    "flush": (1, 1), "delete": (1, 1), "flush_all": (0, 0), "stats": (0, 0), "version": (0, 0),
    "auth": (2, 2), "extend": (3, 3), "reject": (2, 2), "pause": (1, 1), "resume": (1, 1),
    "move": (2, 4), "browse": (1, 4),
}
CALL_TYPES: dict[str, type] = {
    "put": Put, "get": Get, "confirm": Confirm, "abort": Abort, "peek": Peek, "flush": Flush,
    "delete": Delete, "flush_all": FlushAll, "stats": Stats, "version": Version, "auth": Auth,
    "extend": Extend, "reject": Reject, "pause": Pause, "resume": Pause, "move": Move,
    "browse": Browse,
}
QUEUE_METHODS = [m for m in FULL if FULL[m] and m != "auth"]


def test_the_tables_cover_every_method() -> None:
    assert set(FULL) == set(ARITY) == set(CALL_TYPES) == set(METHODS)


def call_error(request: Request, max_batch: int = DEFAULT_MAX_BATCH) -> RpcError:
    with pytest.raises(RpcError) as info:
        parse_call(request, max_batch)
    err = info.value
    assert err.msgid == request.msgid
    assert_reply_shape(err)
    return err


VALID = [
    ("put", ["q", [b"a", b""]], Put(7, "q", [b"a", b""], 0)),
    ("put", ["q", [], 1000], Put(7, "q", [], 1000)),
    ("put", ["q", [b"a"], 2**53], Put(7, "q", [b"a"], 2**53)),
    ("put", ["q", [b"a"], 0, 2**32 - 1], Put(7, "q", [b"a"], 0, 2**32 - 1)),
    ("put", ["q", [b"a"], 5, 16], Put(7, "q", [b"a"], 5, 16)),
    # a deduplication key (the eighth param): bytes, or a string as its UTF-8
    ("put", ["q", [b"a", b"b"], 0, 0, 0, None, None, b"k\x00/ "],
     Put(7, "q", [b"a", b"b"], 0, key=b"k\x00/ ")),
    ("put", ["q", [b"a"], 9, 1, 2, None, 0, "\u00e9" * 32],
     Put(7, "q", [b"a"], 9, 1, 2, key=b"\xc3\xa9" * 32)),
    ("put", [b"q", ["h\u00e9", "", "\U0001f600"]],
     Put(7, "q", [b"h\xc3\xa9", b"", b"\xf0\x9f\x98\x80"], 0)),
    ("get", ["q", 1], Get(7, "q", None, 1, 0, 0)),
    ("get", ["q+r", 10, 500], Get(7, "q", "r", 10, 500, 0)),
    ("get", ["q", 5, 0, 30_000], Get(7, "q", None, 5, 0, 30_000)),
    ("get", [b"q+r", DEFAULT_MAX_BATCH, MAX_MS, MAX_MS],
     Get(7, "q", "r", DEFAULT_MAX_BATCH, MAX_MS, MAX_MS)),
    ("get", ["q", 2, 0, 0, True], Get(7, "q", None, 2, 0, 0, with_flags=True)),
    ("get", ["q", 2, 0, 0, False], Get(7, "q", None, 2, 0, 0)),
    ("confirm", ["q+r", [1, 2, 2**64 - 1]], Confirm(7, "q", "r", [1, 2, 2**64 - 1])),
    ("confirm", ["q", []], Confirm(7, "q", None, [])),
    ("abort", ["q", [5]], Abort(7, "q", None, [5])),
    ("abort", [b"q+r", [1]], Abort(7, "q", "r", [1])),
    ("peek", ["q"], Peek(7, "q", None)),
    ("peek", ["q+r"], Peek(7, "q", "r")),
    ("flush", ["q+r"], Flush(7, "q", "r")),
    ("flush", ["q"], Flush(7, "q", None)),
    ("delete", [b"q"], Delete(7, "q", None)),
    ("delete", ["q+r"], Delete(7, "q", "r")),
    ("flush_all", [], FlushAll(7)),
    ("stats", [], Stats(7)),
    ("version", [], Version(7)),
    ("auth", ["alice", "pass word"], Auth(7, "alice", "pass word")),
    ("get", ["q", 2, 0, 10, False, True],
     Get(7, "q", None, 2, 0, 10, with_flags=False, with_deliveries=True)),
    ("extend", ["q+r", [3, 4], 60_000], Extend(7, "q", "r", [3, 4], 60_000)),
    ("extend", ["q", [3], 0], Extend(7, "q", None, [3], 0)),
    ("reject", ["q", [9]], Reject(7, "q", None, [9])),
    ("pause", ["q"], Pause(7, "q", True)),
    ("resume", [b"q"], Pause(7, "q", False)),
    ("move", ["dead", "jobs"], Move(7, "dead", None, "jobs", 0, 0)),
    ("move", ["dead+r", "jobs", 10, 50], Move(7, "dead", "r", "jobs", 10, 50)),
    ("browse", ["q"], Browse(7, "q", None, 0, 100)),
    ("browse", ["q+r", 41, 5], Browse(7, "q", "r", 41, 5)),
]


@pytest.mark.parametrize(("method", "params", "expected"), VALID)
def test_valid_calls(method: str, params: list[Any], expected: object) -> None:
    assert parse_call(Request(7, method, params)) == expected


def test_valid_table_covers_every_method() -> None:
    assert {m for m, _, _ in VALID} == set(METHODS)


def test_optional_params_get_their_defaults() -> None:
    put = parse_call(Request(1, "put", ["q", [b"a"]]))
    assert isinstance(put, Put) and (put.expiration_ms, put.flags) == (0, 0)
    get = parse_call(Request(1, "get", ["q", 3, 0, 10]))
    assert isinstance(get, Get) and get.with_flags is False
    get = parse_call(Request(1, "get", ["q", 3]))
    assert isinstance(get, Get) and (get.timeout_ms, get.auto_abort_ms) == (0, 0)
    get = parse_call(Request(1, "get", ["q", 3, 250]))
    assert isinstance(get, Get) and (get.timeout_ms, get.auto_abort_ms) == (250, 0)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("msgid", [0, 7, MAX_MSGID])
def test_arity(method: str, msgid: int) -> None:
    lo, hi = ARITY[method]
    full = FULL[method]
    assert len(full) == hi
    for n in range(lo, hi + 1):
        call = parse_call(Request(msgid, method, full[:n]))
        assert type(call) is CALL_TYPES[method] and call.msgid == msgid
    wrong = [full[: lo - 1]] if lo else []
    wrong += [[*full, 0], [*full, 0, 0]]
    for params in wrong:
        err = call_error(Request(msgid, method, params))
        assert (err.code, err.close) == (ErrorCode.BAD_PARAMS, False)
        assert str(len(params)) in err.message


BAD_PARAMS = [
    ("put", ["q", [b"a"], 0, 0, 0, None, None, b""]),  # keys: 1 to 64 bytes
    ("put", ["q", [b"a"], 0, 0, 0, None, None, b"k" * 65]),
    ("put", ["q", [b"a"], 0, 0, 0, None, None, 7]),
    ("put", ["q", [b"a"], 0, 0, 0, b"p", 1, b"k"]),  # a producer or a key, not both
    ("put", ["q", [], 0, 0, 0, None, None, b"k"]),  # a keyed put has items
    ("extend", ["q", [1], -1]),
    ("extend", ["q", [0], 10]),
    ("extend", ["q", 1, 10]),
    ("move", ["q", "d", -1]),
    ("move", ["q", "d", 1, "fast"]),
    ("browse", ["q", 0, 0]),
    ("browse", ["q", -1]),
    ("get", ["q", 1, 0, 0, False, 1]),
    ("put", [1, [b"a"]]),
    ("put", [None, [b"a"]]),
    ("put", [["q"], [b"a"]]),
    ("put", ["q", b"a"]),
    ("put", ["q", "ab"]),
    ("put", ["q", None]),
    ("put", ["q", {"a": b"b"}]),
    ("put", ["q", [1]]),
    ("put", ["q", [None]]),
    ("put", ["q", [True]]),
    ("put", ["q", [1.5]]),
    ("put", ["q", [[b"a"]]]),
    ("put", ["q", [{"a": 1}]]),
    ("put", ["q", [b"a", 2]]),
    ("put", ["q", [b"a"], -1]),
    ("put", ["q", [b"a"], 2**53 + 1]),
    ("put", ["q", [b"a"], "0"]),
    ("put", ["q", [b"a"], 1.0]),
    ("put", ["q", [b"a"], True]),
    ("put", ["q", [b"a"], None]),
    ("put", ["q", [b"a"], 0, -1]),
    ("put", ["q", [b"a"], 0, 2**32]),
    ("put", ["q", [b"a"], 0, "1"]),
    ("put", ["q", [b"a"], 0, True]),
    ("put", ["q", [b"a"], 0, None]),
    ("put", ["q", [b"a"], 0, 1.0]),
    ("get", [5, 1]),
    ("get", ["q", 0]),
    ("get", ["q", -1]),
    ("get", ["q", "1"]),
    ("get", ["q", 1.0]),
    ("get", ["q", True]),
    ("get", ["q", None]),
    ("get", ["q", 1, -1]),
    ("get", ["q", 1, MAX_MS + 1]),
    ("get", ["q", 1, "5"]),
    ("get", ["q", 1, 2.5]),
    ("get", ["q", 1, False]),
    ("get", ["q", 1, 0, -1]),
    ("get", ["q", 1, 0, MAX_MS + 1]),
    ("get", ["q", 1, 0, 1.5]),
    ("get", ["q", 1, 0, None]),
    ("get", ["q", 1, 0, 0, 1]),
    ("get", ["q", 1, 0, 0, "true"]),
    ("get", ["q", 1, 0, 0, None]),
    *[(m, params) for m in ("confirm", "abort") for params in (
        ["q", 1], ["q", None], ["q", b"\x01"], ["q", {"1": 1}], ["q", [0]], ["q", [-1]],
        ["q", [True]], ["q", ["1"]], ["q", [1.0]], ["q", [None]], ["q", [1, 0]],
        ["q", [[1]]], [1, [1]], [None, [1]],
    )],
    *[(m, params) for m in ("peek", "flush", "delete") for params in (
        [1], [None], [[b"q"]], [{"q": 1}], [1.5],
    )],
]


@pytest.mark.parametrize(("method", "params"), BAD_PARAMS)
def test_bad_params(method: str, params: list[Any]) -> None:
    err = call_error(Request(42, method, params))
    assert (err.code, err.close) == (ErrorCode.BAD_PARAMS, False)


def test_get_max_items_lower_bound() -> None:
    assert call_error(Request(1, "get", ["q", 0])).code is ErrorCode.BAD_PARAMS
    assert isinstance(parse_call(Request(1, "get", ["q", 1])), Get)


GOOD_NAMES = [
    ("q", "q"),
    ("Az09_:-", "Az09_:-"),
    ("a" * 250, "a" * 250),
    (b"q", "q"),
    (b"Az09_:-", "Az09_:-"),
]
BAD_NAMES = [
    "", "a" * 251, "q r", "q/r", "q.r", "../x", "q\x00", "q\n", "\u00e9", "q\u00e9",
    "\U0001f600", b"", b"a" * 251, b"\xc3\xa9", b"q\xff", b"q r", b"../x",
    "q+", "+r", "+", "q+r+s", "q++r", "q+" + "r" * 251, "q+\u00e9", "q+r/x", b"q+", b"q+\xff",
    "a" * 251 + "+r",
]


@pytest.mark.parametrize("method", QUEUE_METHODS)
@pytest.mark.parametrize(("name", "queue"), GOOD_NAMES)
def test_good_queue_names(method: str, name: str | bytes, queue: str) -> None:
    call = parse_call(Request(3, method, [name, *FULL[method][1:]]))
    assert getattr(call, "queue") == queue  # noqa: B009  (the Call union has no common queue)
    if not isinstance(call, Put | Pause):
        assert getattr(call, "reader") is None  # noqa: B009


@pytest.mark.parametrize("method", [m for m in QUEUE_METHODS
                                    if m not in ("put", "pause", "resume")])
@pytest.mark.parametrize(("name", "queue", "reader"), [
    ("q+r", "q", "r"),
    (b"q+r", "q", "r"),
    ("a" * 250 + "+" + "b" * 250, "a" * 250, "b" * 250),
    ("q:1+r-2_x", "q:1", "r-2_x"),
])
def test_fanout_reader_names(method: str, name: str | bytes, queue: str, reader: str) -> None:
    call = parse_call(Request(3, method, [name, *FULL[method][1:]]))
    assert (getattr(call, "queue"), getattr(call, "reader")) == (queue, reader)  # noqa: B009


@pytest.mark.parametrize("method", QUEUE_METHODS)
@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_queue_names(method: str, name: str | bytes) -> None:
    err = call_error(Request(MAX_MSGID, method, [name, *FULL[method][1:]]))
    assert (err.code, err.close) == (ErrorCode.BAD_QUEUE_NAME, False)
    assert len(err.message) < 200  # a long bad name is not echoed whole


@pytest.mark.parametrize("name", ["q+r", b"q+r", "q+" + "r" * 250])
def test_put_to_a_fanout_reader_is_refused(name: str | bytes) -> None:
    err = call_error(Request(2, "put", [name, [b"a"]]))
    assert (err.code, err.close) == (ErrorCode.BAD_QUEUE_NAME, False)


def test_str_items_are_utf8_bytes() -> None:
    put = parse_call(Request(1, "put", ["q", ["a", b"b", "\u00e9\u4e2d"]]))
    assert isinstance(put, Put)
    assert put.items == [b"a", b"b", "\u00e9\u4e2d".encode()]
    assert all(type(item) is bytes for item in put.items)


@pytest.mark.parametrize("max_batch", [1, 3, 10])
def test_batches_over_max_batch_are_too_large_and_close(max_batch: int) -> None:
    n, over = max_batch, max_batch + 1
    assert isinstance(parse_call(Request(1, "put", ["q", [b"x"] * n]), max_batch), Put)
    assert isinstance(parse_call(Request(1, "confirm", ["q", [1] * n]), max_batch), Confirm)
    assert isinstance(parse_call(Request(1, "abort", ["q", [1] * n]), max_batch), Abort)
    assert isinstance(parse_call(Request(1, "get", ["q", n]), max_batch), Get)
    for request in (
        Request(11, "put", ["q", [b"x"] * over]),
        Request(12, "put", ["q", ["x"] * over, 5]),
        Request(13, "confirm", ["q", [1] * over]),
        Request(14, "abort", ["q+r", [1] * over]),
        Request(15, "get", ["q", over]),
        Request(16, "get", ["q", 2**63, 0, 0]),
    ):
        err = call_error(request, max_batch)
        assert (err.code, err.close) == (ErrorCode.TOO_LARGE, True), request


def test_max_batch_default() -> None:
    n = DEFAULT_MAX_BATCH
    assert isinstance(parse_call(Request(1, "get", ["q", n])), Get)
    assert call_error(Request(1, "get", ["q", n + 1])).code is ErrorCode.TOO_LARGE
    assert call_error(Request(1, "put", ["q", [b""] * (n + 1)])).code is ErrorCode.TOO_LARGE
    assert call_error(Request(1, "abort", ["q", [1] * (n + 1)])).code is ErrorCode.TOO_LARGE


@pytest.mark.parametrize("method", ["nope", "PUT", "Get", "", " put", "put ", "x" * 1000,
                                    "__class__", "get_many"])
def test_unknown_method(method: str) -> None:
    err = call_error(Request(99, method, []))
    assert (err.code, err.close) == (ErrorCode.UNKNOWN_METHOD, False)
    assert len(err.message) < 200


names = st.sampled_from(["q", "q+r", b"q", "", "a" * 251, "q r", "\u00e9", b"\xff", "q+"])
small_ints = st.integers(-3, 5) | st.sampled_from([MAX_MS, MAX_MS + 1, 2**53, 2**63, 2**64 - 1])
loose_params = st.lists(
    names | small_ints | st.lists(small_ints, max_size=4)
    | st.lists(st.binary(max_size=3) | st.text(max_size=3), max_size=4) | values,
    max_size=5,
)


@FAST
@given(msgids, st.sampled_from(sorted(METHODS)) | methods, loose_params,
       st.integers(1, 5))
def test_parse_call_gives_a_call_or_an_rpc_error_with_the_msgid(
        msgid: int, method: str, params: list[Any], max_batch: int) -> None:
    try:
        call = parse_call(Request(msgid, method, params), max_batch)
    except RpcError as err:
        assert err.msgid == msgid
        assert err.code in {ErrorCode.UNKNOWN_METHOD, ErrorCode.BAD_PARAMS,
                            ErrorCode.BAD_QUEUE_NAME, ErrorCode.TOO_LARGE}
        assert err.close == (err.code is ErrorCode.TOO_LARGE)
        assert (err.code is ErrorCode.UNKNOWN_METHOD) == (method not in METHODS)
        assert_reply_shape(err)
        return
    assert type(call) is CALL_TYPES[method]
    assert call.msgid == msgid


def test_from_the_wire_to_a_call() -> None:
    stream = (packb([0, 1, "put", ["q", ["text", b"\x00\xff"], 60_000]])
              + packb([0, 2, "get", ["q+r", 2, 100, 5000]])
              + packb([0, 3, "confirm", ["q+r", [1, 2]]]))
    for chunks in every_chunking(stream):
        requests = feed(RpcParser(), chunks)
        assert [parse_call(r) for r in requests if isinstance(r, Request)] == [
            Put(1, "q", [b"text", b"\x00\xff"], 60_000),
            Get(2, "q", "r", 2, 100, 5000),
            Confirm(3, "q", "r", [1, 2]),
        ]


def test_rpc_error_basics() -> None:
    err = RpcError(ErrorCode.BUSY, "busy", 4)
    assert isinstance(err, QueuedError)
    assert (err.close, str(err)) == (False, "BUSY: busy")
    assert unpackb(err.reply) == [1, 4, [12, "busy"], None]
    anon = RpcError(ErrorCode.SHUTTING_DOWN, "bye", close=True)
    assert unpackb(anon.reply) == [2, "error", [[10, "bye"]]]


def test_error_codes_are_stable() -> None:
    assert {c.name: int(c) for c in ErrorCode} == {
        "MALFORMED": 1, "UNKNOWN_METHOD": 2, "BAD_PARAMS": 3, "BAD_QUEUE_NAME": 4,
        "QUEUE_FULL": 5, "ITEM_TOO_LARGE": 6, "TOO_LARGE": 7, "TOO_MANY_OPEN_READS": 8,
        "JOURNAL_FULL": 9, "SHUTTING_DOWN": 10, "SERVER_ERROR": 11, "BUSY": 12,
        "UNAUTHENTICATED": 13, "AUTH_FAILED": 14, "PERMISSION_DENIED": 15,
        "TOO_MANY_QUEUES": 16, "NOT_OPEN": 17, "PRODUCER_GAP": 18,
    }


# -- purity -----------------------------------------------------------------------------------






def test_a_new_parser_starts_small_and_its_buffer_grows_with_the_frames() -> None:
    """msgpack's Unpacker starts with min(max_buffer_size, 1 MiB) unless told: that was
    1 MiB of heap per RPC connection, whatever it sent."""
    parsers: list[RpcParser] = []
    assert peak_of(lambda: parsers.append(RpcParser())) < 256 * 1024  # the default 64 MiB cap
    parser = parsers[0]
    data = bytes(range(256)) * (3 * 4096)  # 3 MiB: past the first buffer many times
    frame = msgpack.packb([0, 7, "put", ["q", [data]]], use_bin_type=True)
    for k in range(0, len(frame), 100_000):
        parser.receive_data(frame[k:k + 100_000])
    ev = parser.next_event()
    assert isinstance(ev, rp.Request) and ev.msgid == 7 and ev.params == ["q", [data]]
