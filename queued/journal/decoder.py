"""The incremental decoder of journal files (h11-style) and the search for check records.

Owns telling records, torn tails and corruption apart in a stream of bytes.
PURE: takes bytes and returns values (queued.journal.records); no file,
clock, socket or trio access.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final

from queued.errors import BadMagicError, ChecksumMismatchError, CorruptRecordError
from queued.journal.headers import check_headers_block
from queued.journal.records import (
    CHECK_MARK,
    CHECK_RECORD_SIZE,
    CHECK_STRUCT,
    CMD_EXT,
    CMD_PUT,
    CMD_READ_DELAYS,
    CMD_READ_DONE,
    CMD_READ_ERRORS,
    CMD_READ_HEAD,
    COMPACTED_STRUCT,
    DELAY_ENTRY_STRUCT,
    DELAY_RECORD_SIZE,
    DELAY_STRUCT,
    ERROR_ENTRY_STRUCT,
    EXT_BYTE,
    EXT_CHECK,
    EXT_CHECK_DATA_SIZE,
    EXT_COMPACTED,
    EXT_DATA_SIZES,
    EXT_DEDUP,
    EXT_DELAY,
    EXT_FLAGS,
    EXT_HEAD_SIZE,
    EXT_HEADERS,
    EXT_INCARNATION,
    EXT_PRODUCER,
    FLAGS_RECORD_SIZE,
    FLAGS_STRUCT,
    I32_STRUCT,
    I64_STRUCT,
    INCARNATION_STRUCT,
    MAGIC_SIZE,
    MAX_DATA_SIZE,
    OLD_CHECK_BYTE,
    OLD_CHECK_RECORD_SIZE,
    OLD_CHECK_STRUCT,
    OLD_CMD_CHECK,
    OLD_CMD_COMPACTED,
    OLD_CMD_FLAGS,
    OLD_COMPACTED_STRUCT,
    OLD_DELAY_BYTE,
    OLD_DELAY_RECORD_SIZE,
    OLD_DELAY_STRUCT,
    OLD_FLAGS_BYTE,
    OLD_FLAGS_RECORD_SIZE,
    OLD_FLAGS_STRUCT,
    OLD_INCARNATION_BYTE,
    OLD_INCARNATION_STRUCT,
    PUT_BYTE,
    PUT_EXPIRE_BYTE,
    PUT_EXPIRE_HEADER_SIZE,
    PUT_EXPIRE_STRUCT,
    PUT_HEADER_SIZE,
    PUT_ID_AT,
    PUT_STRUCT,
    READ_DELAYS_BYTE,
    READ_ERRORS_BYTE,
    READ_HEAD_STRUCT,
    READER_MAGIC,
    SIZE_ID_STRUCT,
    WRITER_MAGIC,
    Batch,
    Check,
    Compacted,
    Decoded,
    DelayedPut,
    EndOfData,
    Event,
    FileKind,
    HeadedPut,
    Incarnation,
    Put,
    ReadDelays,
    ReadDone,
    ReadErrors,
    ReadHead,
    Record,
    Sentinel,
    TornTail,
    Unknown,
    check_at,
    crc_seed,
    decode_dedup,
    decode_producer,
    sealed_start,
)
from queued.sansio import NEED_DATA

try:  # ISA-L's CRC-32 (the same sums as zlib's, 10x as fast here): the spark extra has it
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

#: What a decoder walks: the bytes it received, or a whole file it reads in place.
Buffer = bytearray | bytes | memoryview


def record_length(buf: bytes | bytearray | memoryview, pos: int) -> int:
    """Bytes (header and data) of the record at buf[pos], which a decoder has already
    checked for shape: only command bytes >= 0x80 carry data, sized by their first word."""
    cmd = buf[pos]
    data = I32_STRUCT.unpack_from(buf, pos + 1)[0] if cmd >= 0x80 else 0
    return 1 + 4 * (cmd & 0x0F) + data


def _need(cmd: int) -> tuple[int, str | None]:
    """Header bytes (including the command byte) for a command byte, or an error."""
    command, words = cmd >> 4, cmd & 0x0F
    if command == CMD_PUT and words not in (6, 8):
        return 0, f"PUT with {words} header words (must be 6 or 8)"
    if command == CMD_READ_HEAD and words != 2:
        return 0, f"READ_HEAD with {words} header words (must be 2)"
    if command == CMD_READ_DONE and words != 1:
        return 0, f"READ_DONE with {words} header words (must be 1)"
    if command == CMD_EXT and words != 1:
        return 0, f"extension record with {words} header words (must be 1)"
    if command == OLD_CMD_CHECK and words != 2:
        return 0, f"CHECK with {words} header words (must be 2)"
    if command == OLD_CMD_COMPACTED and words != 4:
        return 0, f"COMPACTED with {words} header words (must be 4)"
    if command == OLD_CMD_FLAGS and words != 1:
        return 0, f"FLAGS with {words} header words (must be 1)"
    if command >= 8 and words == 0:
        return 0, f"command {command} carries data but has no header"
    return 1 + 4 * words, None


def _ext_kind(buf: Buffer, pos: int, size: int, start: int) -> int:
    """The kind of the extension record at buf[pos] (its whole header is there), after
    checking its data size against the kind's."""
    if size < 1:
        raise CorruptRecordError(start, "extension record without a kind byte")
    kind = buf[pos + EXT_HEAD_SIZE - 1]
    want = EXT_DATA_SIZES.get(kind)
    if kind == 0 or (want is not None and size != want):
        raise CorruptRecordError(start, f"extension record of kind {kind} with {size} data "
                                        f"bytes" + (f" (must be {want})" if want else ""))
    return kind


