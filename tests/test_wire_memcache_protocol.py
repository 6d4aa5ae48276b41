"""The memcache protocol parser and encoders: tables fed in every chunking, caps, garbage."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_util import (
    Err,
    assert_any_chunking,
    assert_every_chunking,
    assert_pipelined_in_order,
    run,
)

from queued import errors
from queued.errors import ProtocolError
from queued.wire import memcache_protocol as mp
from queued.wire import parsing as wire
from queued.wire.memcache_protocol import (
    Confirm,
    Delete,
    DumpStats,
    Flush,
    FlushAll,
    FlushAllExpired,
    FlushExpired,
    Get,
    MemcacheParser,
    Monitor,
    Pause,
    Quit,
    Reload,
    Set,
    Shutdown,
    Stats,
    Touch,
    Version,
)
from queued.wire.parsing import NEED_DATA, ConnectionClosed


def make() -> MemcacheParser:
    return MemcacheParser(max_line=2048, max_item_size=64)


def bad(msg: str, close: bool = False) -> Err:
    return Err("BadCommand", b"CLIENT_ERROR " + msg.encode() + b"\r\n", close)


UNKNOWN = Err("UnknownCommand", b"ERROR\r\n", False)

TABLE: list[tuple[bytes, list[object]]] = [
    (b"set q 0 0 5\r\nhello\r\n", [Set("q", 0, 0, b"hello")]),
    (b"set q 7 100 7 noreply\r\nab\r\ncd!\r\n", [Set("q", 7, 100, b"ab\r\ncd!", True)]),
    (b"set q 4294967295 -1 0\r\n\r\n", [Set("q", 4294967295, -1, b"")]),
    (b"SET a:b-c_D9 0 1700000000 1\r\nx\r\n", [Set("a:b-c_D9", 0, 1700000000, b"x")]),
    (b"set  q \t0 0 1 \r\nx\r\n", [Set("q", 0, 0, b"x")]),
    (b"get q\r\n", [Get("q", "q")]),
    (b"get q\n", [Get("q", "q")]),
    (b"GET q/t=500\r\n", [Get("q/t=500", "q", timeout_ms=500)]),
    (b"get q/open\r\n", [Get("q/open", "q", open=True)]),
    (b"get q/close\r\n", [Get("q/close", "q", close=True)]),
    (b"get q/close/open\r\n", [Get("q/close/open", "q", open=True, close=True)]),
    (b"get q/t=9/close/open\r\n", [Get("q/t=9/close/open", "q", None, 9, True, True)]),
    (b"get q/abort\r\n", [Get("q/abort", "q", abort=True)]),
    (b"get q/peek\r\n", [Get("q/peek", "q", peek=True)]),
    (b"get q/t=0/peek\r\n", [Get("q/t=0/peek", "q", peek=True)]),
    (b"get q+r/open\r\n", [Get("q+r/open", "q", "r", open=True)]),
    (b"delete q\r\n", [Delete("q")]),
    (b"delete q+r noreply\r\n", [Delete("q", "r", True)]),
    (b"flush q\r\n", [Flush("q")]),
    (b"flush q+r\r\n", [Flush("q", "r")]),
    (b"flush_all\r\n", [FlushAll()]),
    (b"flush_all 0 noreply\r\n", [FlushAll(0, True)]),
    (b"flush_all noreply\r\n", [FlushAll(0, True)]),
    (b"flush_all 30\r\n", [FlushAll(30)]),
    (b"flush_expired q\r\n", [FlushExpired("q")]),
    (b"flush_all_expired\r\n", [FlushAllExpired()]),
    (b"stats\r\n", [Stats()]),
    (b"stats items\r\n", [Stats(("items",))]),
    (b"dump_stats\r\n", [DumpStats()]),
    (b"version\r\n", [Version()]),
    (b"reload\r\n", [Reload()]),
    (b"shutdown\r\n", [Shutdown()]),
    (b"quit\r\n", [Quit()]),
    (b"monitor q 10\r\n", [Monitor("q", 10)]),
    (b"monitor q+r 10 5\r\n", [Monitor("q", 10, 5, "r")]),
    (b"confirm q 3\r\n", [Confirm("q", 3)]),
    (b"confirm q+r 0\r\n", [Confirm("q", 0, "r")]),
    (b"touch q 30000\r\n", [Touch("q", 30000)]),
    (b"touch q+r 0 noreply\r\n", [Touch("q", 0, "r", True)]),
    (b"get q/reject\r\n", [Get("q/reject", "q", reject=True)]),
    (b"pause q\r\n", [Pause("q")]),
    (b"resume q\r\n", [Pause("q", False)]),
    # errors that keep the connection
    (b"touch q\r\n", [bad("usage: touch <queue> <ms> [noreply]")]),
    (b"touch q soon\r\n", [bad("bad ms")]),
    (b"touch q soon noreply\r\n", [Err("BadCommand", b"", False)]),
    (b"pause q+r\r\n", [bad("cannot write to a fanout reader; write to its queue")]),
    (b"bogus\r\n", [UNKNOWN]),
    (b"\r\n", [UNKNOWN]),
    (b"gets q\r\n", [UNKNOWN]),
    (b"\xff\xfe\x00\r\n", [UNKNOWN]),
    (b"add q 0 0 3\r\nabc\r\nget q\r\n",
     [bad("add is not supported; queues only take set"), Get("q", "q")]),
    (b"cas q 0 0 3 99\r\nabc\r\n", [bad("cas is not supported; queues only take set")]),
    (b"append q 0 0 2 noreply\r\nab\r\n", [Err("BadCommand", b"", False)]),
    (b"set q.x 0 0 3\r\nabc\r\nversion\r\n", [bad("bad queue name"), Version()]),
    (b"set q+r 0 0 1\r\nx\r\n", [bad("cannot write to a fanout reader; write to its queue")]),
    (b"set q x 0 1\r\na\r\n", [bad("bad flags")]),
    (b"set q 4294967296 0 1\r\na\r\n", [bad("flags out of range")]),
    (b"set q 0 1_0 1\r\na\r\n", [bad("bad exptime")]),
    (b"set q 0 0 1 noreply\r\na\r\n", [Set("q", 0, 0, b"a", True)]),
    # deduplication keys: `key=<k>` after the queue name, with or without a delay
    (b"set q/key=order-1 0 0 1\r\na\r\n", [Set("q", 0, 0, b"a", key=b"order-1")]),
    (b"set q/delay=5/key=k 3 0 1 noreply\r\na\r\n", [Set("q", 3, 0, b"a", True, 5, b"k")]),
    (b"set q/key=" + b"~" * 64 + b"/delay=0 0 0 1\r\na\r\n",
     [Set("q", 0, 0, b"a", key=b"~" * 64)]),
    (b"set q/key=a=b:c 0 0 1\r\na\r\nset q 0 0 1\r\nb\r\n",
     [Set("q", 0, 0, b"a", key=b"a=b:c"), Set("q", 0, 0, b"b")]),
    (b"set q/key= 0 0 1\r\na\r\nversion\r\n",
     [bad("deduplication key must be 1 to 64 characters"), Version()]),
    (b"set q/key=" + b"k" * 65 + b" 0 0 1\r\na\r\n",
     [bad("deduplication key must be 1 to 64 characters")]),
    (b"set q/key=\xc3\xa9 0 0 1\r\na\r\n",
     [bad("deduplication key must be printable ASCII without '/'")]),
    (b"set q/key=a/key=b 0 0 1\r\na\r\n",
     [bad("unknown or repeated set option (delay=<ms>, key=<k>)")]),
    (b"set q/key 0 0 1\r\na\r\n", [bad("unknown or repeated set option (delay=<ms>, key=<k>)")]),
    (b"set q/key=a 0 0 1 noreply\r\na\r\nset q/key= 0 0 1 noreply\r\nb\r\n",
     [Set("q", 0, 0, b"a", True, key=b"a"), Err("BadCommand", b"", False)]),
    (b"set q.x 0 0 1 noreply\r\na\r\n", [Err("BadCommand", b"", False)]),
    (b"set q 0 0 100\r\n" + b"z" * 100 + b"\r\nget q\r\n",
     [Err("TooLarge", b"NOT_STORED\r\n", False), Get("q", "q")]),
    (b"set q 0 0 100 noreply\r\n" + b"z" * 100 + b"\r\n", [Err("TooLarge", b"", False)]),
    (b"get\r\n", [bad("get takes exactly one key")]),
    (b"get a b\r\nget a\r\n", [bad("get takes exactly one key"), Get("a", "a")]),
    (b"get a noreply\r\n", [bad("get takes exactly one key")]),  # get has no noreply
    (b"stats noreply\r\n", [Stats(("noreply",))]),
    (b"delete\r\n", [bad("usage: delete <queue> [noreply]")]),
    (b"delete a b\r\n", [bad("usage: delete <queue> [noreply]")]),
    (b"delete a noreply\r\n", [Delete("a", None, True)]),
    (b"delete a b noreply\r\n", [Err("BadCommand", b"", False)]),
    (b"delete a/b\r\n", [bad("bad queue name")]),
    (b"version now\r\n", [bad("this command takes no arguments")]),
    (b"monitor q\r\n", [bad("usage: monitor <queue> <seconds> [max_items]")]),
    (b"monitor q 1 0\r\n", [bad("max_items out of range")]),
    (b"confirm q -1\r\n", [bad("count out of range")]),
    (b"confirm q +1\r\n", [bad("bad count")]),
    (b"flush_all -1\r\n", [bad("delay out of range")]),
    (b"stats a.b\r\n", [bad("bad stats argument name")]),
    # errors that close the connection
    (b"set q 0 0 abc\r\nabc\r\n", [bad("bad command line format", True)]),
    (b"set q 0 0\r\n", [bad("bad command line format", True)]),
    (b"set q 0 0 1 extra\r\na\r\n", [bad("bad command line format", True)]),
    (b"set q 0 0 -1\r\n", [bad("bad command line format", True)]),
    (b"set q 0 0 3\r\nabcd\r\n", [Err("BadDataChunk", b"CLIENT_ERROR bad data chunk\r\n", True)]),
    (b"set q 0 0 70\r\n" + b"z" * 70 + b"XY",
     [Err("TooLarge", b"NOT_STORED\r\n", False),
      Err("BadDataChunk", b"CLIENT_ERROR bad data chunk\r\n", True)]),
    (b"get q/open/peek\r\n", [bad("invalid combination of get options", True)]),
    (b"get q/reject/open\r\n", [bad("reject goes alone", True)]),
    (b"get q/peek/abort\r\n", [bad("invalid combination of get options", True)]),
    (b"get q/abort/close\r\n", [bad("invalid combination of get options", True)]),
    (b"get q/abort/open\r\n", [bad("invalid combination of get options", True)]),
    (b"get q/peek/close\r\n", [bad("invalid combination of get options", True)]),
    (b"get /open\r\n", [bad("bad queue name", True)]),
    (b"get q+/open\r\n", [bad("bad reader name", True)]),
    (b"get q/t=abc\r\n", [bad("bad timeout", True)]),
    (b"get q/t=-1\r\n", [bad("timeout out of range", True)]),
    (b"get q/t=2147483648\r\n", [bad("timeout out of range", True)]),
    (b"get q/bogus\r\n", [bad("unknown get option", True)]),
    (b"get q//open\r\n", [bad("unknown get option", True)]),
    (b"get q/OPEN\r\n", [bad("unknown get option", True)]),
]


@pytest.mark.parametrize(("data", "expected"), TABLE, ids=[repr(d[:30]) for d, _ in TABLE])
def test_table_in_every_chunking(data: bytes, expected: list[object]) -> None:
    assert_every_chunking(make, data, expected)


def test_pipelined_commands_come_out_in_order() -> None:
    assert_pipelined_in_order(make, TABLE, step=7)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_chunking_of_a_valid_stream_gives_the_same_events(data: st.DataObject) -> None:
    assert_any_chunking(make, TABLE, data)


def test_trailing_garbage_waits_for_a_line_end_then_is_an_unknown_command() -> None:
    p = make()
    assert run(p, [b"get q\r\nversion\r\n\x00garb age"]) == [Get("q", "q"), Version()]
    assert p.statistics().buffered_bytes == len(b"\x00garb age")
    assert run(p, [b"\r\nget r\r\n"]) == [UNKNOWN, Get("r", "r")]


def test_end_of_stream() -> None:
    p = make()
    p.receive_data(b"get q\r\nget r")
    p.receive_data(b"")
    assert p.next_event() == Get("q", "q")
    assert p.next_event() == ConnectionClosed(unparsed=5)
    assert p.next_event() == ConnectionClosed(unparsed=5)
    with pytest.raises(errors.LocalProtocolError):
        p.receive_data(b"more")
    q = make()
    q.receive_data(b"set q 0 0 10\r\nabc")
    q.receive_data(b"")
    assert q.next_event() == ConnectionClosed(unparsed=3)


def test_huge_declared_size_is_refused_from_the_header_alone() -> None:
    p = MemcacheParser()  # default cap: 16 MiB
    p.receive_data(b"set q 0 0 %d\r\n" % 2**40)
    with pytest.raises(errors.TooLarge) as info:
        p.next_event()
    assert (info.value.reply, info.value.close) == (b"NOT_STORED\r\n", False)
    assert p.statistics() == wire.ParserStatistics(0, 2**40, False)
    chunk = bytes(65536)
    for _ in range(16):
        p.receive_data(chunk)
        assert p.next_event() is NEED_DATA
        assert p.statistics().buffered_bytes == 0
    assert p.statistics().skipping_bytes == 2**40 - 16 * 65536


def test_absurd_declared_size_is_too_large_not_a_crash() -> None:
    p = make()
    p.receive_data(b"set q 0 0 " + b"9" * 1000 + b"\r\n")
    with pytest.raises(errors.TooLarge):
        p.next_event()


def test_refused_value_is_skipped_without_being_buffered() -> None:
    size = 64 * 1024 * 1024
    p = MemcacheParser(max_item_size=1024)
    tracemalloc.start()
    try:
        p.receive_data(b"set q 0 0 %d\r\n" % size)
        with pytest.raises(errors.TooLarge):
            p.next_event()
        chunk = bytes(256 * 1024)
        tracemalloc.reset_peak()
        for _ in range(size // len(chunk)):
            p.receive_data(chunk)
            assert p.next_event() is NEED_DATA
        p.receive_data(b"\r\nget q\r\n")
        assert p.next_event() == Get("q", "q")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024


def test_value_at_the_cap_is_accepted() -> None:
    p = MemcacheParser(max_item_size=10)
    assert run(p, [b"set q 0 0 10\r\n0123456789\r\n"]) == [Set("q", 0, 0, b"0123456789")]


def test_line_cap() -> None:
    assert run(make(), [b"x" * 2048 + b"\r\n"]) == [UNKNOWN]
    assert run(make(), [b"x" * 2048 + b"\n"]) == [UNKNOWN]
    too_long = Err("LineTooLong", b"CLIENT_ERROR line too long\r\n", True)
    assert run(make(), [b"x" * 2049 + b"\n"]) == [too_long]
    assert run(make(), [b"x" * 2049 + b"\r\n"]) == [too_long]
    # Detected without waiting for a line end that may never come.
    assert run(make(), [b"x" * 2050]) == [too_long]
    assert run(make(), [b"x" * 2049]) == []


def test_a_closing_error_is_final() -> None:
    p = make()
    p.receive_data(b"get q/open/peek\r\nget q\r\n")
    with pytest.raises(errors.BadCommand) as first:
        p.next_event()
    p.receive_data(b"get r\r\n")
    with pytest.raises(errors.BadCommand) as again:
        p.next_event()
    assert again.value is first.value
    assert p.statistics().failed


BAD_NAMES = [b"a.b", b"a~b", b"..", b"a\xffb", b"\xc3\xa9", b"x" * 251, b"a+b+c", b"+b", b"a*"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_client_errors(name: bytes) -> None:
    for line in [b"delete %s", b"flush %s", b"flush_expired %s", b"monitor %s 1", b"confirm %s 1"]:
        [err] = run(make(), [line % name + b"\r\n"])
        assert isinstance(err, Err) and err.kind == "BadCommand" and not err.close
        assert err.reply.startswith(b"CLIENT_ERROR bad ")
    [err, event] = run(make(), [b"set %s 0 0 1\r\nx\r\nversion\r\n" % name])
    assert isinstance(err, Err) and err.reply.startswith(b"CLIENT_ERROR ") and not err.close
    assert event == Version()
    [err] = run(make(), [b"get %s/open\r\n" % name])
    assert isinstance(err, Err) and err.reply.startswith(b"CLIENT_ERROR ") and err.close


def test_longest_name_is_accepted() -> None:
    name = "n" * 250
    assert run(make(), [b"get " + name.encode() + b"\r\n"]) == [Get(name, name)]
    assert wire.is_valid_name(name) and not wire.is_valid_name(name + "n")
    assert not wire.is_valid_name("é") and not wire.is_valid_name("")


GOLDEN: list[tuple[Callable[[], bytes], bytes]] = [
    (mp.stored, b"STORED\r\n"),
    (mp.not_stored, b"NOT_STORED\r\n"),
    (lambda: mp.value("q/t=5/open", 0, b"hi\r\n"), b"VALUE q/t=5/open 0 4\r\nhi\r\n\r\n"),
    (lambda: mp.value("q", 4294967295, b""), b"VALUE q 4294967295 0\r\n\r\n"),
    (mp.end, b"END\r\n"),
    (mp.error, b"ERROR\r\n"),
    (mp.client_error, b"CLIENT_ERROR\r\n"),
    (lambda: mp.client_error("bad data chunk"), b"CLIENT_ERROR bad data chunk\r\n"),
    (lambda: mp.client_error("x\r\nSTORED"), b"CLIENT_ERROR x??STORED\r\n"),
    (lambda: mp.server_error("disk full"), b"SERVER_ERROR disk full\r\n"),
    (mp.server_error, b"SERVER_ERROR\r\n"),
    (mp.deleted, b"DELETED\r\n"),
    (mp.not_found, b"NOT_FOUND\r\n"),
    (mp.ok, b"OK\r\n"),
    (mp.reloaded, b"Reloaded config.\r\n"),
    (lambda: mp.count(12), b"12\r\n"),
    (lambda: mp.version("queued-0.1.0"), b"VERSION queued-0.1.0\r\n"),
    (lambda: mp.stat("uptime", 5), b"STAT uptime 5\r\n"),
    (lambda: mp.stats([("uptime", 5), ("queue_q_items", "2")]),
     b"STAT uptime 5\r\nSTAT queue_q_items 2\r\nEND\r\n"),
    (lambda: mp.stats([]), b"END\r\n"),
    (lambda: mp.dump_stats([("q", [("items", 2), ("bytes", 10)]), ("r", [])]),
     b"queue 'q' {\r\n  items=2\r\n  bytes=10\r\n}\r\nqueue 'r' {\r\n}\r\nEND\r\n"),
]


@pytest.mark.parametrize(("encode", "wire"), GOLDEN)
def test_reply_encoders_golden(encode: Callable[[], bytes], wire: bytes) -> None:
    assert encode() == wire


@pytest.mark.parametrize(
    "encode",
    [
        lambda: mp.value("a b", 0, b""),
        lambda: mp.value("", 0, b""),
        lambda: mp.value("k\r\n", 0, b""),
        lambda: mp.value("k", -1, b""),
        lambda: mp.value("k", 2**32, b""),
        lambda: mp.version("1 2"),
        lambda: mp.stat("a b", 1),
    ],
)
def test_encoders_refuse_what_the_wire_cannot_carry(encode: Callable[[], bytes]) -> None:
    with pytest.raises(errors.LocalProtocolError):
        encode()


def drain_only_events_or_protocol_errors(parser: MemcacheParser, chunks: list[bytes]) -> None:
    for chunk in [*(c for c in chunks if c), b""]:
        parser.receive_data(chunk)
        while True:
            try:
                event = parser.next_event()
            except ProtocolError as e:
                assert isinstance(e.reply, bytes)
                if e.close:
                    return
                continue
            if event is NEED_DATA or isinstance(event, ConnectionClosed):
                break


SOUP = [b"get ", b"set ", b"add ", b"delete ", b"monitor ", b"confirm ", b"flush_all ", b"q",
        b"q+r", b"/t=", b"/open", b"/close", b"/abort", b"/peek", b"/", b" ", b"0", b"5",
        b"-1", b"99999999999999999999999", b" noreply", b"\r\n", b"\n", b"\r", b"\xff", b"x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_random_bytes_only_produce_events_or_protocol_errors(chunks: list[bytes]) -> None:
    drain_only_events_or_protocol_errors(MemcacheParser(max_line=32, max_item_size=16), chunks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(SOUP), max_size=12).map(b"".join), max_size=8))
def test_token_soup_only_produces_events_or_protocol_errors(chunks: list[bytes]) -> None:
    drain_only_events_or_protocol_errors(MemcacheParser(max_line=40, max_item_size=8), chunks)


class FakeSocket:
    """An in-memory socket: bytes sent go through MemcacheParser to a dict of lists."""

    def __init__(self) -> None:
        self.parser = MemcacheParser()
        self.queues: dict[str, list[bytes]] = {}
        self.outbox = bytearray()

    def settimeout(self, timeout: float | None) -> None:
        pass

    def connect(self, address: object) -> None:
        pass

    def close(self) -> None:
        pass

    def recv(self, size: int) -> bytes:
        data = bytes(self.outbox[:size])
        del self.outbox[:size]
        return data

    def sendall(self, data: bytes) -> None:
        self.parser.receive_data(data)
        while True:
            try:
                event = self.parser.next_event()
            except ProtocolError as e:
                self.outbox += e.reply
                continue
            if event is NEED_DATA:
                return
            self.outbox += self.answer(event)

    def answer(self, event: object) -> bytes:
        if isinstance(event, Set):
            self.queues.setdefault(event.queue, []).append(event.data)
            return b"" if event.noreply else mp.stored()
        if isinstance(event, Get):
            items = self.queues.get(event.queue)
            if not items:
                return mp.end()
            return mp.value(event.key, 0, items[0] if event.peek else items.pop(0)) + mp.end()
        if isinstance(event, Delete):
            found = self.queues.pop(event.queue, None) is not None
            return b"" if event.noreply else mp.deleted() if found else mp.not_found()
        if isinstance(event, FlushAll):
            self.queues.clear()
            return b"" if event.noreply else mp.ok()
        if isinstance(event, Version):
            return mp.version("test-1.0")
        if isinstance(event, Stats):
            return mp.stats([("curr_items", sum(map(len, self.queues.values())))])
        raise AssertionError(event)


def test_pymemcache_speaks_to_the_parser_and_understands_the_replies() -> None:
    from pymemcache.client.base import Client
    from pymemcache.exceptions import MemcacheClientError

    fake = FakeSocket()

    class FakeSocketModule:
        AF_UNIX = 1
        SOCK_STREAM = 1

        @staticmethod
        def socket(family: int, kind: int) -> FakeSocket:
            return fake

    client = Client("/fake.sock", socket_module=FakeSocketModule, default_noreply=False)
    assert client.set("q", b"hello") is True
    assert client.set("q", b"world", noreply=True) is True
    assert client.get("q/peek") == b"hello"
    assert client.get("q/t=10/open") == b"hello"
    assert client.get("q") == b"world"
    assert client.get("q") is None
    assert client.set("r", b"\r\nEND\r\n") is True
    assert client.get("r") == b"\r\nEND\r\n"
    assert client.stats() == {b"curr_items": 0}
    with pytest.raises(MemcacheClientError):
        client.get_many(["a", "b"])
    assert client.version() == b"test-1.0"
    assert client.set("q", b"x") is True
    assert client.delete("q") is True
    assert client.delete("q") is False
    assert client.flush_all() is True


# -- the fast path for `get <q>`, `get <q>/<options>` and `set <q> <f> <e> <n>` agrees with the
# general one (and so does a line served from the parser's cache the second time) ------------


@pytest.mark.parametrize(
    "line",
    [
        b"set q 0 0 3", b"set q 4294967295 0 3", b"set q 4294967296 0 3", b"set q 0 999999 3",
        b"set q 1 2 3 noreply", b"set q 0 -1 3", b"SET q 0 0 3", b"set  q 0 0 3",
        b"get q", b"get q/open", b"get q+r", b"GET q", b"get a.b", b"set a.b 0 0 3",
        b"get q/close/open", b"get q+r/t=100/open", b"get q/abort/delay=5", b"get q/peek/open",
        b"get q/bogus", b"get q/t=x", b"get q/open x", b"get  q/open", b"get q/t=99999999999",
        b"get ../q/open", b"get q/\xff",
    ],
)
def test_fast_path_matches_the_general_path(line: bytes) -> None:
    stream = line + b"\r\nabc\r\nget z\r\n"
    fast = run(make(), [stream])
    twice = run(make(), [stream + stream])  # the second time from the line cache
    closed = bool(fast) and isinstance(fast[-1], Err) and fast[-1].close
    assert twice == (fast if closed else fast + fast)
    parser = make()
    parser._fast = lambda _line: None  # type: ignore[method-assign]
    slow = run(parser, [stream])
    assert fast == slow
    byte_by_byte = run(make(), [stream[i : i + 1] for i in range(len(stream))])
    assert byte_by_byte == slow


def test_parsers_share_the_line_cache_of_their_item_cap() -> None:
    """One cache per item cap, shared by the server's connections: a line one parser
    parsed is a lookup for the next, and a set a smaller cap refuses is not taken from a
    cache filled under a larger cap."""
    line = b"set shared_line_q 0 0 40"
    stream = line + b"\r\n" + b"x" * 40 + b"\r\n"
    roomy, other = (MemcacheParser(max_item_size=4096) for _ in range(2))
    assert roomy._lines is other._lines
    assert run(roomy, [stream]) == [Set("shared_line_q", 0, 0, b"x" * 40)]
    assert line in other._lines  # parsed once, for both
    assert run(other, [stream]) == [Set("shared_line_q", 0, 0, b"x" * 40)]
    small = MemcacheParser(max_item_size=16)
    assert small._lines is not roomy._lines
    assert run(small, [stream]) == [Err("TooLarge", b"NOT_STORED\r\n", False)]
    assert line not in small._lines


def test_the_shared_line_cache_stays_bounded() -> None:
    p = MemcacheParser(max_item_size=777)
    for i in range(mp.LINE_CACHE + 10):
        assert run(p, [b"get bounded_%d\r\n" % i]) == [Get(f"bounded_{i}", f"bounded_{i}")]
        assert 0 < len(p._lines) <= mp.LINE_CACHE
    assert len(p._lines) == 10  # it started again once full
