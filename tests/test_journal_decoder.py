"""The journal decoder (queued.journal.decoder, through queued.journal.format): codec
properties, torn tails, damage handling, check records tied to their offsets, files from
another implementation of the seed, structural errors.

Properties follow h11's habit: whole, any chunking, one byte at a time, and garbage in
must give only our own errors. The goldens of each record's bytes: test_journal_records.py;
file names: test_journal_names.py.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from journal_bytes_util import (
    CHECK_LEN,
    EMPTY_CHECK,
    EMPTY_CHECK_CRC,
    I32_MAX,
    I32_MIN,
    I64_MAX,
    I64_MIN,
    PROPS,
    PUT_HDR,
    Outcome,
    build_writer,
    check_crc,
    check_rec,
    h,
    le32,
    new_check_rec,
    put_len,
    run_batches,
    run_events,
    sample_file,
    split_at,
)

from queued.errors import (
    BadMagicError,
    ChecksumMismatchError,
    CorruptRecordError,
    QueuedError,
)
from queued.journal import decoder
from queued.journal import format as jf
from queued.journal.format import (
    NEED_DATA,
    READER_MAGIC,
    WRITER_MAGIC,
    Batch,
    Check,
    Decoded,
    EndOfData,
    FileKind,
    Put,
    ReadDone,
    ReadHead,
    RecordDecoder,
    TornTail,
    Unknown,
)

# -- 2. round trip and chunking ------------------------------------------------------

put_specs = st.tuples(
    st.integers(1, 1000),  # gap to the previous id
    st.binary(max_size=48),
    st.integers(I64_MIN, I64_MAX),  # add_time
    st.none() | st.integers(I64_MIN, I64_MAX),  # expire_time
    st.integers(I32_MIN, I32_MAX),  # error_count
    st.just(0) | st.integers(0, jf.MAX_FLAGS),  # memcache flags (0 often: no FLAGS record)
)


@st.composite
def put_batches(draw: st.DrawFn) -> list[list[Put]]:
    next_id = draw(st.integers(0, jf.MAX_ID - 100_000))
    shape = draw(st.lists(st.lists(put_specs, max_size=4), max_size=5))
    out: list[list[Put]] = []
    for batch in shape:
        puts = []
        for gap, data, added, expire, errors, flags in batch:
            next_id += gap
            puts.append(Put(next_id, data, added, expire, errors, flags))
        out.append(puts)
    return out


@PROPS
@given(put_batches())
def test_round_trip_decode_all(batches: list[list[Put]]) -> None:
    blob, records, _ = build_writer(batches)
    got = jf.decode_all(blob)
    assert got == records
    assert [d.record for d in got if isinstance(d.record, Put)] == [p for b in batches for p in b]


@PROPS
@given(put_batches(), st.data())
def test_any_chunking_same_records(batches: list[list[Put]], data: st.DataObject) -> None:
    blob, records, _ = build_writer(batches)
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=30), label="cuts")
    chunkings = [split_at(blob, cuts), [blob]]
    if len(blob) <= 400:
        chunkings.append(split_at(blob, range(len(blob))))
    for chunks in chunkings:
        assert b"".join(chunks) == blob
        got, end, dec = run_events(chunks)
        assert got == records
        assert end == EndOfData(len(blob), zero_byte=False)
        assert dec.sealed
        assert dec.last_check_end == len(blob)
        assert dec.offset == len(blob)
        assert dec.detected_kind is FileKind.WRITER


def assert_batches_match_records(batches: list[Batch], records: list[Decoded]) -> None:
    """Each batch ends at a CHECK record's end and counts the PUTs before it, first to last."""
    check_ends = [d.end for d in records if isinstance(d.record, Check)]
    assert [b.end for b in batches] == check_ends
    for b in batches:
        puts = [
            d.record for d in records if isinstance(d.record, Put) and b.offset <= d.offset < b.end
        ]
        assert b.count == len(puts)
        assert (b.first_id, b.last_id) == ((puts[0].id, puts[-1].id) if puts else (0, 0))


@PROPS
@given(put_batches(), st.data())
def test_any_chunking_same_batches(batches: list[list[Put]], data: st.DataObject) -> None:
    blob, records, expected = build_writer(batches)
    assert_batches_match_records(expected, records)  # not only the builder's word
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=30), label="cuts")
    chunkings = [split_at(blob, cuts), [blob]]
    if len(blob) <= 400:
        chunkings.append(split_at(blob, range(len(blob))))
    for chunks in chunkings:
        got, end, dec = run_batches(chunks)
        assert got == expected
        assert end == EndOfData(len(blob), zero_byte=False)
        assert dec.sealed
        assert dec.last_check_end == len(blob)


