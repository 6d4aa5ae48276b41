"""Journal bytes counted by hand, for the tests of the journal format (records, decoder):
the seed's record sizes, check records computed by this module's own crc rule, a
decoder walked over any chunking, and sealed writer files whose every offset is counted
from the seed's sizes, not taken from queued.

The only computed values are check crcs of hand-written bytes, by `check_crc` (crc32
seeded with crc32 of the batch's file offset as a little-endian u64), pinned by
literal-hex goldens in the tests.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from hypothesis import HealthCheck, settings

from queued.errors import (
    CorruptRecordError,
)
from queued.journal import format as jf
from queued.journal.format import (
    NEED_DATA,
    Batch,
    Check,
    Decoded,
    EndOfData,
    Put,
    RecordDecoder,
    TornTail,
)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

# Sizes from the seed: the command byte plus 4 bytes per header word.
PUT_HDR = 1 + 4 * 6
PUT_EXPIRE_HDR = 1 + 4 * 8
# Most files below are built by hand in the form of earlier releases (command 7 check
# records, 9 bytes): that form must load forever, and its offsets are easy to count.
# Sections 1 and 7 hold the goldens of the extension envelope this release writes.
CHECK_LEN = 1 + 4 * 2
# Ours (DESIGN.md / docs/journal.md): the extension envelope, command 13 with one header word (its
# data size), then a kind byte and the kind's fields; FLAGS is kind 2, a u32.
FLAGS_LEN = 1 + 4 + 1 + 4
OLD_FLAGS_LEN = 1 + 4 * 1  # its older form: command 4, one word of u32 flags
MAGIC_LEN = 4


def h(text: str) -> bytes:
    """Bytes from hex written with spaces for readability."""
    return bytes.fromhex(text)


def le32(n: int) -> bytes:
    return n.to_bytes(4, "little")


def check_crc(body: bytes, offset: int) -> int:
    """The crc of a check record covering `body`, which starts at file offset `offset`.

    Our own implementation of the rule, independent of jf.crc_seed.
    """
    return zlib.crc32(body, zlib.crc32(struct.pack("<Q", offset)))


def check_rec(body: bytes, offset: int) -> bytes:
    """The check record sealing `body` (at file offset `offset`), byte by byte."""
    return h("72") + le32(len(body)) + le32(check_crc(body, offset))


def new_check_rec(body: bytes, offset: int) -> bytes:
    """The same in this release's form: the extension envelope, kind 1 (check)."""
    return h("d1 09000000 01") + le32(len(body)) + le32(check_crc(body, offset))


# The empty check right after the magic: covers 0 bytes at offset 4, so its crc is
# crc32(04 00 00 00 00 00 00 00) = e168d193.
EMPTY_CHECK_HEX = "72 00000000 93d168e1"
EMPTY_CHECK_CRC = 0xE168D193
EMPTY_CHECK = h(EMPTY_CHECK_HEX)  # (the old form, as the hand-built files here use)
NEW_EMPTY_CHECK_HEX = "d1 09000000 01 00000000 93d168e1"  # what this release writes


def put_len(p: Put) -> int:
    """Bytes of a PUT (led by its FLAGS record when it has flags: one decoded record)."""
    flags = FLAGS_LEN if p.flags else 0
    return flags + (PUT_HDR if p.expire_time_ms is None else PUT_EXPIRE_HDR) + len(p.data)


# -- walking a decoder ------------------------------------------------------------

Outcome = EndOfData | TornTail | CorruptRecordError
Step = TypeVar("Step", Decoded, Batch)


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    """`data` cut at the given offsets; never an empty chunk (b"" means end of file)."""
    points = sorted({c for c in cuts if 0 < c < len(data)})
    starts, ends = [0, *points], [*points, len(data)]
    return [data[a:b] for a, b in zip(starts, ends, strict=True) if b > a]


