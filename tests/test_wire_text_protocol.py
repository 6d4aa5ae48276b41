"""The text protocol parser and encoders: tables fed in every chunking, caps, garbage."""

from __future__ import annotations

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

from queued.errors import LineTooLong, LocalProtocolError, ProtocolError, TooLarge
from queued.wire import text_protocol as tp
from queued.wire.parsing import NEED_DATA, ConnectionClosed
from queued.wire.text_protocol import (
    Confirm,
    Delete,
    Flush,
    Get,
    Monitor,
    Pause,
    Peek,
    Put,
    Quit,
    Shutdown,
    TextParser,
    Touch,
    Version,
)


def make() -> TextParser:
    return TextParser(max_line=64, max_item_size=32, max_put_items=3, max_put_bytes=40)


def bad(msg: str) -> Err:
    return Err("BadCommand", b"-" + msg.encode() + b"\n", False)


TABLE: list[tuple[bytes, list[object]]] = [
    (b"put q:\nhello\nworld\n\n", [Put("q", (b"hello", b"world"))]),
    (b"put q 500:\r\na b\r\n\r\n", [Put("q", (b"a b",), 500)]),
    (b"PUT q:\n\n", [Put("q", ())]),
    (b"put q :\n\xff\x00\n\n", [Put("q", (b"\xff\x00",))]),
    (b"put q:\n  \n\n", [Put("q", (b"  ",))]),
    (b"get q\n", [Get("q")]),
    (b"get q 100\r\n", [Get("q", 100)]),
    (b"get q+r\n", [Get("q", 0, "r")]),
    (b"get q:\n", [Get("q:")]),
    (b"peek q\n", [Peek("q")]),
    (b"peek q+r 5\n", [Peek("q", 5, "r")]),
    (b"monitor q 1000\n", [Monitor("q", 1000)]),
    (b"monitor q 1000 10\n", [Monitor("q", 1000, 10)]),
    (b"confirm q 2\n", [Confirm("q", 2)]),
    (b"flush q\n", [Flush("q")]),
    (b"delete q+r\n", [Delete("q", "r")]),
    (b"version\n", [Version()]),
    (b"shutdown\n", [Shutdown()]),
    (b"quit\n", [Quit()]),
    (b"\n\r\n  \nversion\n", [Version()]),
    (b"get q deliveries\n", [Get("q", deliveries=True)]),
    (b"get q 250 deliveries\n", [Get("q", 250, deliveries=True)]),
    (b"get deliveries\n", [Get("deliveries")]),  # a queue of that name
    (b"get deliveries deliveries\n", [Get("deliveries", deliveries=True)]),
    (b"touch q+r 3000\n", [Touch("q", 3000, "r")]),
    (b"pause q\n", [Pause("q")]),
    (b"resume q\n", [Pause("q", False)]),
    (b"touch q\n", [bad("Usage: touch <queue> <ms>")]),
    (b"pause q+r\n", [bad("cannot write to a fanout reader; write to its queue")]),
    # errors that keep the connection
    (b"foo\n", [Err("UnknownCommand", b"-Unknown command: foo\n", False)]),
    (b"\xff\x01\n", [Err("UnknownCommand", b"-Unknown command: ??\n", False)]),
    (b"put q\nget q\n",
     [bad("A put needs a trailing ':' and its items on the next lines."), Get("q")]),
    (b"put:\nx\n\nget q\n",
     [bad("Usage: put <queue> [expiry_ms] [delay=<ms>] [key=<k>]:"), Get("q")]),
    # deduplication keys: `key=<k>` among the options after the queue and expiry
    (b"put q key=batch-1:\na\nb\n\n", [Put("q", (b"a", b"b"), key=b"batch-1")]),
    (b"put q 500 delay=7 key=k:\na\n\n", [Put("q", (b"a",), 500, 7, b"k")]),
    (b"put q key=k delay=7:\na\n\n", [Put("q", (b"a",), None, 7, b"k")]),
    (b"put q key=:\na\n\nget q\n",
     [bad("deduplication key must be 1 to 64 characters"), Get("q")]),
    (b"put q key=a/b:\na\n\n", [bad("deduplication key must be printable ASCII without '/'")]),
    (b"put q key=a key=b:\na\n\n", [bad("unknown or repeated put option (delay=<ms>, key=<k>)")]),
    (b"put q colour=red:\na\n\n", [bad("unknown or repeated put option (delay=<ms>, key=<k>)")]),
    (b"put q+r:\nx\n\n", [bad("cannot write to a fanout reader; write to its queue")]),
    (b"put q abc:\nx\ny\n\nversion\n", [bad("bad expiry"), Version()]),
    (b"put q.x:\nx\n\n", [bad("bad queue name")]),
    (b"get\n", [bad("Usage: get <queue> [timeout_ms]")]),
    (b"get q x\n", [bad("bad timeout")]),
    (b"get q -5\n", [bad("timeout out of range")]),
    (b"get a.b\n", [bad("bad queue name")]),
    (b"peek a b c\n", [bad("Usage: peek <queue> [timeout_ms]")]),
    (b"monitor q\n", [bad("Usage: monitor <queue> <timeout_ms> [max_items]")]),
    (b"confirm q\n", [bad("Usage: confirm <queue> <count>")]),
    (b"confirm q x\n", [bad("bad count")]),
    (b"flush\n", [bad("Usage: flush <queue>")]),
    (b"delete a b\n", [bad("Usage: delete <queue>")]),
    (b"version x\n", [bad("Usage: version")]),
    (b"put q:\na\nb\nc\nd\ne\n\nget q\n",
     [Err("TooLarge", b"-Too many items in one put (max 3).\n", False), Get("q")]),
    (b"put q:\n" + b"x" * 30 + b"\n" + b"y" * 30 + b"\n\nget q\n",
     [Err("TooLarge", b"-Put larger than 40 bytes.\n", False), Get("q")]),
    # errors that close the connection
    (b"put q:\n" + b"x" * 33 + b"\n\n", [Err("LineTooLong", b"-Line too long.\n", True)]),
    (b"get " + b"q" * 61 + b"\n", [Err("LineTooLong", b"-Line too long.\n", True)]),
]