def _lead_at(buf: Buffer, at: int, end: int) -> tuple[int, int, int] | None:
    """(kind, value, size) of a FLAGS or DELAY record, either form, at buf[at], when all
    of it lies before `end`; (0, 0, 0) when it is cut short there; None when none is."""
    cmd = buf[at]
    if cmd == EXT_BYTE:
        if at + EXT_HEAD_SIZE > end:
            return 0, 0, 0
        kind = buf[at + EXT_HEAD_SIZE - 1]
        if kind == EXT_FLAGS and I32_STRUCT.unpack_from(buf, at + 1)[0] == 5:
            if at + FLAGS_RECORD_SIZE > end:
                return 0, 0, 0
            return EXT_FLAGS, FLAGS_STRUCT.unpack_from(buf, at)[3], FLAGS_RECORD_SIZE
        if kind == EXT_DELAY and I32_STRUCT.unpack_from(buf, at + 1)[0] == 9:
            if at + DELAY_RECORD_SIZE > end:
                return 0, 0, 0
            return EXT_DELAY, DELAY_STRUCT.unpack_from(buf, at)[3], DELAY_RECORD_SIZE
        return None
    if cmd == OLD_FLAGS_BYTE:
        if at + OLD_FLAGS_RECORD_SIZE > end:
            return 0, 0, 0
        return EXT_FLAGS, OLD_FLAGS_STRUCT.unpack_from(buf, at)[1], OLD_FLAGS_RECORD_SIZE
    if cmd == OLD_DELAY_BYTE:
        if at + OLD_DELAY_RECORD_SIZE > end:
            return 0, 0, 0
        return EXT_DELAY, OLD_DELAY_STRUCT.unpack_from(buf, at)[1], OLD_DELAY_RECORD_SIZE
    return None


def _headers_at(buf: Buffer, pos: int, end: int, cap: int, start: int) -> int:
    """The size of the HEADERS record at buf[pos] (its kind byte is there), when all of it
    and the first byte after it lie before `end`; 0 when they do not. Raises for a size
    that cannot be (`start`: its file offset)."""
    size = I32_STRUCT.unpack_from(buf, pos + 1)[0]
    if not 1 <= size <= cap:
        raise CorruptRecordError(start, f"HEADERS record with {size} data bytes")
    total = 1 + 4 + size
    return total if pos + total < end else 0


def _put_after(buf: Buffer, at: int, n: int, what: str, start: int) -> int:
    """Where the PUT led by the record that ends at `at` starts, past a FLAGS and a DELAY
    record if they follow (either form); -1 when the bytes end first. Anything else there
    is corrupt (reported at `start`, where the first lead starts)."""
    for _ in range(2):
        if at >= n:
            return -1
        lead = _lead_at(buf, at, n)
        if lead is None:
            break
        if not lead[2]:
            return -1
        at += lead[2]
    if at >= n:
        return -1
    if buf[at] != PUT_BYTE and buf[at] != PUT_EXPIRE_BYTE:
        raise CorruptRecordError(start, f"{what} record followed by command byte "
                                        f"{buf[at]:#04x}, not a PUT")
    return at


def _batch_headers(buf: Buffer, pos: int, n: int, base: int, cap: int,
                   headers: dict[int, bytes] | None) -> int:
    """The HEADERS record at buf[pos] (before n), for RecordDecoder.next_batch: notes its
    block under the file offset of the PUT it leads, and returns where the next record (a
    FLAGS, DELAY or that PUT) starts; -1 when the bytes end first."""
    size = _headers_at(buf, pos, n, cap, base + pos)
    if not size:
        return -1
    at = pos + size
    put_at = _put_after(buf, at, n, "HEADERS", base + pos)
    if put_at >= 0 and headers is not None:
        headers[base + put_at] = bytes(buf[pos + EXT_HEAD_SIZE:at])
    return at if put_at >= 0 else -1


