"""The protocol-neutral commands and each protocol's tables (queued.wire.commands and
queued.wire.{memcache,text,rpc}_commands): complete, and mapping what they should."""

from __future__ import annotations

import errno
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queued.errors import (
    BadNameError,
    ItemTooLargeError,
    JournalClosedError,
    JournalFullError,
    JournalWriteError,
    ProtocolError,
    QueueClosedError,
    QueueFullError,
    ReadStateError,
)
from queued.reader.state import Item
from queued.wire import commands as c
from queued.wire import memcache_commands as mcc
from queued.wire import memcache_protocol as mc
from queued.wire import rpc_commands as rpcc
from queued.wire import rpc_protocol as rp
from queued.wire import text_commands as tc
from queued.wire import text_protocol as tp
from queued.wire.parsing import NEED_DATA, ConnectionClosed

LIMITS = c.Limits(max_line=2048, max_item_size=1 << 20, max_frame=1 << 20, max_batch=1000)


def test_every_parser_event_has_a_command_and_a_reply() -> None:
    for table, events in ((mcc, mc.Command), (tc, tp.Command)):
        kinds = set(typing.get_args(events))
        assert set(table.COMMANDS) == kinds
        assert set(table.REPLIES) == kinds
    calls = set(typing.get_args(rp.Call))
    assert set(rpcc.COMMANDS) == calls - {rp.Get}  # get takes the connection's max_bytes


def test_every_error_kind_has_a_reply_in_every_protocol() -> None:
    assert set(mcc.FAILURES) == set(c.ErrorKind)
    assert set(rpcc.CODES) == set(c.ErrorKind)
    codec = tc.TextCodec(LIMITS)
    req = c.Request(c.Put("q", (b"x",)), tp.Put("q", (b"x",)), "put")
    for kind in c.ErrorKind:
        assert codec.encode(req, c.Failure(kind, "why")).startswith(b"-")


@pytest.mark.parametrize(("exc", "kind"), [
    (BadNameError("bad"), c.ErrorKind.BAD_NAME),
    (QueueFullError("full"), c.ErrorKind.QUEUE_FULL),
    (ItemTooLargeError("big"), c.ErrorKind.ITEM_TOO_LARGE),
    (JournalFullError("full"), c.ErrorKind.JOURNAL_FULL),
    (ReadStateError("open"), c.ErrorKind.TOO_MANY_OPEN_READS),
    (QueueClosedError("gone"), c.ErrorKind.SHUTTING_DOWN),
    (JournalClosedError("closed"), c.ErrorKind.SHUTTING_DOWN),
    (ValueError("bad value"), c.ErrorKind.BAD_PARAMS),
    (JournalWriteError("disk"), c.ErrorKind.SERVER_ERROR),
])
def test_failure_of_maps_each_error_to_its_kind(exc: Exception, kind: c.ErrorKind) -> None:
    assert c.failure_of(exc) == c.Failure(kind, str(exc))


def test_failure_of_an_os_error_says_its_strerror_and_a_bug_is_none() -> None:
    assert c.failure_of(OSError(errno.ENOSPC, "No space left on device")) == c.Failure(
        c.ErrorKind.SERVER_ERROR, "No space left on device")
    assert c.failure_of(KeyError("bug")) is None


@pytest.mark.parametrize(("exptime", "ttl", "at"), [
    (0, None, None), (-1, 0, None), (60, 60_000, None), (999_999, 999_999_000, None),
    (1_700_000_000, None, 1_700_000_000_000),
])
def test_memcache_exptime_becomes_a_relative_or_absolute_expiry(
    exptime: int, ttl: int | None, at: int | None,
) -> None:
    put = mcc.put_of(mc.Set("q", 0, exptime, b"x"))
    assert (put.ttl_ms, put.expire_at_ms) == (ttl, at)
    assert put.expire_ms(1000) == (at if at is not None else None if ttl is None else 1000 + ttl)


def decode_all(codec: c.Codec, data: bytes) -> list[object]:
    codec.receive_data(data)
    out: list[object] = []
    while True:
        try:
            r = codec.next_request()
        except ProtocolError as e:
            out.append(e)
            if e.close:  # sticky: the parser only repeats it
                return out
            continue
        if r is NEED_DATA:
            return out
        out.append(r)


def test_memcache_requests_and_replies() -> None:
    codec = mcc.MemcacheCodec(LIMITS)
    set_, get, quiet = decode_all(codec, b"set q 0 0 1\r\nx\r\nget q+r/t=5/open\r\n"
                                         b"set q 0 0 1 noreply\r\ny\r\n")
    assert isinstance(set_, c.Request) and set_.command == c.Put("q", (b"x",))
    assert set_.name == "set"
    assert isinstance(get, c.Request) and get.command == c.Get(
        "q", "r", timeout_ms=5, open=True, exclusive=True)
    assert codec.encode(set_, c.Stored(1)) == b"STORED\r\n"
    assert codec.encode(set_, c.Failure(c.ErrorKind.QUEUE_FULL, "full")) == b"NOT_STORED\r\n"
    assert isinstance(quiet, c.Request)
    assert codec.encode(quiet, c.Stored(1)) == b""
    assert codec.encode(quiet, c.Failure(c.ErrorKind.QUEUE_FULL, "full")) == b""
    item = Item(3, b"data", 0)
    assert codec.encode(get, c.Items([item])) == b"VALUE q+r/t=5/open 0 4\r\ndata\r\nEND\r\n"
    assert codec.encode(get, c.Failure(c.ErrorKind.READ_OPEN, "open")) == b"ERROR\r\n"
    assert c.ErrorKind.READ_OPEN in codec.closing