def run_events(
    chunks: Sequence[bytes], dec: RecordDecoder | None = None
) -> tuple[list[Decoded], Outcome, RecordDecoder]:
    """Feed chunks then EOF, pulling events; return records and how it ended.

    Any exception other than CorruptRecordError escapes and fails the test.
    """
    dec = RecordDecoder() if dec is None else dec
    records, end = _walk(chunks, dec, dec.next_event, Decoded, 1)
    return records, end, dec


def run_batches(
    chunks: Sequence[bytes], dec: RecordDecoder | None = None, puts: list[int] | None = None,
    flags: dict[int, int] | None = None,
) -> tuple[list[Batch], Outcome, RecordDecoder]:
    """Like run_events, through next_batch (which appends PUT offsets to `puts` and sets
    the flags of PUTs led by a FLAGS record in `flags`)."""
    dec = RecordDecoder() if dec is None else dec
    batches, end = _walk(chunks, dec, lambda: dec.next_batch(puts, flags), Batch, CHECK_LEN)
    return batches, end, dec


def _walk(
    chunks: Sequence[bytes], dec: RecordDecoder, pull: Callable[[], object], kind: type[Step],
    min_size: int,
) -> tuple[list[Step], Outcome]:
    """Feed chunks then EOF to `dec`, pulling `kind` steps until it ends: each step starts
    where the last ended and spans at least `min_size` bytes."""
    steps: list[Step] = []

    def drain(at_eof: bool) -> Outcome | None:
        while True:
            try:
                ev = pull()
            except CorruptRecordError as exc:
                return exc
            if ev is NEED_DATA:
                assert not at_eof, "NEED_DATA after end of file would loop forever"
                return None
            if isinstance(ev, kind):
                if steps:
                    assert ev.offset == steps[-1].end
                assert ev.end >= ev.offset + min_size
                steps.append(ev)
                continue
            assert isinstance(ev, EndOfData | TornTail), ev
            return ev

    for chunk in chunks:
        assert chunk
        dec.receive_data(chunk)
        end = drain(at_eof=False)
        if end is not None:
            return steps, end
    dec.receive_data(b"")
    end = drain(at_eof=True)
    assert end is not None
    return steps, end


# -- building files with hand-counted offsets ----------------------------------------


def build_writer(
    batches: Sequence[Sequence[Put]],
) -> tuple[bytes, list[Decoded], list[Batch]]:
    """A sealed writer file, the records a decoder must report, and its batches.

    Offsets are counted from the seed's sizes, not taken from the module.
    """
    out = bytearray(h("27 64 26 03") + h(EMPTY_CHECK_HEX))
    records = [Decoded(Check(0, EMPTY_CHECK_CRC), 4, 13)]
    expected_batches = [Batch(4, 13, 0, 0, 0)]
    for batch in batches:
        start = len(out)
        body = b"".join(jf.encode_put(p) for p in batch)
        pos = start
        for p in batch:
            records.append(Decoded(p, pos, pos + put_len(p)))
            pos += put_len(p)
        assert pos - start == len(body)
        out += body + check_rec(body, start)
        records.append(Decoded(Check(len(body), check_crc(body, start)), pos, pos + CHECK_LEN))
        first = batch[0].id if batch else 0
        last = batch[-1].id if batch else 0
        expected_batches.append(Batch(start, pos + CHECK_LEN, len(batch), first, last))
    assert len(out) == records[-1].end
    return bytes(out), records, expected_batches


SAMPLE_BATCHES = [
    [Put(1, b"first", 1000), Put(2, b"", 1001, expire_time_ms=5000, error_count=1)],
    [Put(3, b"middle item", 1002), Put(4, bytes(range(20)), 1003, error_count=7)],
    [Put(5, b"last one", 1004, 9000), Put(6, b"x" * 30, 1005)],
]


def sample_file() -> tuple[bytes, list[Decoded], list[Batch]]:
    return build_writer(SAMPLE_BATCHES)
