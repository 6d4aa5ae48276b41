"""Item headers in bytes (queued.journal.headers) and the HEADERS record (extension kind 7):
the rule and its limits, the block's round trip, a journal of every kind of item decoded
whole, a byte at a time and by the batch fast path, malformed records, and what a put
without headers costs (nothing). Every path an item takes with its headers through a
server: test_headers.py.
"""

from __future__ import annotations

import sys

import pytest
from compiled_util import not_compiled
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_util import T0, data_for

from queued.errors import CorruptRecordError
from queued.journal import format as jf
from queued.journal.headers import ENTRY, decode_headers, encode_headers, header_pairs
from queued.sansio import MAX_HEADERS, MAX_HEADERS_SIZE, header_entries

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE = {"traceparent": TRACEPARENT, "tracestate": b"vendor=\x00\xff"}


# -- the rule and the block (pure) -----------------------------------------------------------


def test_the_rule_limits_and_types() -> None:
    assert header_entries({"a": "é", "b": b"\x00"}) == [("a", "é".encode(), True),
                                                      ("b", b"\x00", False)]
    assert len(header_entries({f"k{i}": b"" for i in range(MAX_HEADERS)})) == MAX_HEADERS
    fits = {"k": "v" * (MAX_HEADERS_SIZE - 1)}
    assert encode_headers(fits)
    for bad, why in [
        ({f"k{i}": b"" for i in range(MAX_HEADERS + 1)}, "65 headers, over the limit of 64"),
        ({"k": "v" * MAX_HEADERS_SIZE}, "16384 bytes"),
        ({"k": "é" * (MAX_HEADERS_SIZE // 2)}, "16384 bytes"),  # UTF-8 bytes count
        ({1: b"x"}, "keys must be non-empty strings"),
        ({b"k": b"x"}, "keys must be non-empty strings"),
        ({"": b"x"}, "keys must be non-empty strings"),
        ({"k": 1}, "values must be bytes or strings"),
        ({"k": None}, "values must be bytes or strings"),
        ({"k": "\ud800"}, "not valid UTF-8"),
        ([("k", b"v")], "headers must be a map"),
    ]:
        with pytest.raises(ValueError, match=why):
            encode_headers(bad)  # type: ignore[arg-type]
    assert encode_headers(None) == encode_headers({}) == b""


header_values = st.one_of(st.binary(max_size=40), st.text(max_size=20))
header_maps = st.dictionaries(st.text(min_size=1, max_size=12), header_values, max_size=8)


@given(header_maps)
def test_the_block_round_trips(headers: dict[str, bytes | str]) -> None:
    block = encode_headers(headers)
    assert decode_headers(block) == headers
    assert list(decode_headers(block)) == list(headers)  # in order
    assert header_pairs(block) == [(k, v.encode() if isinstance(v, str) else v)
                                   for k, v in headers.items()]
    assert len(block) == sum(5 + len(k.encode()) + len(v.encode() if isinstance(v, str) else v)
                             for k, v in headers.items())


def put_of(kind: int, xid: int, block: bytes) -> jf.Put:
    """Item `xid` as a Put of one of the shapes an item takes in a journal."""
    data, added = data_for(xid), T0 + xid
    if kind == 0:
        return jf.Put(xid, data, added)
    if kind == 1:
        return jf.Put(xid, data, added, None, 0, 7)
    if kind == 2:
        return jf.DelayedPut(xid, data, added, T0 + 10**6, 2, 0, T0 + 5000, block)
    if kind == 3:
        return jf.HeadedPut(xid, data, added, None, 0, 0, block)
    return jf.HeadedPut(xid, data, added, T0 + 10**6, 1, 2**32 - 1, block)


def sealed_file(batches: list[list[jf.Put]]) -> bytes:
    blob = jf.WRITER_MAGIC + jf.EMPTY_CHECK
    for batch in batches:
        blob += jf.seal(b"".join(map(jf.encode_put, batch)), len(blob))
    return blob


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 4), header_maps.filter(bool)), min_size=1,
                         max_size=6), min_size=1, max_size=4))