def _batch_lead(buf: Buffer, pos: int, n: int, base: int, flags: dict[int, int] | None,
                delays: dict[int, int] | None) -> tuple[int, int]:
    """The FLAGS or DELAY record at buf[pos] (before n), for RecordDecoder.next_batch:
    notes its value under the file offset of the PUT it leads, and returns where the next
    record starts and 1 for a DELAY (0 for FLAGS); (-1, 0) when the bytes end first."""
    lead = _lead_at(buf, pos, n)
    if lead is None:  # an envelope FLAGS or DELAY kind with another data size
        _ext_kind(buf, pos, I32_STRUCT.unpack_from(buf, pos + 1)[0], base + pos)
        raise CorruptRecordError(base + pos, "malformed FLAGS or DELAY record")
    kind, value, size = lead
    at = pos + size
    if not size or at >= n:
        return -1, 0
    if kind == EXT_FLAGS:
        after = _lead_at(buf, at, n)
        if after is not None and not after[2]:
            return -1, 0
        if after is not None and after[0] == EXT_DELAY:  # the DELAY's turn notes its PUT
            put_at = at + after[2]
            if put_at >= n:
                return -1, 0
            if buf[put_at] != PUT_BYTE and buf[put_at] != PUT_EXPIRE_BYTE:
                # Reported where the FLAGS record starts, as next_event does (one record).
                raise CorruptRecordError(base + pos, f"DELAY record followed by command byte "
                                                     f"{buf[put_at]:#04x}, not a PUT")
            if flags is not None:
                flags[base + put_at] = value
            return at, 0
    if buf[at] != PUT_BYTE and buf[at] != PUT_EXPIRE_BYTE:
        name = "FLAGS" if kind == EXT_FLAGS else "DELAY"
        raise CorruptRecordError(base + pos, f"{name} record followed by command byte "
                                             f"{buf[at]:#04x}, not a PUT")
    if kind == EXT_FLAGS:
        if flags is not None:
            flags[base + at] = value
        return at, 0
    if delays is not None:
        delays[base + at] = value
    return at, 1


def _entries(name: str, entry: struct.Struct, buf: Buffer, pos: int, hdr: int, size: int,
             start: int) -> tuple[tuple[int, int], ...]:
    """The (id, value) entries of a READ_ERRORS or READ_DELAYS record at buf[pos]."""
    if hdr != 5:
        raise CorruptRecordError(start, f"{name} with {hdr // 4} header words (must be 1)")
    if size % entry.size:
        raise CorruptRecordError(start, f"{name} data size {size} not a multiple of "
                                        f"{entry.size}")
    return tuple(entry.unpack_from(buf, pos + hdr + k)
                 for k in range(0, size, entry.size))


#: Per byte value: 1 for the top byte of a negative i64, else 0 (`_equal_puts`).
_SIGN = bytes(int(b >= 0x80) for b in range(256))
#: Records a run must have for `_equal_puts` to be worth its fixed cost.
_RUN_MIN = 64
#: The most records `_equal_puts` looks at in a first call, doubled for each next one while
#: the run goes on: a batch's run ends at its check record, and the bytes received after it
#: (the rest of a file read whole) are not looked at, where one call over all of them cost
#: time in proportion to the file. A run shorter than the window costs a strided slice of
#: the window's command bytes, not more.
RUN_WINDOW = 4096


def _equal_puts(buf: Buffer, pos: int, end: int, stride: int,
                head: bytes) -> int:
    """How many records from buf[pos] on, one every `stride` bytes and wholly before
    `end`, are PUTs led by `head` (the command byte and data size of the one before them)
    with a positive id: what the one-by-one loop of `_batch` would accept, found column by
    column (each header field of every record taken out with one strided slice)."""
    k = (end - pos) // stride
    for lane in range(len(head)):
        column = bytes(buf[pos + lane:pos + k * stride:stride])
        k -= len(column.lstrip(head[lane:lane + 1]))
        if not k:
            return 0
    stop = pos + k * stride
    negative = bytes(buf[pos + PUT_ID_AT + 7:stop:stride]).translate(_SIGN).find(1)
    if negative >= 0:
        k = negative
    low = bytes(buf[pos + PUT_ID_AT:pos + k * stride:stride])
    i = low.find(0)
    while i >= 0:  # (an id whose low byte is 0 may be 0 altogether)
        at = pos + i * stride + PUT_ID_AT
        if not any(buf[at:at + 8]):
            return i
        i = low.find(0, i + 1)
    return k