def test_memcache_joins_pipelined_sets_and_plain_gets() -> None:
    codec = mcc.MemcacheCodec(LIMITS)
    codec.receive_data(b"set q 0 0 1\r\na\r\nset q 0 0 1\r\nb\r\nset q 0 0 1\r\nc\r\n"
                       b"get q\r\nget q\r\nget q\r\nget q/open\r\nget q\r\n")
    puts, gets, opened, alone = codec.next_requests(100)
    assert isinstance(puts, c.Request) and puts.count == 3
    assert puts.command == c.Put("q", [b"a", b"b", b"c"])
    assert codec.encode(puts, c.Stored(3)) == b"STORED\r\n" * 3
    assert [p.command for p in puts.split()] == [c.Put("q", (d,)) for d in (b"a", b"b", b"c")]
    assert isinstance(gets, c.Request) and gets.count == 3
    assert gets.command == c.Get("q", None, max_items=3, exclusive=True)
    item = Item(1, b"a", 0)
    assert codec.encode(gets, c.Items([item])) == (b"VALUE q 0 1\r\na\r\nEND\r\n"
                                                   + b"END\r\n" * 2)
    assert codec.encode(gets, c.Items([])) == b"END\r\n" * 3
    # each get fails alike; after a closing failure the connection ends: one reply
    assert codec.encode(gets, c.Failure(c.ErrorKind.TOO_MANY_OPEN_READS, "x")).count(
        b"CLIENT_ERROR") == 3
    assert codec.encode(gets, c.Failure(c.ErrorKind.READ_OPEN, "open")) == b"ERROR\r\n"
    assert isinstance(opened, c.Request) and opened.count == 1 and opened.command.open
    assert isinstance(alone, c.Request) and alone.count == 1
    assert alone.command == c.Get("q", None, exclusive=True)  # the shared request is intact


def test_memcache_sets_join_only_with_the_same_flags_and_values_carry_them() -> None:
    codec = mcc.MemcacheCodec(LIMITS)
    codec.receive_data(b"set q 5 0 1\r\na\r\nset q 5 0 1\r\nb\r\nset q 0 0 1\r\nc\r\n"
                       b"set q 0 0 1\r\nd\r\nset q 4294967295 0 1\r\ne\r\n")
    five, zero, top = codec.next_requests(100)
    assert isinstance(five, c.Request) and five.count == 2
    assert five.command == c.Put("q", [b"a", b"b"], flags=5)
    assert [p.command for p in five.split()] == [c.Put("q", (d,), flags=5) for d in (b"a", b"b")]
    assert isinstance(zero, c.Request) and zero.command == c.Put("q", [b"c", b"d"])
    assert zero.command.flags == 0
    assert isinstance(top, c.Request) and top.count == 1
    assert top.command == c.Put("q", [b"e"], flags=2**32 - 1)
    (get,) = decode_all(codec, b"get q\r\n")
    assert isinstance(get, c.Request)
    items = [Item(1, b"a", 0, flags=5), Item(2, b"c", 0), Item(3, b"e", 0, flags=2**32 - 1)]
    assert codec.encode(get, c.Items(items[:1])) == b"VALUE q 5 1\r\na\r\nEND\r\n"
    joined = c.Request(c.Get("q", max_items=3, exclusive=True), get.context, "get", count=3)
    assert codec.encode(joined, c.Items(items)) == (
        b"VALUE q 5 1\r\na\r\nEND\r\nVALUE q 0 1\r\nc\r\nEND\r\n"
        b"VALUE q 4294967295 1\r\ne\r\nEND\r\n")
    (mon,) = decode_all(codec, b"monitor q+r 1\r\n")
    assert isinstance(mon, c.Request)
    assert codec.encode_item(mon, items[2]) == b"VALUE q+r 4294967295 1\r\ne\r\n"


_LINES = st.sampled_from([
    b"set a 0 0 1\r\nx\r\n", b"set a 0 0 2\r\nyy\r\n", b"set b 0 0 1\r\nz\r\n",
    b"set a 7 0 1\r\nf\r\n", b"set a 4294967295 0 1\r\ng\r\n",
    b"set a 0 5 1\r\nt\r\n", b"set a 0 0 1 noreply\r\nn\r\n", b"get a\r\n", b"get b\r\n",
    b"get a/open\r\n", b"get a/peek\r\n", b"version\r\n", b"bogus\r\n",
    b"set a 0 0 1\r\nxBAD\r\n",
])