def test_a_journal_of_every_kind_of_item_decodes_the_same_every_way(
        shape: list[list[tuple[int, dict[str, bytes | str]]]]) -> None:
    xid, batches = 0, []
    for batch in shape:
        out = []
        for kind, headers in batch:
            xid += 1
            out.append(put_of(kind, xid, encode_headers(headers)))
        batches.append(out)
    sent = [p for b in batches for p in b]
    blob = sealed_file(batches)
    whole = [d.record for d in jf.decode_all(blob) if isinstance(d.record, jf.Put)]
    assert whole == sent and [type(p) for p in whole] == [type(p) for p in sent]
    dec = jf.RecordDecoder()
    one_by_one: list[jf.Put] = []
    for i in range(len(blob) + 1):
        dec.receive_data(blob[i:i + 1])  # (the last is b"": the end)
        while isinstance(ev := dec.next_event(), jf.Decoded):
            if isinstance(ev.record, jf.Put):
                one_by_one.append(ev.record)
    assert one_by_one == sent
    # The batch fast path: each PUT's block noted under its offset, counts as sent.
    dec = jf.RecordDecoder()
    dec.receive_data(blob)
    dec.receive_data(b"")
    offsets: list[int] = []
    blocks: dict[int, bytes] = {}
    counts = []
    while isinstance(ev := dec.next_batch(offsets, None, None, blocks), jf.Batch):
        counts.append(ev.count)
    assert counts == [0] + [len(b) for b in batches]
    assert [blocks.get(off, b"") for off in offsets] == [p.headers for p in sent]


def test_malformed_headers_records_are_corrupt() -> None:
    block = encode_headers(TRACE)
    lead = jf.headers_record(block)
    put = jf.encode_put(jf.Put(1, b"x", T0))
    cases = [
        lead + jf.encode_read_head(jf.ReadHead(1)),  # leads no PUT
        jf.flags_record(3) + lead + put,  # after the FLAGS record: the order is fixed
        jf.headers_record(ENTRY.pack(0, 200, 1) + b"kv") + put,  # its block does not add up
        jf.headers_record(ENTRY.pack(1, 1, 1) + b"k\xff") + put,  # a string, not UTF-8
        jf.EXT_HEAD_STRUCT.pack(jf.EXT_BYTE, 0, jf.EXT_HEADERS) + put,  # no kind byte
    ]
    for body in cases:
        blob = jf.WRITER_MAGIC + jf.EMPTY_CHECK + jf.seal(body, 18)
        with pytest.raises(CorruptRecordError):
            jf.decode_all(blob)
    # (a torn HEADERS record at the end is a torn tail, not corruption)
    dec = jf.RecordDecoder()
    dec.receive_data(jf.WRITER_MAGIC + jf.EMPTY_CHECK + (lead + put)[:20])
    dec.receive_data(b"")
    while isinstance(ev := dec.next_event(), jf.Decoded):
        pass
    assert isinstance(ev, jf.TornTail)


@not_compiled("a compiled Put has no __slots__ and is 8 B larger: mypyc's vtable "
              "pointer (docs/development.md)")
def test_a_put_without_headers_costs_nothing() -> None:
    """No slot (Put's size is what six slots take), no byte (the same PUT record)."""
    plain = jf.Put(1, b"x", T0)
    assert "headers" not in jf.Put.__slots__ and len(jf.Put.__slots__) == 6
    assert sys.getsizeof(plain) == sys.getsizeof(jf.Put.__new__(jf.Put)) <= 80
    # a HeadedPut (7 slots) and a DelayedPut with headers (8) share one size class
    assert sys.getsizeof(jf.HeadedPut(1, b"x", T0)) <= sys.getsizeof(jf.DelayedPut(1, b"x", T0))
    assert jf.encode_put(plain) == jf.PUT_STRUCT.pack(jf.PUT_BYTE, 1, 0, 1, T0) + b"x"
    block = encode_headers(TRACE)
    headed = jf.HeadedPut(1, b"x", T0, None, 0, 0, block)
    assert jf.encode_put(headed) == jf.headers_record(block) + jf.encode_put(plain)
    assert plain.headers == b"" and headed.headers == block
