"""Helpers for the tests of the protocols' parsers and command tables (queued.wire): the
limits a session gives its codec, every request a codec decodes from some bytes, a
parser's events from a stream cut into chunks (every chunking of a table's rows), and the
checks of a parser's table that the memcache and text parsers' tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from queued.errors import ProtocolError
from queued.wire import commands as c
from queued.wire.parsing import NEED_DATA, ConnectionClosed

LIMITS = c.Limits(max_line=2048, max_item_size=1 << 20, max_frame=1 << 20, max_batch=1000)


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


@dataclass(frozen=True)
class Err:
    """A parser's protocol error as an event: its class name, reply and whether it closes."""

    kind: str
    reply: bytes
    close: bool


def run(parser: Any, chunks: Iterable[bytes], *, raw_errors: bool = False) -> list[object]:
    """Feeds chunks, draining events after each; stops after a closing error. A protocol
    error is an Err, or itself with `raw_errors`."""
    out: list[object] = []
    for chunk in chunks:
        parser.receive_data(chunk)
        while True:
            try:
                event = parser.next_event()
            except ProtocolError as e:
                out.append(e if raw_errors else Err(type(e).__name__, e.reply, e.close))
                if e.close:
                    return out
                continue
            if event is NEED_DATA:
                break
            out.append(event)
            if isinstance(event, ConnectionClosed):
                return out
    return out


def chunkings(data: bytes) -> Iterable[list[bytes]]:
    """The data whole, byte by byte, and cut in two at every place."""
    yield [data]
    yield [data[i : i + 1] for i in range(len(data))]
    for i in range(1, len(data)):
        yield [data[:i], data[i:]]


Table = Sequence[tuple[bytes, list[object]]]


def kept_rows(table: Table) -> list[tuple[bytes, list[object]]]:
    """The rows whose input leaves the parser open (they may be sent one after another)."""
    return [(d, e) for d, e in table if not any(isinstance(x, Err) and x.close for x in e)]


def cut(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`stream` cut at the sorted offsets `cuts` (no empty chunk: b"" means its end)."""
    bounds = zip([0, *cuts], [*cuts, len(stream)], strict=True)
    return [stream[a:b] for a, b in bounds if a < b]


# -- the table checks every parser's tests make (memcache, text) ------------------------------


def assert_every_chunking(parser: Callable[[], Any], data: bytes, expected: list[object]) -> None:
    """One table row: a new parser gives `expected` for `data` in every chunking."""
    for chunks in chunkings(data):
        assert run(parser(), chunks) == expected, chunks


def assert_pipelined_in_order(parser: Callable[[], Any], table: Table, step: int) -> None:
    """The kept rows sent one after another, whole and cut every `step` bytes: each row's
    events, in order."""
    keep = kept_rows(table)
    stream = b"".join(d for d, _ in keep)
    expected = [x for _, e in keep for x in e]
    assert run(parser(), [stream]) == expected
    assert run(parser(), [stream[i : i + step] for i in range(0, len(stream), step)]) == expected


def assert_any_chunking(parser: Callable[[], Any], table: Table, data: st.DataObject) -> None:
    """Up to 12 kept rows drawn from the table, sent as one stream cut at up to 10 drawn
    places: the rows' events, in order."""
    picked = data.draw(st.lists(st.sampled_from(kept_rows(table)), max_size=12))
    stream = b"".join(d for d, _ in picked)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    assert run(parser(), cut(stream, cuts)) == [x for _, e in picked for x in e]
