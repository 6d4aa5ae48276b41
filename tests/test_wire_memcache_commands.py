"""The memcache protocol's table of commands (queued.wire.memcache_commands), pure:
exptime as a relative or absolute expiry, requests and replies, pipelined sets and gets
joined (only with the same flags, standing for the requests one by one), gets of one key
sharing their request, and a set whose data is a configured user's credential pair (a
login). All three tables against the protocol-neutral commands: test_wire_commands.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_util import LIMITS, decode_all

from queued.errors import (
    ProtocolError,
)
from queued.reader.state import Item
from queued.wire import commands as c
from queued.wire import memcache_commands as mcc
from queued.wire import memcache_protocol as mc
from queued.wire.access import MAX_PASSWORD
from queued.wire.memcache_commands import login_of
from queued.wire.parsing import ConnectionClosed


def test_login_of_takes_only_the_shape_of_a_configured_users_credentials() -> None:
    known = {"alice", "bob"}.__contains__
    assert login_of(b"alice alice pw", known) == c.Auth("alice", "alice pw")
    assert login_of(b"bob x\r\n", known) == c.Auth("bob", "x")
    assert login_of(b"bob " + b"p" * MAX_PASSWORD, known) is not None
    for data in (b"mallory pw", b"alice", b"alicepw", b"\xff\xfe pw", b"",
                 b"bob " + b"p" * (MAX_PASSWORD + 1), b"bob \xff\xfe"):
        assert login_of(data, known) is None, data


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