class RecordDecoder:
    """Incremental decoder for one journal file, h11-style.

    Feed bytes with `receive_data` (b"" means end of file), pull events with
    `next_event`: a `Decoded` record, `NEED_DATA`, `EndOfData` or `TornTail`.
    Corruption raises `CorruptRecordError` (a subclass for bad magic or a
    checksum mismatch) and leaves the decoder in an error state.

    Checksums: bytes are summed from the end of the previous check record; a
    check record that disagrees raises `ChecksumMismatchError`. `last_check_end`
    is the offset after the last verified check record (the last good batch).

    A FLAGS record and the PUT it leads are one `Put` (with `flags`), decoded from
    the FLAGS record's offset; a FLAGS record followed by anything else is corrupt.
    Likewise a DELAY record (after the FLAGS record, if any) and its PUT are one
    `DelayedPut`; a DELAY record followed by anything but a PUT is corrupt. A HEADERS
    record leads them all: with its PUT, a `HeadedPut` (or the `DelayedPut` with it). Every
    record we add comes in two forms (journal_records): the extension envelope, and the
    older one; both decode to the same values, in any mix.
    """

    def __init__(
        self,
        kind: FileKind | None = FileKind.WRITER,
        *,
        max_data_size: int = MAX_DATA_SIZE,
        start_offset: int = 0,
        expect_magic: bool = True,
    ) -> None:
        self.kind = kind
        self.max_data_size = max_data_size
        self._buf: Buffer = bytearray()
        self._pos = 0  # index into _buf
        self._base = start_offset  # file offset of _buf[0]
        self._eof = False
        self._done: EndOfData | TornTail | None = None
        self._error: CorruptRecordError | None = None
        self._magic_pending = expect_magic
        self.batch_start = start_offset if not expect_magic else MAGIC_SIZE
        self._crc = crc_seed(self.batch_start)
        self.last_check_end: int | None = None if expect_magic else start_offset
        self.sealed = False  # saw at least one check record
        self.detected_kind: FileKind | None = None

    @property
    def offset(self) -> int:
        """File offset of the next undecoded byte."""
        return self._base + self._pos

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof and data:
            raise RuntimeError("receive_data after end of file")
        if not data:
            self._eof = True
            return
        assert isinstance(self._buf, bytearray)  # (not after receive_all: that was all)
        if self._pos > 0 and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._base += self._pos
            self._pos = 0
        self._buf += data

    def receive_all(self, data: bytes | bytearray | memoryview) -> None:
        """The whole file (from `start_offset`) at once, read in place, never copied: no
        bytes may come before it, and it is the end of the file."""
        if self._eof or len(self._buf):
            raise RuntimeError("receive_all after other bytes")
        self._buf = data
        self._eof = True

    def copy_received(self, start: int, end: int, pad: int = 0) -> bytes:
        """A copy of the bytes received at file offsets [start, end), plus `pad` zero
        bytes. Bytes before the batch in progress may be let go at each
        `receive_data`; anything decoded since the last one is still held."""
        lo, hi = start - self._base, end - self._base
        if not 0 <= lo <= hi <= len(self._buf):
            raise ValueError(f"bytes [{start}, {end}) are not held (held from {self._base} "
                             f"to {self._base + len(self._buf)})")
        with memoryview(self._buf) as view:
            return b"".join((view[lo:hi], bytes(pad)))

    def next_event(self) -> Event:
        if self._error is not None:
            raise self._error
        if self._done is not None:
            return self._done
        try:
            return self._next()
        except CorruptRecordError as exc:
            self._error = exc
            raise

    def _next(self) -> Event:
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if self._magic_pending:
            if not self._take_magic():
                return NEED_DATA
            pos = self._pos
            avail = len(buf) - pos
        if avail == 0:
            if self._eof:
                self._done = EndOfData(self.offset, zero_byte=False)
                return self._done
            return NEED_DATA
        cmd = buf[pos]
        if cmd == 0:
            self._done = EndOfData(self.offset, zero_byte=True)
            return self._done
        hdr, problem = _need(cmd)
        if problem is not None:
            raise CorruptRecordError(self.offset, problem)
        if avail < hdr:
            return self._short(avail)
        command = cmd >> 4
        if cmd == EXT_BYTE:
            if avail < EXT_HEAD_SIZE:
                return self._short(avail)
            if buf[pos + EXT_HEAD_SIZE - 1] in (EXT_FLAGS, EXT_DELAY, EXT_HEADERS):
                return self._flagged_put(avail)
        elif cmd in (OLD_FLAGS_BYTE, OLD_DELAY_BYTE):  # another command 5 shape is not ours
            return self._flagged_put(avail)
        size = 0
        if command >= 8:
            size = I32_STRUCT.unpack_from(buf, pos + 1)[0]
            if size < 0:
                raise CorruptRecordError(self.offset, f"negative data size {size}")
            if size > self.max_data_size:
                raise CorruptRecordError(
                    self.offset, f"data size {size} over the cap {self.max_data_size}"
                )
        total = hdr + size
        if avail < total:
            return self._short(avail)
        start = self.offset
        record: Record
        check: tuple[int, int] | None = None  # a check record's (length, crc)
        if command == CMD_EXT:
            kind = _ext_kind(buf, pos, size, start)
            if kind == EXT_CHECK:
                check = CHECK_STRUCT.unpack_from(buf, pos)[3:]
            elif kind == EXT_COMPACTED:
                record = Compacted(*COMPACTED_STRUCT.unpack_from(buf, pos)[3:])
            elif kind == EXT_INCARNATION:
                record = Incarnation(INCARNATION_STRUCT.unpack_from(buf, pos)[3])
            elif kind == EXT_PRODUCER:
                mark = decode_producer(buf, pos, size)
                if mark is None:
                    raise CorruptRecordError(start, f"PRODUCER record of {size} data bytes "
                                             "that do not add up")
                record = mark
            elif kind == EXT_DEDUP:
                dedup = decode_dedup(buf, pos, size)
                if dedup is None:
                    raise CorruptRecordError(start, f"DEDUP record of {size} data bytes "
                                             "that do not add up")
                record = dedup
            else:  # a kind of a later release: skipped, as an unknown command is
                record = Unknown(command, 1, size, kind)
        elif command == OLD_CMD_CHECK:
            check = OLD_CHECK_STRUCT.unpack_from(buf, pos)[1:]
        elif command == OLD_CMD_COMPACTED:
            record = Compacted(*OLD_COMPACTED_STRUCT.unpack_from(buf, pos)[1:])
        elif cmd == OLD_INCARNATION_BYTE and not size:
            record = Incarnation(OLD_INCARNATION_STRUCT.unpack_from(buf, pos)[2])
        elif command == CMD_PUT:
            if hdr == PUT_HEADER_SIZE:
                _, _, errs, xid, added = PUT_STRUCT.unpack_from(buf, pos)
                expire = None
            else:
                _, _, errs, xid, added, expire = PUT_EXPIRE_STRUCT.unpack_from(buf, pos)
            if xid <= 0:
                raise CorruptRecordError(start, f"PUT with non-positive id {xid}")
            record = Put(xid, bytes(buf[pos + hdr : pos + total]), added, expire, errs)
        elif command == CMD_READ_HEAD:
            record = ReadHead(READ_HEAD_STRUCT.unpack_from(buf, pos)[1])
        elif command == CMD_READ_DONE:
            if size % 8:
                raise CorruptRecordError(start, f"READ_DONE data size {size} not a multiple of 8")
            ids = struct.unpack_from(f"<{size // 8}q", buf, pos + hdr)
            record = ReadDone(ids)
        elif command == CMD_READ_ERRORS and self.detected_kind is FileKind.READER:
            # Ours, in reader files only: elsewhere command 11 is another's, skipped.
            record = ReadErrors(_entries("READ_ERRORS", ERROR_ENTRY_STRUCT, buf, pos, hdr,
                                         size, start))
        elif command == CMD_READ_DELAYS and self.detected_kind is FileKind.READER:
            # Ours, in reader files only, like READ_ERRORS.
            record = ReadDelays(_entries("READ_DELAYS", DELAY_ENTRY_STRUCT, buf, pos, hdr,
                                         size, start))
        else:
            record = Unknown(command, cmd & 0x0F, size)
        if check is not None:
            length, crc = check
            covered = start - self.batch_start
            if length != covered or crc != self._crc:
                raise ChecksumMismatchError(
                    start,
                    f"check record covers {length} bytes crc {crc:08x}, "
                    f"found {covered} bytes crc {self._crc:08x}",
                )
            record = Check(length, crc)
            self.batch_start = start + total
            self._crc = crc_seed(self.batch_start)
            self.last_check_end = start + total
            self.sealed = True
        else:
            self._crc = zlib.crc32(memoryview(buf)[pos : pos + total], self._crc)
        self._pos = pos + total
        return Decoded(record, start, start + total)

    def _flagged_put(self, avail: int) -> Event:
        """A HEADERS, FLAGS and/or DELAY record (in that order) and the PUT after them,
        as one Put carrying the flags (a DelayedPut carrying the due time too, a HeadedPut
        or DelayedPut the headers block)."""
        buf, pos, start = self._buf, self._pos, self.offset
        end = pos + avail
        at = pos
        flags = 0
        due: int | None = None
        block = b""
        name = "HEADERS"  # the record right before the PUT, for an error
        if buf[pos] == EXT_BYTE and buf[pos + EXT_HEAD_SIZE - 1] == EXT_HEADERS:
            size = _headers_at(buf, pos, end, self.max_data_size, start)
            if not size:
                return self._short(avail)
            block = bytes(buf[pos + EXT_HEAD_SIZE:pos + size])
            try:
                check_headers_block(block)
            except ValueError as exc:
                raise CorruptRecordError(start, f"HEADERS record: {exc}") from None
            at += size
            lead = _lead_at(buf, at, end)
        else:
            lead = _lead_at(buf, at, end)
            if lead is None:  # an envelope FLAGS or DELAY kind with another data size
                _ext_kind(buf, pos, I32_STRUCT.unpack_from(buf, pos + 1)[0], start)
                raise CorruptRecordError(start, "malformed FLAGS or DELAY record")
        if lead is not None and not lead[2]:
            return self._short(avail)
        if lead is not None and lead[0] == EXT_FLAGS:
            flags, name = lead[1], "FLAGS"
            at += lead[2]
            if at >= end:
                return self._short(avail)
            lead = _lead_at(buf, at, end)
            if lead is not None and not lead[2]:
                return self._short(avail)
        if lead is not None and lead[0] == EXT_DELAY:
            due, name = lead[1], "DELAY"
            at += lead[2]
            if at >= end:
                return self._short(avail)
        cmd = buf[at]
        if cmd == PUT_BYTE:
            hdr = PUT_HEADER_SIZE
        elif cmd == PUT_EXPIRE_BYTE:
            hdr = PUT_EXPIRE_HEADER_SIZE
        else:
            raise CorruptRecordError(start, f"{name} record followed by command byte {cmd:#04x}, "
                                            "not a PUT")
        leads = at - pos
        if avail < leads + hdr:
            return self._short(avail)
        if hdr == PUT_HEADER_SIZE:
            _, size, errs, xid, added = PUT_STRUCT.unpack_from(buf, at)
            expire = None
        else:
            _, size, errs, xid, added, expire = PUT_EXPIRE_STRUCT.unpack_from(buf, at)
        if not 0 <= size <= self.max_data_size:
            raise CorruptRecordError(start + leads, f"bad data size {size}")
        total = leads + hdr + size
        if avail < total:
            return self._short(avail)
        if xid <= 0:
            raise CorruptRecordError(start + leads, f"PUT with non-positive id {xid}")
        data = bytes(buf[at + hdr : pos + total])
        record = (DelayedPut(xid, data, added, expire, errs, flags, due, block)
                  if due is not None else HeadedPut(xid, data, added, expire, errs, flags, block)
                  if block else Put(xid, data, added, expire, errs, flags))
        self._crc = zlib.crc32(memoryview(buf)[pos : pos + total], self._crc)
        self._pos = pos + total
        return Decoded(record, start, start + total)

    def _take_magic(self) -> bool:
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < MAGIC_SIZE:
            if self._eof:
                if avail == 0:
                    raise BadMagicError(self.offset, "empty file")
                raise BadMagicError(self.offset, "file shorter than its magic")
            return False
        magic = bytes(buf[pos : pos + MAGIC_SIZE])
        if magic == WRITER_MAGIC:
            found = FileKind.WRITER
        elif magic == READER_MAGIC:
            found = FileKind.READER
        else:
            raise BadMagicError(self.offset, f"bad magic {magic.hex()}")
        if self.kind is not None and found is not self.kind:
            raise BadMagicError(self.offset, f"expected a {self.kind.value} file")
        self.detected_kind = found
        self._magic_pending = False
        self._pos = pos + MAGIC_SIZE
        self.batch_start = self.offset
        self._crc = crc_seed(self.batch_start)
        self.last_check_end = self.offset
        return True

    def next_batch(
        self, puts: list[int] | list[int | range] | None = None,
        flags: dict[int, int] | None = None,
        delays: dict[int, int] | None = None, headers: dict[int, bytes] | None = None,
        *, ranges: bool = False,
    ) -> Batch | EndOfData | TornTail | Sentinel:
        """Fast path for sealed files: skip to the end of the next checked batch.

        Walks record headers without building records and verifies the batch's
        crc in one call. Call it only at a batch boundary (right after the
        magic, a check record, or a previous batch). Bytes after the last check
        record that do not end in one are reported as a `TornTail`.

        With `puts`, the file offset of each PUT record of a returned `Batch` is
        appended to it (bulk readers take the records' fields from there); nothing
        is appended when anything else is returned. With `flags`, the flags of each
        PUT led by a FLAGS record are set there under the PUT's offset (it may also
        get offsets of a batch not yet returned: look up only offsets in `puts`).
        With `delays`, likewise the due time of each PUT led by a DELAY record; with
        `headers`, the headers block of each PUT led by a HEADERS record (not checked
        here: `journal.headers` raises on a malformed one when it is read).
        With `ranges`, each run of equal PUTs walked column by column goes into `puts` as
        one `range` of their offsets (ascending, not empty) instead of offset by offset: a
        bulk reader takes a run's fields with strided reads (`puts` is then a
        `list[int | range]`, its offsets in file order when expanded).
        """
        if self._error is not None:
            raise self._error
        if self._done is not None:
            return self._done
        mark = len(puts) if puts is not None else 0
        try:
            ev = self._batch(puts, flags, delays, headers, ranges)
        except CorruptRecordError as exc:
            self._error = exc
            if puts is not None:
                del puts[mark:]
            raise
        if puts is not None and not isinstance(ev, Batch):
            del puts[mark:]
        return ev

    def _batch(
        self, puts: list[int] | list[int | range] | None, flags: dict[int, int] | None,
        delays: dict[int, int] | None = None, headers: dict[int, bytes] | None = None,
        ranges: bool = False,
    ) -> Batch | EndOfData | TornTail | Sentinel:
        if self._magic_pending and not self._take_magic():
            return NEED_DATA
        if self.offset != self.batch_start:
            raise RuntimeError("next_batch called inside a batch")
        buf = self._buf
        n = len(buf)
        start = pos = self._pos
        base = self._base
        # The batch's PUTs, file offsets (with `ranges`, a run of them may be one range).
        offsets: list[int | range] = [] if puts is None else puts  # type: ignore[assignment]
        mark = len(offsets)
        in_ranges = 0  # offsets in ranges, less one per range (count = len + in_ranges)
        note = offsets.append
        data_bytes = 0
        last = -1  # the data size of the PUT before
        delayed = marks = 0
        cap = self.max_data_size
        unpack_i32 = I32_STRUCT.unpack_from
        unpack_size_id = SIZE_ID_STRUCT.unpack_from
        unpack_check, ext_byte = CHECK_STRUCT.unpack_from, EXT_BYTE
        put_byte, put_expire_byte = PUT_BYTE, PUT_EXPIRE_BYTE
        while True:
            # The hot path of recovery and scans: a run of PUT records, size and id in
            # one unpack, the bounds checked by the indexing itself.
            try:
                while True:
                    cmd = buf[pos]
                    if cmd == put_byte:
                        hdr = PUT_HEADER_SIZE
                    elif cmd == put_expire_byte:
                        hdr = PUT_EXPIRE_HEADER_SIZE
                    else:
                        break
                    size, xid = unpack_size_id(buf, pos)
                    if not 0 <= size <= cap:
                        raise CorruptRecordError(base + pos, f"bad data size {size}")
                    if xid <= 0:
                        raise CorruptRecordError(base + pos, f"PUT with non-positive id {xid}")
                    note(base + pos)
                    data_bytes += size
                    pos += hdr + size
                    if size == last and pos + _RUN_MIN * (hdr + size) <= n:
                        # Equal items (a writer's batch of one size): the rest of the run
                        # column by column.
                        stride = hdr + size
                        lead_bytes = bytes(buf[pos - stride:pos - stride + 5])
                        window, k = RUN_WINDOW, 0
                        while True:  # windows of doubling size, up to the run's end
                            got = _equal_puts(buf, pos + k * stride,
                                              min(n, pos + (k + window) * stride), stride,
                                              lead_bytes)
                            k += got
                            if got < window:
                                break
                            window *= 2
                        run = range(base + pos, base + pos + k * stride, stride)
                        if not ranges:
                            offsets.extend(run)
                        elif k:
                            note(run)
                            in_ranges += k - 1
                        data_bytes += k * size
                        pos += k * stride
                    last = size
            except (IndexError, struct.error):  # past the bytes received so far
                return self._short_batch(start, n)
            check_size = 0
            lead = False  # an item's flags or due time: its PUT follows (the fast loop's)
            if cmd == ext_byte:  # ours: the kind tells (a check ends every batch: first)
                if pos + CHECK_RECORD_SIZE <= n:
                    _, size, kind, length, crc = unpack_check(buf, pos)
                elif pos + EXT_HEAD_SIZE <= n:
                    size, kind, length, crc = -1, buf[pos + EXT_HEAD_SIZE - 1], 0, 0
                else:
                    return self._short_batch(start, n)
                if kind == EXT_CHECK:
                    if size < 0:
                        return self._short_batch(start, n)
                    if size != EXT_CHECK_DATA_SIZE:
                        _ext_kind(buf, pos, size, base + pos)  # raises
                    check_size = CHECK_RECORD_SIZE
                elif kind == EXT_HEADERS:
                    at = _batch_headers(buf, pos, n, base, cap, headers)
                    if at < 0:
                        return self._short_batch(start, n)
                    pos = at
                    continue
                else:
                    lead = kind in (EXT_FLAGS, EXT_DELAY)
            elif cmd == OLD_CHECK_BYTE:
                if pos + OLD_CHECK_RECORD_SIZE > n:
                    return self._short_batch(start, n)
                _, length, crc = OLD_CHECK_STRUCT.unpack_from(buf, pos)
                check_size = OLD_CHECK_RECORD_SIZE
            else:
                lead = cmd in (OLD_FLAGS_BYTE, OLD_DELAY_BYTE)
            if lead:
                at, more = _batch_lead(buf, pos, n, base, flags, delays)
                if at < 0:
                    return self._short_batch(start, n)
                delayed += more
                pos = at
                continue
            if cmd == 0:
                if pos == start:
                    self._done = EndOfData(base + pos, zero_byte=True)
                    return self._done
                self._done = TornTail(base + start, pos - start)
                return self._done
            if check_size:
                found = _crc32(memoryview(buf)[start:pos], crc_seed(base + start))
                if length != pos - start or crc != found:
                    raise ChecksumMismatchError(
                        base + pos,
                        f"check record covers {length} bytes crc {crc:08x}, "
                        f"found {pos - start} bytes crc {found:08x}",
                    )
                end = pos + check_size
                self._pos = end
                self.batch_start = self.last_check_end = base + end
                self._crc = crc_seed(self.batch_start)
                self.sealed = True
                count = len(offsets) - mark + in_ranges
                if not count:
                    return Batch(base + start, base + end, 0, 0, 0, 0, 0, marks, check_size)
                head, tail = offsets[mark], offsets[-1]
                at = head if isinstance(head, int) else head[0]
                to = tail if isinstance(tail, int) else tail[-1]
                first = I64_STRUCT.unpack_from(buf, at - base + PUT_ID_AT)[0]
                last = I64_STRUCT.unpack_from(buf, to - base + PUT_ID_AT)[0]
                return Batch(base + start, base + end, count, first, last, data_bytes, delayed,
                             marks, check_size)
            hdr, problem = _need(cmd)
            if problem is not None:
                raise CorruptRecordError(base + pos, problem)
            if pos + hdr > n:
                return self._short_batch(start, n)
            size = 0
            if cmd >= 0x80:
                size = unpack_i32(buf, pos + 1)[0]
                if size < 0 or size > cap:
                    raise CorruptRecordError(base + pos, f"bad data size {size}")
                # (Every valid PUT took the fast path above: _need refuses other sizes.)
                # a COMPACTED, INCARNATION, PRODUCER, DEDUP or a later release's kind
                if cmd == EXT_BYTE and (kind := _ext_kind(buf, pos, size, base + pos)) in (
                        EXT_PRODUCER, EXT_DEDUP):
                    if pos + hdr + size > n:
                        return self._short_batch(start, n)
                    if (decode_producer if kind == EXT_PRODUCER else decode_dedup)(
                            buf, pos, size) is None:
                        name = "PRODUCER" if kind == EXT_PRODUCER else "DEDUP"
                        raise CorruptRecordError(base + pos, f"{name} record of {size} "
                                                 "data bytes that do not add up")
                    marks += 1
                if cmd >> 4 == CMD_READ_DONE and size % 8:
                    raise CorruptRecordError(
                        base + pos, f"READ_DONE data size {size} not a multiple of 8"
                    )
                if (cmd >> 4 == CMD_READ_ERRORS and self.detected_kind is FileKind.READER
                        and (cmd != READ_ERRORS_BYTE or size % ERROR_ENTRY_STRUCT.size)):
                    raise CorruptRecordError(base + pos, f"bad READ_ERRORS record ({cmd:#x}, "
                                             f"{size} data bytes)")
                if (cmd >> 4 == CMD_READ_DELAYS and self.detected_kind is FileKind.READER
                        and (cmd != READ_DELAYS_BYTE or size % DELAY_ENTRY_STRUCT.size)):
                    raise CorruptRecordError(base + pos, f"bad READ_DELAYS record ({cmd:#x}, "
                                             f"{size} data bytes)")
            pos += hdr + size

    def _short_batch(self, start: int, n: int) -> EndOfData | TornTail | Sentinel:
        if self._eof:
            if n == start:
                self._done = EndOfData(self._base + start, zero_byte=False)
                return self._done
            self._pos = start
            self._done = TornTail(self._base + start, n - start)
            return self._done
        return NEED_DATA

    def _short(self, avail: int) -> Event:
        if self._eof:
            self._done = TornTail(self.offset, avail)
            return self._done
        return NEED_DATA