@pytest.mark.parametrize(("data", "expected"), TABLE, ids=[repr(d[:30]) for d, _ in TABLE])
def test_table_in_every_chunking(data: bytes, expected: list[object]) -> None:
    assert_every_chunking(make, data, expected)


def test_pipelined_commands_come_out_in_order() -> None:
    assert_pipelined_in_order(make, TABLE, step=5)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_chunking_of_a_valid_stream_gives_the_same_events(data: st.DataObject) -> None:
    assert_any_chunking(make, TABLE, data)


def test_trailing_garbage_waits_for_a_line_end() -> None:
    p = make()
    assert run(p, [b"get q\nput q:\nab\n\x00garbage"]) == [Get("q")]
    p.receive_data(b"")
    assert p.next_event() == ConnectionClosed(unparsed=2 + len(b"\x00garbage"))
    with pytest.raises(LocalProtocolError):
        p.receive_data(b"x")


def test_a_put_needs_its_blank_line() -> None:
    p = make()
    assert run(p, [b"put q:\na\nb\n"]) == []
    assert run(p, [b"\n"]) == [Put("q", (b"a", b"b"))]


def test_item_at_the_cap_is_accepted() -> None:
    assert run(make(), [b"put q:\n" + b"x" * 32 + b"\n\n"]) == [Put("q", (b"x" * 32,))]


def test_over_long_line_is_detected_without_its_line_end() -> None:
    p = make()
    p.receive_data(b"g" * 66)
    with pytest.raises(LineTooLong):
        p.next_event()
    with pytest.raises(LineTooLong):  # final: every later call says the same
        p.next_event()
    assert p.statistics().failed


def test_refused_put_does_not_keep_its_items() -> None:
    p = make()
    p.receive_data(b"put q:\na\nb\nc\nd\n")
    with pytest.raises(TooLarge):
        p.next_event()
    for _ in range(100):
        p.receive_data(b"more\n")
        assert p.next_event() is NEED_DATA
        assert p.statistics().buffered_bytes == 0


@pytest.mark.parametrize("name", [b"a.b", b"a~b", b"..", b"a\xffb", b"x" * 251, b"a+b+c", b"+b"])
def test_bad_names(name: bytes) -> None:
    p = TextParser()
    for line in [b"get %s", b"peek %s", b"flush %s", b"delete %s", b"confirm %s 1"]:
        [err] = run(p, [line % name + b"\n"])
        assert isinstance(err, Err) and err.reply.startswith(b"-bad ") and not err.close
    [err, event] = run(p, [b"put %s:\nitem\n\nversion\n" % name])
    assert isinstance(err, Err) and not err.close and event == Version()


GOLDEN: list[tuple[Callable[[], bytes], bytes]] = [
    (lambda: tp.item(b"hello"), b":hello\n"),
    (lambda: tp.item(b""), b":\n"),
    (tp.empty, b"*\n"),
    (lambda: tp.count(3), b"+3\n"),
    (lambda: tp.error("Not that many transactions open."),
     b"-Not that many transactions open.\n"),
    (lambda: tp.error("x\n+1"), b"-x?+1\n"),
    (lambda: tp.version("0.1.0"), b":0.1.0\n"),
]


@pytest.mark.parametrize(("encode", "wire"), GOLDEN)
def test_reply_encoders_golden(encode: Callable[[], bytes], wire: bytes) -> None:
    assert encode() == wire


def test_an_item_with_a_newline_cannot_be_sent() -> None:
    with pytest.raises(LocalProtocolError):
        tp.item(b"two\nlines")


def drain_only_events_or_protocol_errors(parser: TextParser, chunks: list[bytes]) -> None:
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


SOUP = [b"put ", b"get ", b"peek ", b"monitor ", b"confirm ", b"q", b"q+r", b":", b" ", b"0",
        b"-1", b"99999999999999999999999", b"\n", b"\r\n", b"\r", b"\xff", b"x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_random_bytes_only_produce_events_or_protocol_errors(chunks: list[bytes]) -> None:
    drain_only_events_or_protocol_errors(make(), chunks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(SOUP), max_size=12).map(b"".join), max_size=8))
def test_token_soup_only_produces_events_or_protocol_errors(chunks: list[bytes]) -> None:
    drain_only_events_or_protocol_errors(make(), chunks)
