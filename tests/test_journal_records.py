"""Journal records and their bytes (queued.journal.records, through queued.journal.format):
seed-002 golden bytes written out by hand from the seed (and DESIGN.md for our check,
flags and compaction records), each decoded back, and what the encoders refuse."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
from journal_bytes_util import (
    CHECK_LEN,
    EMPTY_CHECK,
    EMPTY_CHECK_CRC,
    FLAGS_LEN,
    NEW_EMPTY_CHECK_HEX,
    OLD_FLAGS_LEN,
    check_crc,
    check_rec,
    h,
    new_check_rec,
    run_batches,
    run_events,
    split_at,
)

from queued.errors import (
    CorruptRecordError,
)
from queued.journal import format as jf
from queued.journal.format import (
    READER_MAGIC,
    WRITER_MAGIC,
    Batch,
    Check,
    Compacted,
    Decoded,
    EndOfData,
    FileKind,
    Put,
    ReadDone,
    ReadHead,
    RecordDecoder,
    TornTail,
)

# -- 1. golden bytes -----------------------------------------------------------------


def test_magic_and_command_bytes() -> None:
    assert h("27 64 26 03") == WRITER_MAGIC
    assert h("26 3c 26 03") == READER_MAGIC
    assert h(NEW_EMPTY_CHECK_HEX) == jf.EMPTY_CHECK
    assert h("72 00000000 93d168e1") == jf.OLD_EMPTY_CHECK == EMPTY_CHECK
    assert check_crc(b"", 4) == EMPTY_CHECK_CRC
    assert (jf.PUT_BYTE, jf.PUT_EXPIRE_BYTE) == (0x86, 0x88)
    assert (jf.READ_HEAD_BYTE, jf.READ_DONE_BYTE) == (0x02, 0x91)
    assert (jf.READ_ERRORS_BYTE, jf.READ_DELAYS_BYTE) == (0xB1, 0xA1)
    # The envelope: command 13, one header word; the kinds; the marks that open them.
    assert (jf.EXT_BYTE, jf.CMD_EXT) == (0xD1, 13)
    assert (jf.EXT_CHECK, jf.EXT_FLAGS, jf.EXT_DELAY, jf.EXT_COMPACTED, jf.EXT_INCARNATION,
            jf.EXT_PRODUCER, jf.EXT_HEADERS, jf.EXT_DEDUP) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert h("d1 09000000 01") == jf.CHECK_MARK and h("d1 05000000 02") == jf.FLAGS_MARK
    assert h("d1 09000000 03") == jf.DELAY_MARK and h("d1 11000000 04") == jf.COMPACTED_MARK
    assert h("d1 09000000 05") == jf.INCARNATION_MARK
    assert jf.FLAGS_RECORD_SIZE == FLAGS_LEN and jf.CHECK_RECORD_SIZE == 14
    # The older forms, still read.
    assert (jf.OLD_CHECK_BYTE, jf.OLD_COMPACTED_BYTE, jf.OLD_FLAGS_BYTE) == (0x72, 0x64, 0x41)
    assert (jf.OLD_DELAY_BYTE, jf.OLD_INCARNATION_BYTE) == (0x52, 0xC3)
    assert jf.OLD_FLAGS_RECORD_SIZE == OLD_FLAGS_LEN and jf.OLD_CHECK_RECORD_SIZE == CHECK_LEN


GOLDEN_WRITER = [
    pytest.param(
        Put(0x0102030405060708, b"hi", 0x1122334455667788, error_count=3),
        "86 02000000 03000000 0807060504030201 8877665544332211 6869",
        id="put",
    ),
    pytest.param(
        Put(1, b"abc", 1321401903634),
        "86 03000000 00000000 0100000000000000 12eab0a933010000 616263",
        id="put-realistic",
    ),
    pytest.param(
        Put(5, b"", -1, error_count=-1),
        "86 00000000 ffffffff 0500000000000000 ffffffffffffffff",
        id="put-empty-negative-fields",
    ),
    pytest.param(
        Put(
            0x0102030405060708,
            b"hi",
            0x1122334455667788,
            expire_time_ms=0x0A0B0C0D0E0F1011,
            error_count=3,
        ),
        "88 02000000 03000000 0807060504030201 8877665544332211 11100f0e0d0c0b0a 6869",
        id="put-expire",
    ),
    pytest.param(
        Put(2, b"", 1321401903634, expire_time_ms=1321401963634, error_count=2),
        "88 00000000 02000000 0200000000000000 12eab0a933010000 72d4b1a933010000",
        id="put-expire-realistic",
    ),
    pytest.param(
        Compacted(0x0102030405060708, 0x1112131415161718),
        "d1 11000000 04 0807060504030201 1817161514131211",
        id="compacted",
    ),
    pytest.param(Check(9, 0xCBF43926), "d1 09000000 01 09000000 2639f4cb", id="check"),
    pytest.param(jf.Incarnation(0x0102030405060708), "d1 09000000 05 0807060504030201",
                 id="incarnation"),
]
# A check record only decodes where it really covers what precedes it; checks are
# decoded in the checkpoint and file tests below.
GOLDEN_WRITER_DECODABLE = [p for p in GOLDEN_WRITER if not isinstance(p.values[0], Check)]

GOLDEN_READER = [
    pytest.param(ReadHead(0x0102030405060708), "02 0807060504030201", id="read-head"),
    pytest.param(ReadHead(0), "02 0000000000000000", id="read-head-empty"),
    pytest.param(
        ReadDone((5, 0x100)),
        "91 10000000 0500000000000000 0001000000000000",
        id="read-done",
    ),
    pytest.param(ReadDone(()), "91 00000000", id="read-done-empty"),
]


#: Items with memcache flags: a FLAGS record (envelope kind 2, u32) leads the PUT; both
#: are one decoded Put. Flags 0 write nothing more (the plain goldens above).
GOLDEN_FLAGGED = [
    pytest.param(
        Put(1, b"hello", 1700000000000, flags=0x10),
        "d1 05000000 02 10000000 "
        "86 05000000 00000000 0100000000000000 0068e5cf8b010000 68656c6c6f",
        id="put-flags",
    ),
    pytest.param(
        Put(2, b"", 1321401903634, expire_time_ms=1321401963634, error_count=2,
            flags=0xFFFFFFFF),
        "d1 05000000 02 ffffffff "
        "88 00000000 02000000 0200000000000000 12eab0a933010000 72d4b1a933010000",
        id="put-expire-flags-max",
    ),
]


@pytest.mark.parametrize(("record", "hexbytes"), GOLDEN_WRITER + GOLDEN_READER + GOLDEN_FLAGGED)
def test_golden_encode(record: jf.Record, hexbytes: str) -> None:
    assert jf.encode_record(record) == h(hexbytes)


@pytest.mark.parametrize(("record", "hexbytes"), GOLDEN_FLAGGED)
def test_golden_decode_flagged_put(record: jf.Record, hexbytes: str) -> None:
    raw = h(hexbytes)
    assert jf.decode_all(h("27642603") + raw) == [Decoded(record, 4, 4 + len(raw))]
    assert jf.record_length(raw, 0) == FLAGS_LEN  # the FLAGS record alone, as seed readers see
    assert jf.record_length(raw, FLAGS_LEN) == len(raw) - FLAGS_LEN


def test_flags_zero_costs_no_bytes_and_out_of_range_is_refused() -> None:
    plain = Put(7, b"data", 1000, 2000, 1)
    assert jf.encode_put(Put(7, b"data", 1000, 2000, 1, flags=0)) == jf.encode_put(plain)
    assert jf.flags_record(0) == b""
    for expire in (None, 5):
        bare = jf.put_header_packer(1000, expire, 2)
        assert jf.put_header_packer(1000, expire, 2, 0)(4, 9) == bare(4, 9)
        assert jf.put_header_packer(1000, expire, 2, 3)(4, 9) == h("d1 05000000 02 03000000"
                                                                     ) + bare(4, 9)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError):
            jf.encode_put(Put(7, b"", 0, flags=bad))
        with pytest.raises(ValueError):
            jf.put_header_packer(0, None, 0, bad)


@pytest.mark.parametrize(("expire", "errors", "flags", "due"),
                         [(None, 0, 0, None), (None, 3, 0, None), (5000, 0, 0, None),
                          (None, 0, 7, None), (None, 0, 0, 9000), (5000, 1, 2, 9000)])
def test_put_heads_in_bulk_are_the_packers(expire: int | None, errors: int, flags: int,
                                           due: int | None) -> None:
    """pack_put_heads (the journal's bulk path) gives put_header_packer's bytes, per item,
    for the plain put (its own comprehension) and every other shape, with or without the
    caller's packer."""
    datas, ids = [b"", b"x" * 5, b"y" * 70000], [10, 11, 12]
    packer = jf.put_header_packer(1000, expire, errors, flags, due)
    want = [packer(len(d), i) for d, i in zip(datas, ids, strict=True)]
    assert jf.pack_put_heads(datas, 10, 1000, expire, errors, flags, due) == want
    # The caller's packer of the same fields (the journal's) gives the same bytes.
    assert jf.pack_put_heads(datas, 10, 1000, expire, errors, flags, due, packer) == want


def test_put_heads_in_bulk_refuse_what_the_record_cannot_hold() -> None:
    for fields in ((), (5000,), (None, 0, 3)):  # plain, expiring, flagged
        with pytest.raises(ValueError):
            jf.pack_put_heads([b"x"], 2**63, 1000, *fields)


@pytest.mark.parametrize("form", ["envelope", "old"])
def test_flagged_puts_in_a_sealed_batch_fast_path(form: str) -> None:
    put1, put2, put3 = (jf.encode_put(Put(1, b"a", 5)), jf.encode_put(Put(2, b"bb", 5)),
                        jf.encode_put(Put(3, b"c", 5, 9)))
    if form == "envelope":
        assert jf.encode_put(Put(2, b"bb", 5, flags=2)) == h("d1 05000000 02 02000000") + put2
        body = put1 + h("d1 05000000 02 02000000") + put2 + h("d1 05000000 02 10000000") + put3
        # Offsets by hand: PUT 1 at 13 (26 bytes), FLAGS at 39 (10), PUT 2 at 49 (27),
        # FLAGS at 76, PUT 3 at 86.
        puts, leads = [13, 49, 86], [13, 39, 76]
    else:  # an earlier release's FLAGS records: command 4, one word
        body = put1 + h("41 02000000") + put2 + h("41 10000000") + put3
        puts, leads = [13, 44, 76], [13, 39, 71]
    blob = WRITER_MAGIC + EMPTY_CHECK + body + check_rec(body, 13)
    for cuts in ([], range(1, len(blob))):
        offsets: list[int] = []
        flags: dict[int, int] = {}
        dec = RecordDecoder()
        for chunk in [*split_at(blob, cuts), b""]:
            dec.receive_data(chunk)
            while isinstance(ev := dec.next_batch(offsets, flags), Batch):
                pass
        assert ev == EndOfData(len(blob), zero_byte=False)
        assert offsets == puts
        assert {o: f for o, f in flags.items() if o in offsets} == {puts[1]: 2, puts[2]: 16}
    got = [d for d in jf.decode_all(blob) if isinstance(d.record, Put)]
    assert [(d.offset, d.record.flags) for d in got] == list(zip(leads, [0, 2, 16], strict=True))


@pytest.mark.parametrize("after", [
    pytest.param("72 00000000 00000000", id="check"),
    pytest.param("41 01000000", id="flags-again"),
    pytest.param("02 0100000000000000", id="read-head"),
    pytest.param("31 00000000", id="unknown"),
])
def test_flags_record_not_followed_by_a_put_is_corrupt(after: str) -> None:
    body = h("41 07000000") + h(after) + jf.encode_put(Put(1, b"x", 5))
    blob = WRITER_MAGIC + EMPTY_CHECK + body + check_rec(body, 13)
    with pytest.raises(CorruptRecordError) as ev_err:
        jf.decode_all(blob)
    _, b_end, _ = run_batches([blob])
    assert isinstance(b_end, CorruptRecordError)
    assert ev_err.value.offset == b_end.offset == 13
    # A FLAGS record with another word count is corrupt too; alone at the end, torn.
    with pytest.raises(CorruptRecordError):
        jf.decode_all(WRITER_MAGIC + h("42 07000000 00000000") + jf.encode_put(Put(1, b"", 5)))
    _, end, _ = run_events([WRITER_MAGIC + h("41 07000000")])
    assert end == TornTail(4, OLD_FLAGS_LEN)
    _, end, _ = run_events([WRITER_MAGIC + h("d1 05000000 02 07000000")])
    assert end == TornTail(4, FLAGS_LEN)


@pytest.mark.parametrize(("record", "hexbytes"), GOLDEN_WRITER + GOLDEN_READER)
def test_record_length_of_every_record_kind(record: jf.Record, hexbytes: str) -> None:
    raw = b"\xff" * 3 + h(hexbytes) + b"\x00" * 5  # any bytes around it
    assert jf.record_length(raw, 3) == len(h(hexbytes))


@pytest.mark.parametrize(("record", "hexbytes"), GOLDEN_WRITER_DECODABLE)
def test_golden_decode_writer(record: jf.Record, hexbytes: str) -> None:
    raw = h(hexbytes)
    assert jf.decode_all(h("27642603") + raw) == [Decoded(record, 4, 4 + len(raw))]


@pytest.mark.parametrize(("record", "hexbytes"), GOLDEN_READER)
def test_golden_decode_reader(record: jf.Record, hexbytes: str) -> None:
    raw = h(hexbytes)
    got = jf.decode_all(h("263c2603") + raw, FileKind.READER)
    assert got == [Decoded(record, 4, 4 + len(raw))]


def test_golden_specific_encoders() -> None:
    p = Put(1, b"abc", 1321401903634)
    assert jf.encode_put(p) == h("86 03000000 00000000 0100000000000000 12eab0a933010000 616263")
    assert jf.encode_read_head(ReadHead(7)) == h("02 0700000000000000")
    assert jf.encode_read_done(ReadDone((9,))) == h("91 08000000 0900000000000000")


def test_golden_check_crc_helper() -> None:
    # The helper itself, against literal values: the seed is crc32 of the offset as
    # 8 little-endian bytes, and crc32("123456789") = cbf43926 is the standard check.
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert zlib.crc32(h("04 00 00 00 00 00 00 00")) == 0xE168D193
    assert zlib.crc32(h("0d 00 00 00 00 00 00 00")) == 0xFE27CAB8
    assert check_crc(b"", 4) == 0xE168D193
    assert check_crc(b"", 13) == 0xFE27CAB8
    assert check_crc(b"123456789", 13) == 0xF6AC7F27
    assert check_crc(b"123456789", 0) == 0xE412DC35
    assert jf.crc_seed(4) == 0xE168D193
    assert jf.crc_seed(13) == 0xFE27CAB8


def test_golden_check_record() -> None:
    # crc32("123456789", seed = crc32(0d00000000000000)) = f6ac7f27
    assert jf.encode_check(b"123456789", 13) == h("d1 09000000 01 09000000 277facf6")
    assert jf.encode_check(bytearray(b"123456789"), 13) == h("d1 09000000 01 09000000 277facf6")
    assert jf.encode_check(memoryview(b"123456789"), 13) == h("d1 09000000 01 09000000 277facf6")
    assert jf.encode_check(b"123456789", 0) == h("d1 09000000 01 09000000 35dc12e4")
    assert jf.encode_check(b"", 4) == h(NEW_EMPTY_CHECK_HEX) == jf.EMPTY_CHECK
    assert jf.encode_check(b"", 13) == h("d1 09000000 01 00000000 b8ca27fe")
    # The Check dataclass encodes whatever crc it holds.
    assert jf.encode_record(Check(3, 0xDEADBEEF)) == h("d1 09000000 01 03000000 efbeadde")
    for offset in (0, 4, 13, 2**32, 2**63 - 1):
        assert jf.encode_check(b"abc", offset) == new_check_rec(b"abc", offset)


def test_golden_seal() -> None:
    assert jf.seal(b"123456789", 13) == b"123456789" + h("d1 09000000 01 09000000 277facf6")
    assert jf.seal(bytearray(b"123456789"), 13) == b"123456789" + h(
        "d1 09000000 01 09000000 277facf6")
    assert jf.seal(b"123456789", 0) == b"123456789" + h("d1 09000000 01 09000000 35dc12e4")
    assert jf.seal(b"", 4) == h(NEW_EMPTY_CHECK_HEX)
    sealed = WRITER_MAGIC + EMPTY_CHECK + jf.seal(b"123456789", 13)
    # "123456789" is not a valid record stream, but the check is right where it claims.
    assert jf.find_valid_check_after(sealed, 13) == 22
    # Sealed for another offset, the same bytes do not verify here.
    assert (
        jf.find_valid_check_after(WRITER_MAGIC + EMPTY_CHECK + jf.seal(b"123456789", 0), 13) is None
    )


def test_golden_checkpoint() -> None:
    body = h("02 0700000000000000  91 10000000 0900000000000000 0a00000000000000")
    assert len(body) == 0x1E
    expected = (
        h("26 3c 26 03")
        + h(NEW_EMPTY_CHECK_HEX)
        + body
        + h("d1 09000000 01 1e000000 14ef7c2d")  # check_crc(body, 18), computed once
    )
    assert check_crc(body, 18) == 0x2D7CEF14
    assert jf.encode_checkpoint(7, [10, 9]) == expected
    assert jf.encode_checkpoint(7, (9, 10)) == expected
    assert jf.decode_all(expected, FileKind.READER) == [
        Decoded(Check(0, EMPTY_CHECK_CRC), 4, 18),
        Decoded(ReadHead(7), 18, 27),
        Decoded(ReadDone((9, 10)), 27, 48),
        Decoded(Check(30, 0x2D7CEF14), 48, 62),
    ]
    # The same checkpoint as an earlier release wrote it (command 7 checks) still reads.
    old = (h("26 3c 26 03 72 00000000 93d168e1") + body
           + h("72 1e000000 c31bf739"))  # check_crc(body, 13), computed once
    assert check_crc(body, 13) == 0x39F71BC3
    assert jf.decode_all(old, FileKind.READER) == [
        Decoded(Check(0, EMPTY_CHECK_CRC), 4, 13),
        Decoded(ReadHead(7), 13, 22),
        Decoded(ReadDone((9, 10)), 22, 43),
        Decoded(Check(30, 0x39F71BC3), 43, 52),
    ]


def test_golden_checkpoint_empty() -> None:
    body = h("02 0000000000000000  91 00000000")
    expected = (
        h("26 3c 26 03") + h(NEW_EMPTY_CHECK_HEX)
        + body
        + h("d1 09000000 01 0e000000 2cf88622")  # check_crc(body, 18), computed once
    )
    assert check_crc(body, 18) == 0x2286F82C
    assert jf.encode_checkpoint(0, []) == expected


def test_encode_put_rejects_bad_ids() -> None:
    for bad in (0, -1, 2**63):
        with pytest.raises(ValueError):
            jf.encode_put(Put(bad, b"", 0))
    assert jf.encode_put(Put(2**63 - 1, b"", 0))[9:17] == h("ffffffffffffff7f")


@pytest.mark.parametrize("put", [
    jf.Put(5, b"d", 10, 20, 1, 3),
    jf.DelayedPut(5, b"d", 10, 20, 1, 3, 99, b"hdr"),
    jf.HeadedPut(5, b"d", 10, 20, 1, 3, b"hdr"),
], ids=["Put", "DelayedPut", "HeadedPut"])
def test_with_error_count_copies_every_field_in_its_class(put: jf.Put) -> None:
    copy = put.with_error_count(4)
    assert type(copy) is type(put) and copy is not put
    assert copy.error_count == 4 and put.error_count == 1
    fields = [f.name for f in dataclasses.fields(put)]
    assert [getattr(copy, n) for n in fields if n != "error_count"] == [
        getattr(put, n) for n in fields if n != "error_count"]
    assert copy.headers == put.headers