@dataclass(frozen=True, slots=True)
class SegmentHead:
    """What the first bytes of a writer segment say (see journal_records.segment_head)."""

    start: int  # where its first batch begins; 0 when the file is not sealed (no empty check)
    compacted: Compacted | None  # the COMPACTED marker of a compaction's output
    incarnation: int  # 0 when it names none


def read_segment_head(head: bytes | bytearray | memoryview) -> SegmentHead:
    """The seal, COMPACTED marker and incarnation that the first SEGMENT_HEAD_MAX (or
    more) bytes of a writer segment name, in either form: a first batch of only
    COMPACTED and INCARNATION records, checked by its check record. Anything else there
    (items, damage, too few bytes) names neither."""
    start = sealed_start(head)
    if not start:
        return SegmentHead(0, None, 0)
    dec = RecordDecoder(FileKind.WRITER)
    dec.receive_data(head)
    compacted: Compacted | None = None
    incarnation = 0
    try:
        while True:
            ev = dec.next_event()
            if not isinstance(ev, Decoded):
                break
            rec = ev.record
            if ev.offset < start:
                continue  # the empty check
            if isinstance(rec, Compacted) and compacted is None and not incarnation:
                compacted = rec
            elif isinstance(rec, Incarnation) and not incarnation:
                incarnation = rec.incarnation
            elif isinstance(rec, Check):
                return SegmentHead(start, compacted, incarnation)
            else:
                break
    except CorruptRecordError:
        pass
    return SegmentHead(start, None, 0)