@settings(max_examples=200, deadline=None)
@given(st.lists(_LINES, max_size=30), st.integers(1, 40), st.integers(1, 50))
def test_memcache_joined_requests_stand_for_the_requests_one_by_one(
        lines: list[bytes], chunk: int, limit: int) -> None:
    """Whatever the pipeline and however it arrives, next_requests (joining, with the
    parser's line cache) gives the requests one-by-one parsing gives, in order."""
    data = b"".join(lines) or b"version\r\n"  # (b"" would be the end of the stream)
    one = mcc.MemcacheCodec(LIMITS)
    expected = [_shape(r) for r in decode_all(one, data)]
    joined = mcc.MemcacheCodec(LIMITS)
    got: list[object] = []
    closed = False
    for i in range(0, len(data), chunk):
        joined.receive_data(data[i:i + chunk])
        while not closed and (batch := joined.next_requests(limit)):
            for r in batch:
                got.extend(_expand(r))
                closed = isinstance(r, ProtocolError) and r.close
    assert got == expected


def _shape(r: object) -> object:
    if isinstance(r, c.Request):
        cmd = r.command
        if isinstance(cmd, c.Put):
            return ("put", cmd.queue, tuple(cmd.items), cmd.ttl_ms, cmd.flags,
                    r.context.noreply)
        if isinstance(cmd, c.Get):
            return ("get", cmd.queue, cmd.open, cmd.peek, cmd.max_items)
        return type(cmd).__name__
    if isinstance(r, ProtocolError):
        return ("error", r.reply, r.close)
    return r


def _expand(r: object) -> list[object]:
    if isinstance(r, c.Request) and r.count > 1:
        if isinstance(r.command, c.Get):
            assert r.command.max_items == r.count
            return [("get", r.command.queue, False, False, 1)] * r.count
        assert isinstance(r.command, c.Put) and len(r.command.items) == r.count
        return [_shape(p) for p in r.split()]
    return [_shape(r)]


def test_text_get_leaves_an_item_with_a_newline_queued() -> None:
    codec = tc.TextCodec(LIMITS)
    (get,) = decode_all(codec, b"get q 10\n")
    assert isinstance(get, c.Request)
    assert get.command == c.Get("q", None, timeout_ms=10, open=True, line_safe=True)
    assert codec.encode(get, c.Failure(c.ErrorKind.NOT_ENCODABLE, "nl")).startswith(b"-Item")
    assert codec.encode(get, c.Items([])) == b"*\n"


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


def test_memcache_gets_of_one_key_share_their_request_and_the_cache_is_bounded() -> None:
    codec = mcc.MemcacheCodec(LIMITS)
    first, again, other = decode_all(codec, b"get q/t=5\r\nget q/t=5\r\nget r\r\n")
    assert first is again and first is not other
    keys = b"".join(b"get k%d\r\n" % i for i in range(mcc.GET_CACHE + 10))
    assert len(decode_all(codec, keys)) == mcc.GET_CACHE + 10
    (later,) = decode_all(codec, b"get q/t=5\r\n")  # the cache started again when full
    assert later is not first and later.command == first.command


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_LINES, st.booleans()), max_size=30), st.integers(1, 50),
       st.booleans())
def test_memcache_whole_request_chunks_parse_as_the_buffered_path(
        chunks: list[tuple[bytes, bool]], limit: int, eof: bool) -> None:
    """A chunk that is exactly one plain request (`receive_data`'s fast path, the
    one-request-in-flight client's shape) gives what buffered parsing gives, in order,
    whether it is taken at once or more chunks (and the end of the stream) follow it."""
    data = b"".join(line for line, _ in chunks) or b"version\r\n"
    one = mcc.MemcacheCodec(LIMITS)
    expected = [_shape(r) for r in decode_all(one, data)]
    if eof and not (expected and isinstance(last := expected[-1], tuple)
                    and last[0] == "error" and last[2]):
        expected.append("closed")  # (after a closing error the parser says nothing more)
    whole = mcc.MemcacheCodec(LIMITS)
    got: list[object] = []
    closed = False

    def take() -> None:
        nonlocal closed
        while not closed and (batch := whole.next_requests(limit)):
            for r in batch:
                if isinstance(r, ConnectionClosed):
                    got.append("closed")
                    closed = True
                    continue
                got.extend(_expand(r))
                closed = isinstance(r, ProtocolError) and r.close

    for line, now in chunks or [(data, True)]:
        whole.receive_data(line)
        if now:
            take()
    if eof:
        whole.receive_data(b"")
    take()
    assert got == expected


def test_memcache_a_whole_set_chunk_is_not_buffered() -> None:
    codec = mcc.MemcacheCodec(LIMITS)
    codec.receive_data(b"set q 0 0 2\r\nab\r\n")
    assert codec.buffered_bytes() == 0 and not codec.pending()
    codec.receive_data(b"get q\r\nset q 0")  # (behind it, buffered)
    put, get = codec.next_requests(10)
    assert isinstance(put, c.Request) and put.command == c.Put("q", [b"ab"])
    assert isinstance(get, c.Request) and get.command == c.Get("q", None, exclusive=True)
    assert codec.pending()