@PROPS
@given(put_batches(), st.data())
def test_resume_at_batch_boundary(batches: list[list[Put]], data: st.DataObject) -> None:
    blob, records, expected = build_writer(batches)
    start = data.draw(st.sampled_from([4] + [b.end for b in expected]), label="start")
    dec = RecordDecoder(FileKind.WRITER, expect_magic=False, start_offset=start)
    tail = blob[start:]
    got, end, dec = run_events(split_at(tail, [len(tail) // 2]), dec)
    assert got == [d for d in records if d.offset >= start]
    assert end == EndOfData(len(blob), zero_byte=False)
    assert dec.last_check_end == len(blob)


@PROPS
@given(
    st.integers(0, I64_MAX),
    st.lists(st.integers(1, I64_MAX), unique=True, max_size=20),
)
def test_checkpoint_round_trip(head: int, done: list[int]) -> None:
    blob = jf.encode_checkpoint(head, done)
    got, end, dec = run_events(split_at(blob, [5, 17, 30]), RecordDecoder(FileKind.READER))
    assert [d.record for d in got][1:3] == [ReadHead(head), ReadDone(tuple(sorted(done)))]
    assert end == EndOfData(len(blob), zero_byte=False)
    assert dec.last_check_end == len(blob)
    assert dec.detected_kind is FileKind.READER


# -- 3. garbage in -> only our errors ------------------------------------------------

prefixes = st.sampled_from([b"", WRITER_MAGIC, READER_MAGIC, WRITER_MAGIC + EMPTY_CHECK])
kinds = st.sampled_from([FileKind.WRITER, FileKind.READER, None])
caps = st.sampled_from([jf.MAX_DATA_SIZE, 16])


def assert_only_our_errors(
    run: Callable[..., tuple[list[Any], Outcome, RecordDecoder]],
    pull: Callable[[RecordDecoder], object], blob: bytes, kind: FileKind | None, cap: int,
    data: st.DataObject,
) -> None:
    """`blob` cut at drawn places, through `run` (run_events or run_batches): it ends in
    one of our errors, which is sticky, or in an end that `pull` repeats."""
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=10), label="cuts")
    dec = RecordDecoder(kind, max_data_size=cap)
    _, end, dec = run(split_at(blob, cuts), dec)
    if isinstance(end, CorruptRecordError):
        assert isinstance(end, QueuedError)
        with pytest.raises(CorruptRecordError) as again:
            pull(dec)
        assert again.value is end  # the error is sticky
    else:
        assert pull(dec) == end


#: The garbage properties' input: a blob (a prefix, then garbage), the kind told, the cap.
garbage_given = given(st.builds(bytes.__add__, prefixes, st.binary(max_size=300)), kinds, caps,
                      st.data())


@PROPS
@garbage_given
def test_garbage_next_event_only_our_errors(
    blob: bytes, kind: FileKind | None, cap: int, data: st.DataObject) -> None:
    assert_only_our_errors(run_events, RecordDecoder.next_event, blob, kind, cap, data)


@PROPS
@garbage_given
def test_garbage_next_batch_only_our_errors(
    blob: bytes, kind: FileKind | None, cap: int, data: st.DataObject) -> None:
    assert_only_our_errors(run_batches, RecordDecoder.next_batch, blob, kind, cap, data)


def _rec_put(xid: int, data: bytes = b"") -> bytes:
    return struct.pack("<Biiqq", 0x86, len(data), 0, xid, 0) + data


# Record-shaped fragments, some valid and some not, so the fuzzing gets past the
# first header; each batch is sealed with a correct hand-computed check record.
fragments = st.one_of(
    st.integers(1, 1000).map(_rec_put),
    st.tuples(st.integers(1, 1000), st.binary(max_size=8)).map(lambda t: _rec_put(*t)),
    st.integers(-3, 0).map(_rec_put),  # invalid id
    st.integers(0, 99).map(lambda i: struct.pack("<Bq", 0x02, i)),
    st.lists(st.integers(1, 99), max_size=3).map(
        lambda ids: struct.pack(f"<Bi{len(ids)}q", 0x91, 8 * len(ids), *ids)
    ),
    st.binary(min_size=1, max_size=7)
    .filter(lambda b: len(b) % 8)
    .map(
        lambda b: struct.pack("<Bi", 0x91, len(b)) + b  # READ_DONE size not 8*n
    ),
    st.binary(min_size=4, max_size=4).map(lambda b: b"\x31" + b),  # unknown, no data
    st.binary(min_size=4, max_size=4).map(lambda b: b"\x41" + b),  # FLAGS (PUT or not after)
    st.binary(max_size=6).map(lambda b: struct.pack("<Bi", 0xA1, len(b)) + b),
    st.binary(min_size=8, max_size=8).map(lambda b: b"\x52" + b),  # old DELAY
    # The envelope: FLAGS, DELAY, COMPACTED, INCARNATION, kinds unknown or 0, sizes right
    # or wrong.
    st.tuples(st.sampled_from([2, 3, 4, 5, 0, 9, 200]), st.integers(0, 18)).map(
        lambda t: struct.pack("<BiB", 0xD1, t[1], t[0]) + bytes(range(max(t[1] - 1, 0)))),
    st.binary(min_size=4, max_size=4).map(lambda b: h("d1 05000000 02") + b),  # FLAGS
    st.binary(min_size=8, max_size=8).map(lambda b: h("d1 09000000 03") + b),  # DELAY
    st.binary(min_size=1, max_size=6),  # raw noise
)


@st.composite
def record_soup(draw: st.DrawFn) -> bytes:
    out = bytearray(WRITER_MAGIC)
    for frags in draw(st.lists(st.lists(fragments, max_size=4), max_size=4)):
        body = b"".join(frags)
        bad_crc = draw(st.booleans()) and draw(st.booleans())
        seal = check_rec if draw(st.booleans()) else new_check_rec  # either form
        check = bytearray(seal(body, len(out)))
        if bad_crc:
            check[-4] ^= 1  # the crc's low bit
        out += body + check
    out += draw(st.binary(max_size=12))
    return bytes(out)


@PROPS
@given(record_soup())
def test_next_batch_agrees_with_next_event(blob: bytes) -> None:
    """A Batch is only ever reported for bytes that next_event also accepts.

    The fast path must not verify a batch the full decoder rejects, and a record
    the full decoder rejects must stop the fast path at the same offset.
    """
    assert_next_batch_agrees(blob)


@st.composite
def equal_runs(draw: st.DrawFn) -> bytes:
    """A sealed file of batches of many same-sized PUTs (what next_batch walks column by
    column), each maybe with one record unlike the others somewhere in the run: another
    size, a PUT_EXPIRE, a FLAGS record before it, an id 0 or negative, another command."""
    out = bytearray(WRITER_MAGIC)
    xid = 1
    for _ in range(draw(st.integers(1, 3))):
        n, size = draw(st.integers(60, 200)), draw(st.integers(0, 40))
        odd = draw(st.integers(0, n + 5))
        kind = draw(st.sampled_from(["size", "expire", "flags", "zero", "negative", "cmd"]))
        body = bytearray()
        for k in range(n):
            data = bytes([k % 251]) * size
            rid = xid
            if k == odd and kind == "size":
                data += b"+"
            if k == odd and kind == "zero":
                rid = 0
            if k == odd and kind == "negative":
                rid = -5
            if k == odd and kind == "flags":
                body += h("d1 05000000 02") + struct.pack("<I", 7)
            if k == odd and kind == "expire":
                body += struct.pack("<Biiqqq", 0x88, len(data), 0, rid, 1000, 2000) + data
            else:
                body += struct.pack("<Biiqq", 0x86, len(data), 0, rid, 1000) + data
            if k == odd and kind == "cmd":
                body[-len(data) - 25] = draw(st.sampled_from([0x00, 0x87, 0x31, 0xD1]))
            xid += 1
        out += body + new_check_rec(bytes(body), len(out))
    out += draw(st.binary(max_size=40))
    return bytes(out)


@PROPS
@given(equal_runs())
def test_next_batch_agrees_with_next_event_on_runs_of_equal_puts(blob: bytes) -> None:
    assert_runs_agree(blob)


@PROPS
@given(equal_runs(), st.sampled_from([1, 2, 5, 16, 64]))
def test_next_batch_agrees_with_next_event_on_runs_longer_than_its_window(
        blob: bytes, window: int) -> None:
    """Runs longer than next_batch's first window (it looks at windows of doubling size
    while a run goes on): the same batches, offsets and errors."""
    with mock.patch.object(decoder, "RUN_WINDOW", window):
        assert_runs_agree(blob)


def assert_runs_agree(blob: bytes) -> None:
    assert_next_batch_agrees(blob)
    # A file read whole (receive_all) decodes as the same file received in pieces.
    whole = RecordDecoder()
    whole.receive_all(bytearray(blob))
    got: list[object] = []
    offsets: list[int] = []
    try:
        while isinstance(ev := whole.next_batch(offsets), Batch):
            got.append(ev)
        got.append(ev)
    except CorruptRecordError as exc:
        got.append((type(exc), exc.offset))
    pieces: list[object] = []
    again: list[int] = []
    batches, end, _ = run_batches(split_at(blob, [len(blob) // 2]), puts=again)
    pieces += batches
    pieces.append((type(end), end.offset) if isinstance(end, CorruptRecordError) else end)
    assert got == pieces and offsets == again
    # With ranges=True, runs come as ranges: the same batches and, expanded, the same offsets.
    compact = RecordDecoder()
    compact.receive_all(blob)
    spans: list[int | range] = []
    same: list[object] = []
    try:
        while isinstance(ev := compact.next_batch(spans, ranges=True), Batch):
            same.append(ev)
        same.append(ev)
    except CorruptRecordError as exc:
        same.append((type(exc), exc.offset))
    assert same == got
    assert [at for s in spans for at in ([s] if isinstance(s, int) else s)] == offsets
    assert all(len(s) for s in spans if isinstance(s, range))


def assert_next_batch_agrees(blob: bytes) -> None:
    records, ev_end, _ = run_events([blob])
    batches, b_end, _ = run_batches([blob])
    assert_batches_match_records(batches, records)
    if isinstance(ev_end, CorruptRecordError):
        assert isinstance(b_end, CorruptRecordError)
        assert b_end.offset == ev_end.offset
        assert type(b_end) is type(ev_end)
    # The PUT offsets handed out: exactly those of verified batches, in any chunking (a
    # Put decoded with its FLAGS record starts there; its PUT record is its last bytes).
    verified = batches[-1].end if batches else 0
    puts = [(d.end - put_len(dataclasses.replace(d.record, flags=0)), d.record)
            for d in records if isinstance(d.record, Put) and d.end <= verified]
    expected = [at for at, _ in puts]
    for cuts in ([], [len(blob) // 3, 2 * len(blob) // 3], list(range(1, len(blob), 5))):
        offsets: list[int] = []
        flags: dict[int, int] = {}
        again, _, _ = run_batches(split_at(blob, cuts), puts=offsets, flags=flags)
        assert again == batches
        assert offsets == expected
        assert [flags.get(at, 0) for at in offsets] == [p.flags for _, p in puts]


# -- 4. torn tail --------------------------------------------------------------------


def test_torn_tail_every_cut_in_last_batch() -> None:
    blob, records, batches = sample_file()
    prev_end, last_end = batches[-2].end, batches[-1].end
    assert last_end == len(blob)
    boundaries = {d.end for d in records}
    starts = sorted(d.offset for d in records)
    for cut in range(prev_end + 1, last_end):
        torn = blob[:cut]
        got, end, dec = run_events(split_at(torn, [cut // 2]))
        assert got == [d for d in records if d.end <= cut], cut
        assert dec.last_check_end == prev_end, cut
        if cut in boundaries:
            # Whole records past the last check: valid data, but unverified.
            assert end == EndOfData(cut, zero_byte=False), cut
            assert cut > dec.last_check_end
        else:
            record_start = max(s for s in starts if s < cut)
            assert end == TornTail(record_start, cut - record_start), cut
        if cut not in boundaries:
            with pytest.raises(CorruptRecordError):
                jf.decode_all(torn)

        got_b, end_b, dec_b = run_batches(split_at(torn, [cut // 2]))
        assert got_b == batches[:-1], cut
        assert end_b == TornTail(prev_end, cut - prev_end), cut
        assert dec_b.last_check_end == prev_end, cut

        assert jf.find_valid_check_after(torn, prev_end) is None, cut
        assert jf.find_valid_check_after(torn, 0) == batches[1].end - CHECK_LEN
        assert jf.find_valid_check_after(torn, batches[-2].offset) == prev_end - CHECK_LEN


def test_torn_magic() -> None:
    for n in range(1, 4):
        with pytest.raises(BadMagicError):
            run_events_raising([WRITER_MAGIC[:n]])
        # Not yet at EOF: just waiting for more.
        dec = RecordDecoder()
        dec.receive_data(WRITER_MAGIC[:n])
        assert dec.next_event() is NEED_DATA
        assert dec.next_batch() is NEED_DATA


def run_events_raising(chunks: Sequence[bytes], dec: RecordDecoder | None = None) -> None:
    _, end, _ = run_events(chunks, dec)
    if isinstance(end, CorruptRecordError):
        raise end


def run_batches_raising(chunks: Sequence[bytes], dec: RecordDecoder | None = None) -> None:
    _, end, _ = run_batches(chunks, dec)
    if isinstance(end, CorruptRecordError):
        raise end


def test_decode_all_rejects_torn_record() -> None:
    blob, _, _ = sample_file()
    with pytest.raises(CorruptRecordError) as info:
        jf.decode_all(blob[:-1])
    assert info.value.offset == len(blob) - CHECK_LEN


# -- 5. garbage after valid data, bit flips in the middle ------------------------------


@pytest.mark.parametrize(
    ("garbage", "outcome"),
    [
        (b"\x00" * 10, "zero"),
        (b"\x00hello", "zero"),
        (b"\xff" * 10, "torn"),  # command 15, 15 header words: 61 bytes, only 10 here
        (b"\x85" + bytes(20), "corrupt"),  # PUT with 5 header words
        (b"hello world", "corrupt"),  # 'h' = 0x68: command 6 with 8 words
        (b"\x72" + bytes(8), "mismatch"),  # the old unseeded empty check
        (EMPTY_CHECK, "mismatch"),  # an empty check copied from offset 4
        (b"", "extra-empty-check"),  # replaced by check_rec(b"", n) below
    ],
)
def test_garbage_after_valid_data(garbage: bytes, outcome: str) -> None:
    blob, records, batches = sample_file()
    n = len(blob)
    if outcome == "extra-empty-check":
        garbage = check_rec(b"", n)
    got, end, dec = run_events([blob + garbage])
    got_b, end_b, dec_b = run_batches([blob + garbage])
    assert got[: len(records)] == records
    assert got_b[: len(batches)] == batches
    if outcome == "zero":
        assert end == EndOfData(n, zero_byte=True)
        assert end_b == EndOfData(n, zero_byte=True)
    elif outcome == "torn":
        assert end == TornTail(n, len(garbage))
        assert end_b == TornTail(n, len(garbage))
    elif outcome == "corrupt":
        assert isinstance(end, CorruptRecordError)
        assert not isinstance(end, ChecksumMismatchError)
        assert end.offset == n
        assert isinstance(end_b, CorruptRecordError)
        assert end_b.offset == n
    elif outcome == "mismatch":
        assert isinstance(end, ChecksumMismatchError)
        assert end.offset == n
        assert isinstance(end_b, ChecksumMismatchError)
        assert end_b.offset == n
    else:
        assert end == EndOfData(n + 9, zero_byte=False)
        assert got_b[-1] == Batch(n, n + 9, 0, 0, 0)
    if outcome != "extra-empty-check":
        assert len(got) == len(records)
        assert dec.last_check_end == n
        assert dec_b.last_check_end == n
    assert jf.find_valid_check_after(blob + garbage, n) is None


@PROPS
@given(st.binary(min_size=1, max_size=200))
def test_random_garbage_after_valid_data(garbage: bytes) -> None:
    blob, records, batches = sample_file()
    n = len(blob)
    got, end, dec = run_events(split_at(blob + garbage, [n - 3, n + 2]))
    assert got[: len(records)] == records
    assert dec.last_check_end is not None and dec.last_check_end >= n
    if isinstance(end, CorruptRecordError | TornTail):
        assert end.offset >= n
    got_b, end_b, _ = run_batches(split_at(blob + garbage, [n + 1]))
    assert got_b[: len(batches)] == batches
    if isinstance(end_b, CorruptRecordError | TornTail):
        assert end_b.offset >= n
    assert jf.find_valid_check_after(blob + garbage, n) is None


def _flip(blob: bytes, byte: int, bit: int) -> bytes:
    out = bytearray(blob)
    out[byte] ^= 1 << bit
    return bytes(out)


def test_flipped_bit_in_middle_batch_payload_is_checksum_mismatch() -> None:
    blob, records, batches = sample_file()
    middle = batches[2]  # batches[0] is the empty check after the magic
    mid_check = middle.end - CHECK_LEN
    # Bytes whose value changes neither the record structure nor its validity:
    # a PUT's error_count, add_time and data (not its id: flipping 4 to 0 is a bad
    # id), and the check record's length and crc.
    inert: list[int] = []
    for d in records:
        if middle.offset <= d.offset < middle.end:
            if isinstance(d.record, Put):
                inert.extend(range(d.offset + 5, d.offset + 9))
                inert.extend(range(d.offset + 17, d.end))
            else:
                inert.extend(range(d.offset + 1, d.end))
    assert len(inert) > 50
    for byte in inert:
        for bit in range(8):
            bad = _flip(blob, byte, bit)
            got, end, dec = run_events([bad])
            assert isinstance(end, ChecksumMismatchError), (byte, bit, end)
            assert end.offset == mid_check, (byte, bit)
            assert dec.last_check_end == middle.offset
            intact = [d for d in records if d.end <= middle.offset]
            assert got[: len(intact)] == intact
            assert [(d.offset, d.end) for d in got] == [
                (d.offset, d.end) for d in records if d.end <= mid_check
            ]

            got_b, end_b, dec_b = run_batches([bad])
            assert isinstance(end_b, ChecksumMismatchError), (byte, bit, end_b)
            assert end_b.offset == mid_check, (byte, bit)
            assert got_b == batches[:2]
            assert dec_b.last_check_end == middle.offset


def test_flipped_bit_anywhere_in_middle_batch_is_never_accepted() -> None:
    blob, records, batches = sample_file()
    middle, last = batches[2], batches[3]
    last_check = last.end - CHECK_LEN
    for byte in range(middle.offset, middle.end):
        for bit in range(8):
            bad = _flip(blob, byte, bit)
            got, _, dec = run_events([bad])
            assert dec.last_check_end == middle.offset, (byte, bit)
            assert not any(isinstance(d.record, Check) and d.end > middle.offset for d in got), (
                byte,
                bit,
            )
            assert got[:4] == records[:4]  # empty check, batch 1 (two puts, check)
            got_b, end_b, dec_b = run_batches([bad])
            assert got_b == batches[:2], (byte, bit)
            assert dec_b.last_check_end == middle.offset
            if isinstance(end_b, TornTail):
                assert end_b.offset == middle.offset
            else:
                assert isinstance(end_b, CorruptRecordError), (byte, bit, end_b)
            # Recovery's question: is there acknowledged data after the damage?
            assert jf.find_valid_check_after(bad, middle.offset) == last_check, (byte, bit)
            assert jf.find_valid_check_after(memoryview(bad), middle.offset) == last_check


def test_find_valid_check_after_clean_file() -> None:
    blob, _, batches = sample_file()
    check_offsets = [b.end - CHECK_LEN for b in batches[1:]]
    assert jf.find_valid_check_after(blob, 0) == check_offsets[0]
    assert jf.find_valid_check_after(bytearray(blob), batches[1].end) == check_offsets[1]
    assert jf.find_valid_check_after(blob, batches[2].end) == check_offsets[2]
    # A start inside a batch: that batch's check covers bytes before `start`.
    assert jf.find_valid_check_after(blob, batches[3].offset + 1) is None
    assert jf.find_valid_check_after(blob, len(blob)) is None
    assert jf.find_valid_check_after(b"", 0) is None


@PROPS
@given(st.binary(max_size=300))
def test_find_valid_check_after_garbage_only(garbage: bytes) -> None:
    assert jf.find_valid_check_after(garbage, 0) is None
    assert jf.find_valid_check_after(WRITER_MAGIC + EMPTY_CHECK + garbage, 0) is None


# -- 5b. check records are tied to their file offset ----------------------------------

# CRC-32 detects every error burst of up to 32 bits, so two offsets below 2**32 always
# give different seeds; and for fixed bytes, crc32(bytes, seed) is a bijection of the
# seed. So for these offsets "verifies elsewhere" is impossible, not merely unlikely.
SMALL_OFFSETS = st.integers(0, 2**32 - 1)


def test_batch_sealed_for_one_offset_fails_at_another() -> None:
    body = h(FOREIGN_PUT_1) + h(FOREIGN_PUT_3)
    sealed = jf.seal(body, 13)
    assert sealed == body + new_check_rec(body, 13)
    good = WRITER_MAGIC + EMPTY_CHECK + sealed
    got_b, end_b, _ = run_batches([good])
    assert got_b == [Batch(4, 13, 0, 0, 0), Batch(13, len(good), 2, 1, 3)]
    assert end_b == EndOfData(len(good), zero_byte=False)
    assert jf.find_valid_check_after(good, 13) == 13 + len(body)

    other_batch = jf.seal(h(FOREIGN_PUT_2), 13)
    placements = [
        WRITER_MAGIC,  # at 4: no empty check first
        WRITER_MAGIC + EMPTY_CHECK + check_rec(b"", 13),  # at 22
        WRITER_MAGIC + EMPTY_CHECK + other_batch,  # at 13 + 33 + 14
    ]
    for prefix in placements:
        at = len(prefix)
        assert at != 13
        blob = prefix + sealed
        got, end, dec = run_events([blob])
        assert isinstance(end, ChecksumMismatchError), at
        assert end.offset == at + len(body)
        assert dec.last_check_end == at
        assert [d.record for d in got if d.offset >= at] == [
            FOREIGN_PUTS[0],
            FOREIGN_PUTS[2],
        ]
        got_b, end_b, dec_b = run_batches([blob])
        assert isinstance(end_b, ChecksumMismatchError), at
        assert end_b.offset == at + len(body)
        assert all(b.end <= at for b in got_b)
        assert dec_b.last_check_end == at
        assert jf.find_valid_check_after(blob, at) is None
        # Resealed for where it now sits, the same body verifies.
        fixed = prefix + jf.seal(body, at)
        assert jf.decode_all(fixed)[-1] == Decoded(
            Check(len(body), check_crc(body, at)), at + len(body), len(fixed)
        )
        assert jf.find_valid_check_after(fixed, at) == at + len(body)


@PROPS
@given(SMALL_OFFSETS)
def test_sealed_batch_verifies_only_at_its_offset(offset: int) -> None:
    body = h(FOREIGN_PUT_1)
    sealed = jf.seal(body, 13)
    dec = RecordDecoder(FileKind.WRITER, expect_magic=False, start_offset=offset)
    got, end, _ = run_events([sealed], dec)
    dec_b = RecordDecoder(FileKind.WRITER, expect_magic=False, start_offset=offset)
    got_b, end_b, _ = run_batches([sealed], dec_b)
    found = jf.find_valid_check_after(sealed, 0, base=offset)
    if offset == 13:
        assert got[-1].record == Check(len(body), check_crc(body, 13))
        assert end == end_b == EndOfData(13 + len(sealed), zero_byte=False)
        assert got_b == [Batch(13, 13 + len(sealed), 1, 1, 1)]
        assert found == len(body)
    else:
        assert isinstance(end, ChecksumMismatchError)
        assert end.offset == offset + len(body)
        assert isinstance(end_b, ChecksumMismatchError)
        assert end_b.offset == offset + len(body)
        assert got_b == []
        assert found is None


def _spoof_file(x: bytes, fake_check: bytes) -> tuple[bytes, int, int]:
    """A sealed first batch, then a torn batch whose first item's data is `x + fake_check`.

    Returns the file, the offset of the torn tail, and the absolute offset of `x`.
    """
    first = jf.seal(jf.encode_put(Put(1, b"ok", 1000)), 13)
    tail_offset = 13 + len(first)
    torn = jf.encode_put(Put(2, x + fake_check, 1001)) + jf.encode_put(Put(3, b"more", 1002))
    # No check record after `torn`: the writer crashed before sealing the batch.
    return WRITER_MAGIC + EMPTY_CHECK + first + torn, tail_offset, tail_offset + PUT_HDR


def test_spoofed_check_in_item_data_does_not_verify() -> None:
    """A client stores `X + check(X)`; the batch holding it is torn.

    Scanning the tail must not take the client's check record for acknowledged data
    after the damage, unless the client guessed X's exact absolute file offset.
    """
    x = h(FOREIGN_PUT_1)  # X looks like a whole record, to make the spoof plausible
    _, tail_offset, x_offset = _spoof_file(x, b"")
    assert (tail_offset, x_offset) == (13 + 27 + 14, 13 + 27 + 14 + 25)
    guesses = [0, 4, 13, tail_offset, x_offset - tail_offset, x_offset - 1, x_offset + 1]
    fakes = [jf.encode_check(x, g) for g in guesses]
    fakes += [check_rec(x, g) for g in guesses]  # the older form, which is searched too
    fakes.append(h("72") + le32(len(x)) + le32(zlib.crc32(x)))  # the old unseeded check
    fakes.append(jf.encode_check(x, x_offset))  # the exact guess, last
    for i, fake in enumerate(fakes):
        blob, _, _ = _spoof_file(x, fake)
        tail = blob[tail_offset:]
        exact = i == len(fakes) - 1
        found = jf.find_valid_check_after(tail, 0, base=tail_offset)
        found_whole = jf.find_valid_check_after(blob, tail_offset)
        if exact:
            # The residual risk: a client who knows where its item lands can forge it.
            assert found == x_offset + len(x) - tail_offset
            assert found_whole == x_offset + len(x)
        else:
            assert found is None, i
            assert found_whole is None, i
            assert jf.find_valid_check_after(memoryview(tail), 0, base=tail_offset) is None
        # The decoders parse records, so the payload is only ever data to them.
        got, end, dec = run_events([blob])
        assert [d.record for d in got if isinstance(d.record, Put)][1].data == x + fake
        assert end == EndOfData(len(blob), zero_byte=False)
        assert dec.last_check_end == tail_offset
        got_b, end_b, _ = run_batches([blob])
        assert got_b == [Batch(4, 13, 0, 0, 0), Batch(13, tail_offset, 1, 1, 1)]
        assert end_b == TornTail(tail_offset, len(tail))
        # Torn inside the real check record instead of before it: same answers.
        sealed = blob + check_rec(blob[tail_offset:], tail_offset)
        for cut in range(len(blob), len(sealed)):
            assert jf.find_valid_check_after(sealed[tail_offset:cut], 0, base=tail_offset) == found
        assert jf.find_valid_check_after(sealed, tail_offset) == (
            found_whole if exact else len(blob)
        )


@PROPS
@given(st.binary(min_size=1, max_size=64), SMALL_OFFSETS)
def test_spoofed_check_needs_the_exact_offset(x: bytes, guess: int) -> None:
    blob, tail_offset, x_offset = _spoof_file(x, jf.encode_check(x, guess))
    found = jf.find_valid_check_after(blob[tail_offset:], 0, base=tail_offset)
    if guess == x_offset:
        assert found == x_offset + len(x) - tail_offset
    else:
        assert found is None


def test_find_valid_check_after_with_base() -> None:
    blob, _, batches = sample_file()
    for b in batches[1:]:
        check = b.end - CHECK_LEN
        for k in sorted({0, 4, b.offset - 1, b.offset}):
            window = blob[k:]
            assert jf.find_valid_check_after(window, b.offset - k, base=k) == check - k, k
            assert jf.find_valid_check_after(bytearray(window), b.offset - k, base=k) == check - k
            assert jf.find_valid_check_after(memoryview(window), b.offset - k, base=k) == check - k
            if k:
                # Without the base every check is taken for another offset's: none verify.
                assert jf.find_valid_check_after(window, b.offset - k) is None, k
                assert jf.find_valid_check_after(window, b.offset - k, base=k + 1) is None, k
    # A window from the middle of the file that ends inside the last batch.
    mid, last = batches[2], batches[3]
    window = blob[mid.offset : last.end - 1]
    assert jf.find_valid_check_after(window, 0, base=mid.offset) == mid.end - CHECK_LEN - mid.offset
    assert jf.find_valid_check_after(window, last.offset - mid.offset, base=mid.offset) is None
    # A start inside a batch: its check covers bytes before `start`.
    assert jf.find_valid_check_after(window, 1, base=mid.offset) is None


# -- 6. files from another implementation of the seed -------------------------------

FOREIGN_PUT_1 = "86 03000000 00000000 0100000000000000 12eab0a933010000 616263"
FOREIGN_PUT_2 = "88 00000000 02000000 0200000000000000 12eab0a933010000 72d4b1a933010000"
FOREIGN_PUT_3 = "86 01000000 05000000 0300000000000000 13eab0a933010000 7a"
FOREIGN_PUTS = [
    Put(1, b"abc", 1321401903634),
    Put(2, b"", 1321401903634, expire_time_ms=1321401963634, error_count=2),
    Put(3, b"z", 1321401903635, error_count=5),
]


def test_foreign_writer_file_without_checks() -> None:
    blob = h("27642603") + h(FOREIGN_PUT_1) + h(FOREIGN_PUT_2) + h(FOREIGN_PUT_3)
    for chunks in ([blob], split_at(blob, range(len(blob)))):
        got, end, dec = run_events(chunks)
        assert [d.record for d in got] == FOREIGN_PUTS
        assert [(d.offset, d.end) for d in got] == [(4, 32), (32, 65), (65, 91)]
        assert end == EndOfData(91, zero_byte=False)
        assert dec.sealed is False
        assert dec.last_check_end == 4
    assert [d.record for d in jf.decode_all(blob)] == FOREIGN_PUTS
    # The fast path only verifies sealed batches: a foreign file is all "unchecked".
    got_b, end_b, dec_b = run_batches([blob])
    assert got_b == []
    assert end_b == TornTail(4, 87)
    assert dec_b.sealed is False


def test_foreign_reader_file_without_checks() -> None:
    blob = h("263c2603 02 0500000000000000 91 10000000 0700000000000000 0900000000000000")
    got = jf.decode_all(blob, FileKind.READER)
    assert [d.record for d in got] == [ReadHead(5), ReadDone((7, 9))]
    dec = RecordDecoder(None)
    _, _, dec = run_events([blob], dec)
    assert dec.sealed is False
    assert dec.detected_kind is FileKind.READER


def test_unknown_commands_are_skipped() -> None:
    blob = (
        h("27642603")
        + h(FOREIGN_PUT_1)
        + h("31 deadbeef")  # command 3, one header word, no data
        + h(FOREIGN_PUT_2)
        + h("a1 03000000")
        + b"xyz"  # command 10, one header word = data size
        + h("f2 02000000 aabbccdd 7172")  # command 15, two words, 2 data bytes
        + h("5f")
        + bytes(60)  # command 5, 15 header words
        + h("10")  # command 1, no header
        + h(FOREIGN_PUT_3)
    )
    got = jf.decode_all(blob)
    assert [d.record for d in got] == [
        FOREIGN_PUTS[0],
        Unknown(3, 1, 0),
        FOREIGN_PUTS[1],
        Unknown(10, 1, 3),
        Unknown(15, 2, 2),
        Unknown(5, 15, 0),
        Unknown(1, 0, 0),
        FOREIGN_PUTS[2],
    ]
    assert [d.end - d.offset for d in got] == [28, 5, 33, 8, 11, 61, 1, 26]
    got_chunked, end, _ = run_events(split_at(blob, range(len(blob))))
    assert got_chunked == got
    assert end == EndOfData(len(blob), zero_byte=False)


def test_unknown_commands_inside_sealed_batch() -> None:
    body = h(FOREIGN_PUT_1) + h("31 deadbeef") + h("a1 02000000 0102") + h(FOREIGN_PUT_3)
    blob = WRITER_MAGIC + EMPTY_CHECK + body + check_rec(body, 13)
    got_b, end_b, _ = run_batches([blob])
    assert got_b == [Batch(4, 13, 0, 0, 0), Batch(13, len(blob), 2, 1, 3)]
    assert end_b == EndOfData(len(blob), zero_byte=False)
    got = jf.decode_all(blob)
    assert [d.record for d in got][1:-1] == [
        FOREIGN_PUTS[0],
        Unknown(3, 1, 0),
        Unknown(10, 1, 2),
        FOREIGN_PUTS[2],
    ]


def test_zero_command_byte_ends_data() -> None:
    blob = h("27642603") + h(FOREIGN_PUT_1) + bytes(1) + b"\x85 anything at all"
    for chunks in ([blob], split_at(blob, range(len(blob)))):
        got, end, _ = run_events(chunks)
        assert [d.record for d in got] == FOREIGN_PUTS[:1]
        assert end == EndOfData(32, zero_byte=True)
    assert [d.record for d in jf.decode_all(blob)] == FOREIGN_PUTS[:1]
    # A preallocated, zero-filled file is simply empty.
    got, end, _ = run_events([WRITER_MAGIC + bytes(100)])
    assert got == []
    assert end == EndOfData(4, zero_byte=True)
    # The zero byte is reported before end of file: no need to read the rest.
    dec = RecordDecoder()
    dec.receive_data(WRITER_MAGIC + EMPTY_CHECK + bytes(1))
    assert isinstance(dec.next_event(), Decoded)
    assert dec.next_event() == EndOfData(13, zero_byte=True)
    dec = RecordDecoder()
    dec.receive_data(WRITER_MAGIC + EMPTY_CHECK + bytes(1))
    assert dec.next_batch() == Batch(4, 13, 0, 0, 0)
    assert dec.next_batch() == EndOfData(13, zero_byte=True)


# -- 7. structural errors ------------------------------------------------------------

STRUCTURAL = [
    pytest.param("85" + "00" * 20, id="put-5-words"),
    pytest.param("87" + "00" * 28, id="put-7-words"),
    pytest.param("86 ffffffff 00000000 0100000000000000 0000000000000000", id="negative-size"),
    pytest.param("86 00000000 00000000 0000000000000000 0000000000000000", id="put-id-0"),
    pytest.param("86 00000000 00000000 ffffffffffffffff 0000000000000000", id="put-id-neg"),
    pytest.param(
        "88 00000000 00000000 0000000000000000 0000000000000000 0000000000000000",
        id="put-expire-id-0",
    ),
    pytest.param("91 0c000000" + "00" * 12, id="read-done-12-bytes"),
    pytest.param("91 01000000 00", id="read-done-1-byte"),
    pytest.param("92 08000000 00000000" + "00" * 8, id="read-done-2-words"),
    pytest.param("03 00000000 00000000 00000000", id="read-head-3-words"),
    pytest.param("71 00000000", id="check-1-word"),
    pytest.param("62 0000000000000000", id="compacted-2-words"),
    pytest.param("a0", id="data-command-no-header"),
]


@pytest.mark.parametrize("hexbytes", STRUCTURAL)
def test_structural_error_next_event(hexbytes: str) -> None:
    blob = WRITER_MAGIC + EMPTY_CHECK + h(hexbytes)
    for chunks in ([blob], split_at(blob, range(len(blob)))):
        with pytest.raises(CorruptRecordError) as info:
            run_events_raising(chunks, RecordDecoder(None))
        assert not isinstance(info.value, ChecksumMismatchError | BadMagicError)
        assert info.value.offset == 13
    with pytest.raises(CorruptRecordError):
        jf.decode_all(blob)


@pytest.mark.parametrize("hexbytes", STRUCTURAL)
def test_structural_error_next_batch(hexbytes: str) -> None:
    """The fast path rejects the same records, even before any check record."""
    blob = WRITER_MAGIC + EMPTY_CHECK + h(hexbytes)
    with pytest.raises(CorruptRecordError) as info:
        run_batches_raising([blob], RecordDecoder(None))
    assert not isinstance(info.value, ChecksumMismatchError | BadMagicError)
    assert info.value.offset == 13


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("86 00000000 00000000 0000000000000000 0000000000000000", id="id-0"),
        pytest.param("86 00000000 00000000 ffffffffffffffff 0000000000000000", id="id-neg"),
        pytest.param("91 0c000000" + "00" * 12, id="read-done-12-bytes"),
    ],
)
def test_next_batch_rejects_invalid_record_after_first_put(bad: str) -> None:
    """A batch that verifies its crc but holds an invalid record is still corrupt.

    next_event rejects it; the fast path must not call it a good Batch.
    """
    first = h(FOREIGN_PUT_1)
    body = first + h(bad)
    blob = WRITER_MAGIC + EMPTY_CHECK + body + check_rec(body, 13)
    with pytest.raises(CorruptRecordError) as ev_err:
        jf.decode_all(blob)
    assert ev_err.value.offset == 13 + len(first)
    with pytest.raises(CorruptRecordError) as b_err:
        run_batches_raising([blob])
    assert b_err.value.offset == 13 + len(first)


def test_data_size_over_cap_rejected_before_data_arrives() -> None:
    header = h("86 0b000000 00000000 0100000000000000 0000000000000000")  # 11 bytes of data
    ok = h("86 0a000000 00000000 0100000000000000 0000000000000000") + bytes(10)
    assert [d.record for d in jf.decode_all(WRITER_MAGIC + ok)] == [Put(1, bytes(10), 0)]

    dec = RecordDecoder(max_data_size=10)
    dec.receive_data(WRITER_MAGIC + ok)
    assert dec.next_event() == Decoded(Put(1, bytes(10), 0), 4, 39)
    dec.receive_data(header)  # not at EOF and no data yet: must not wait for 11 bytes
    with pytest.raises(CorruptRecordError) as info:
        dec.next_event()
    assert info.value.offset == 39

    dec = RecordDecoder(max_data_size=10)
    dec.receive_data(WRITER_MAGIC + header)
    with pytest.raises(CorruptRecordError) as info:
        dec.next_batch()
    assert info.value.offset == 4

    # Under the cap, a partial record just waits.
    dec = RecordDecoder(max_data_size=11)
    dec.receive_data(WRITER_MAGIC + header)
    assert dec.next_event() is NEED_DATA


def test_declared_huge_size_is_torn_not_allocated() -> None:
    blob = WRITER_MAGIC + h("86 ffffff7f 00000000 0100000000000000 0000000000000000") + b"ab"
    got, end, _ = run_events([blob])
    assert got == []
    assert end == TornTail(4, 27)


@pytest.mark.parametrize(
    ("blob", "kind"),
    [
        pytest.param(b"", FileKind.WRITER, id="empty"),
        pytest.param(b"", None, id="empty-any-kind"),
        pytest.param(h("2764"), FileKind.WRITER, id="short"),
        pytest.param(h("00000000"), FileKind.WRITER, id="zeros"),
        pytest.param(h("27642604") + h(FOREIGN_PUT_1), FileKind.WRITER, id="bad-magic"),
        pytest.param(h("03266427"), None, id="byte-swapped-magic"),
        pytest.param(h("263c2603") + EMPTY_CHECK, FileKind.WRITER, id="reader-as-writer"),
        pytest.param(h("27642603") + EMPTY_CHECK, FileKind.READER, id="writer-as-reader"),
    ],
)
def test_bad_magic(blob: bytes, kind: FileKind | None) -> None:
    with pytest.raises(BadMagicError) as info:
        run_events_raising([blob] if blob else [], RecordDecoder(kind))
    assert info.value.offset == 0
    with pytest.raises(BadMagicError):
        run_batches_raising([blob] if blob else [], RecordDecoder(kind))
    if kind is not None:
        with pytest.raises(BadMagicError):
            jf.decode_all(blob, kind)


def test_either_magic_when_kind_not_given() -> None:
    for magic, kind in ((WRITER_MAGIC, FileKind.WRITER), (READER_MAGIC, FileKind.READER)):
        got, end, dec = run_events([magic + EMPTY_CHECK], RecordDecoder(None))
        assert got == [Decoded(Check(0, EMPTY_CHECK_CRC), 4, 13)]
        assert end == EndOfData(13, zero_byte=False)
        assert dec.detected_kind is kind
        assert dec.sealed


def test_checksum_mismatch_details() -> None:
    body = h(FOREIGN_PUT_1)
    crc = check_crc(body, 4)
    assert jf.decode_all(WRITER_MAGIC + body + check_rec(body, 4))[-1].end == 41
    for length, crc_field in ((len(body), crc ^ 0x80), (len(body) - 1, crc), (len(body) + 1, crc)):
        blob = WRITER_MAGIC + body + h("72") + le32(length) + le32(crc_field)
        with pytest.raises(ChecksumMismatchError) as info:
            run_events_raising([blob])
        assert info.value.offset == 32
        with pytest.raises(ChecksumMismatchError) as info:
            run_batches_raising([blob])
        assert info.value.offset == 32