def head_incarnation(head: bytes | bytearray | memoryview) -> int:
    """The incarnation a segment's first bytes name (see `read_segment_head`), 0 if none."""
    return read_segment_head(head).incarnation


def decode_all(data: bytes, kind: FileKind | None = FileKind.WRITER) -> list[Decoded]:
    """Every record of a whole file held in memory; raises on anything but a clean end."""
    dec = RecordDecoder(kind)
    dec.receive_data(data)
    dec.receive_data(b"")
    out: list[Decoded] = []
    while True:
        ev = dec.next_event()
        if isinstance(ev, Decoded):
            out.append(ev)
        elif isinstance(ev, TornTail):
            raise CorruptRecordError(ev.offset, f"torn record ({ev.available} bytes present)")
        else:
            return out


#: CRC work (bytes) find_valid_check_after may spend before giving up undecided.
CHECK_SEARCH_BUDGET: Final = 1 << 30


def find_valid_check_after(
    data: bytes | bytearray | memoryview, start: int, base: int = 0,
    budget: int = CHECK_SEARCH_BUDGET,
) -> int | None:
    """Index of the first check record in `data[start:]` whose crc verifies,
    `data[0]` being at file offset `base`; None when there is none; -1 when
    `budget` bytes of CRC work did not settle it (crafted data can hold a
    candidate at every byte), which callers must treat as "maybe".

    Check records of both forms count (a segment of an earlier release may have had
    batches of this one appended). A check record carries the length of what it covers,
    so it can be found
    without parsing what precedes it: this is how recovery tells a torn tail
    (nothing valid after the damage) from corruption in the middle (a later
    batch still verifies, so acknowledged data follows the damage).
    """
    buf = data if isinstance(data, bytes | bytearray) else bytes(data)
    old_marker = bytes([OLD_CHECK_BYTE])  # a check record of an earlier release
    at_new, at_old = buf.find(CHECK_MARK, start), buf.find(old_marker, start)
    while at_new >= 0 or at_old >= 0:  # the candidates of both forms, in file order
        if at_old < 0 or 0 <= at_new < at_old:
            pos, at_new = at_new, buf.find(CHECK_MARK, at_new + 1)
        else:
            pos, at_old = at_old, buf.find(old_marker, at_old + 1)
        found = check_at(buf, pos)
        if found is None:
            continue
        length, crc, _ = found
        begin = pos - length
        if 0 < length <= pos - start:
            budget -= length
            if budget < 0:
                return -1
            if zlib.crc32(memoryview(buf)[begin:pos], crc_seed(base + begin)) == crc:
                return pos
    return None
