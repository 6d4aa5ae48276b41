"""What every protocol's parser shares (queued.wire.parsing), pure: the receive buffer's
lines, blocks and exact reads in any chunking with its cap, names and fanout addresses,
integers without int()'s leniency, and the line parser's sticky failure. Each protocol's
own parser: test_wire_memcache_protocol.py, test_wire_text_protocol.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from compiled_util import not_compiled
from hypothesis import given
from hypothesis import strategies as st

from queued.errors import BadCommand, LocalProtocolError, ProtocolError
from queued.sansio import NEED_DATA, NeedData
from queued.wire import parsing as wire


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(st.binary(max_size=30).filter(lambda b: b"\n" not in b), max_size=8),
       st.lists(st.integers(0, 400), max_size=10), st.booleans())
def test_lines_come_out_whole_whatever_the_chunking(lines: list[bytes], cuts: list[int],
                                                    crlf: bool) -> None:
    end = b"\r\n" if crlf else b"\n"
    data = b"".join(line + end for line in lines)
    buf = wire.ReceiveBuffer()
    got: list[bytes] = []
    for chunk in chunked(data, cuts):
        buf.append(chunk)
        while (line := buf.take_line(64)) is not None:
            got.append(line)
    # a line's own trailing \r is taken as part of a CRLF end: compare what survives that
    assert got == [line[:-1] if not crlf and line.endswith(b"\r") else line for line in lines]
    assert len(buf) == 0


def test_a_line_over_the_cap_is_refused_before_its_end_arrives() -> None:
    buf = wire.ReceiveBuffer()
    buf.append(b"x" * 10)
    assert buf.take_line(10) is None  # 10 bytes may still end in CRLF
    buf.append(b"xx")
    with pytest.raises(wire.LineOverflow):
        buf.take_line(10)
    ok = wire.ReceiveBuffer()
    ok.append(b"y" * 10 + b"\r\n")
    assert ok.take_line(10) == b"y" * 10  # exactly at the cap


def test_blocks_and_exact_reads_consume_only_what_they_return() -> None:
    buf = wire.ReceiveBuffer()
    buf.append(b"abc\r")
    assert buf.take_block(3) is None and len(buf) == 4  # no CRLF yet: nothing consumed
    buf.append(b"\nde!!")
    assert buf.take_block(3) == b"abc"
    assert buf.take_block(1) is None and len(buf) == 4  # "e!" is not a CRLF
    assert buf.peek(0, 2) == b"de" and len(buf) == 4
    assert buf.take(5) is None and buf.take(2) == b"de"
    assert buf.skip(10) == 2 and len(buf) == 0


class _Model:
    """What a receive buffer must do, as plain slicing of everything received."""

    def __init__(self) -> None:
        self.data = b""

    def take_line(self, limit: int) -> bytes | None:
        i = self.data.find(b"\n", 0, limit + 2)
        if i < 0:
            if len(self.data) >= limit + 2:
                raise wire.LineOverflow("too long")
            return None
        line, self.data = self.data[:i], self.data[i + 1:]  # (consumed, even if too long)
        line = line[:-1] if line.endswith(b"\r") else line
        if len(line) > limit:
            raise wire.LineOverflow("too long")
        return line

    def take(self, n: int) -> bytes | None:
        if len(self.data) < n:
            return None
        out, self.data = self.data[:n], self.data[n:]
        return out

    def take_block(self, n: int) -> bytes | None:
        if len(self.data) < n + 2 or self.data[n:n + 2] != b"\r\n":
            return None
        out, self.data = self.data[:n], self.data[n + 2:]
        return out

    def skip(self, n: int) -> int:
        n = min(n, len(self.data))
        self.data = self.data[n:]
        return n


def _outcome(take: Callable[[int], bytes | None], limit: int) -> object:
    try:
        return take(limit)
    except wire.LineOverflow:
        return wire.LineOverflow


_OPS = st.lists(st.tuples(st.sampled_from(["line", "take", "block", "peek", "skip"]),
                          st.integers(0, 40)), max_size=30)


@given(st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"\r\n")),
       st.lists(st.integers(0, 400), max_size=12), _OPS,
       st.sampled_from([bytes, bytearray, memoryview]))
def test_every_read_agrees_with_plain_slicing_whatever_the_chunking(
        data: bytes, cuts: list[int], ops: list[tuple[str, int]], kind: type) -> None:
    """Chunks appended (as bytes, bytearray or memoryview) while some bytes are still
    unread wait apart and are joined on demand: every line, block, exact read, peek and
    skip still returns what slicing the whole stream would, and the length agrees."""
    buf, model = wire.ReceiveBuffer(), _Model()
    chunks = chunked(data, cuts)
    steps = iter(ops)
    for chunk in chunks:
        buf.append(kind(chunk))
        buf.append(kind(b""))  # (an empty chunk changes nothing)
        model.data += chunk
        for op, n in itertools.islice(steps, 3):
            if op == "line":
                assert _outcome(buf.take_line, n) == _outcome(model.take_line, n)
            elif op == "take":
                assert buf.take(n) == model.take(n)
            elif op == "block":
                assert buf.take_block(n) == model.take_block(n)
            elif op == "peek":
                assert buf.peek(n // 2, n) == model.data[n // 2:n]
            else:
                assert buf.skip(n) == model.skip(n)
            assert len(buf) == len(model.data)
    assert buf.take(len(model.data)) == model.data


@given(st.lists(st.tuples(st.booleans(), st.binary(max_size=40), st.booleans()), max_size=10),
       st.lists(st.integers(0, 500), max_size=15))
def test_lines_and_blocks_read_as_a_parser_does_whatever_the_chunking(
        records: list[tuple[bool, bytes, bool]], cuts: list[int]) -> None:
    """A stream of lines and data blocks (CRLF after each), read in order as the memcache
    parser reads it: a line with take_line; a block with take_block, or as its DATA state
    does (peek at the CRLF, take, skip 2); each retried after every received chunk."""
    want = [data.replace(b"\n", b"") if is_line else data for is_line, data, _ in records]
    stream = b"".join(w + b"\r\n" for w in want)
    buf = wire.ReceiveBuffer()
    got: list[bytes] = []
    for chunk in chunked(stream, cuts):
        buf.append(chunk)
        while len(got) < len(records):
            is_line, _, by_parts = records[len(got)]
            size = len(want[len(got)])
            if is_line:
                out = buf.take_line(64)
            elif not by_parts:
                out = buf.take_block(size)
            elif len(buf) < size + 2:
                out = None
            else:
                assert buf.peek(size, size + 2) == b"\r\n"
                out = buf.take(size)
                assert buf.skip(2) == 2
            if out is None:
                break
            got.append(out)
    assert got == want and len(buf) == 0


@pytest.mark.parametrize(("token", "want"), [
    (b"q", ("q", None)), (b"jobs:high-1_x", ("jobs:high-1_x", None)), (b"q+r", ("q", "r")),
])
def test_addresses_are_a_queue_and_maybe_a_fanout_reader(token: bytes,
                                                         want: tuple[str, str | None]) -> None:
    assert wire.parse_address(token) == want


@pytest.mark.parametrize("token", [b"", b"q+", b"+r", b"q+r+s", b"a/b", b"q r", b"\xc3\xa9",
                                   b"x" * 251])
def test_bad_addresses_are_argument_errors(token: bytes) -> None:
    with pytest.raises(wire.ArgumentError):
        wire.parse_address(token)


def test_a_write_to_a_fanout_reader_is_refused() -> None:
    assert wire.parse_queue(b"q") == "q"
    with pytest.raises(wire.ArgumentError, match="fanout reader"):
        wire.parse_queue(b"q+r")


@given(st.integers(-(10**25), 10**25))
def test_integers_in_range_parse_and_others_are_refused(n: int) -> None:
    token = str(n).encode()
    if 0 <= n <= 10**6:
        assert wire.parse_int(token, "count", 0, 10**6) == n
    else:
        with pytest.raises(wire.ArgumentError):
            wire.parse_int(token, "count", 0, 10**6)


@pytest.mark.parametrize("token", [b"1_000", b"+5", b" 5", b"5 ", b"\xd9\xa3", b"0x10", b"",
                                   b"1" * 4300])
def test_integers_are_plain_decimals_only(token: bytes) -> None:
    with pytest.raises(wire.ArgumentError):
        wire.parse_int(token, "count", 0, 2**63)


#: Words subclasses LineParser in Python, which a compiled LineParser does not allow.
PURE_LINE_PARSER = not_compiled("an interpreted subclass of LineParser")


class Words(wire.LineParser[bytes]):
    """A line protocol for the test: each line is an event; "bad" closes the connection."""

    def _next(self) -> bytes | wire.ConnectionClosed | NeedData:
        line = self.buffer.take_line(100)
        if line is None:
            return wire.ConnectionClosed() if self.buffer.eof else NEED_DATA
        if line == b"bad":
            raise BadCommand("bad line", reply=b"ERROR\r\n", close=True)
        return line


@PURE_LINE_PARSER
def test_a_closing_failure_is_sticky_and_later_bytes_are_dropped() -> None:
    p = Words()
    p.receive_data(b"one\nbad\ntwo\n")
    assert p.next_event() == b"one"
    with pytest.raises(ProtocolError) as first:
        p.next_event()
    left = len(p.buffer)
    p.receive_data(b"three\n")
    assert len(p.buffer) == left  # dropped: nothing after a closing failure is parsed
    with pytest.raises(ProtocolError) as again:
        p.next_event()
    assert again.value is first.value


@PURE_LINE_PARSER
def test_end_of_stream_is_fed_once() -> None:
    p = Words()
    p.receive_data(b"last\n")
    p.receive_data(b"")
    assert p.next_event() == b"last"
    assert isinstance(p.next_event(), wire.ConnectionClosed)
    with pytest.raises(LocalProtocolError):
        p.receive_data(b"more")
