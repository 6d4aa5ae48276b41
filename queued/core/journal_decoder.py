"""The incremental decoder of journal files (h11-style) and the search for check records.

Owns telling records, torn tails and corruption apart in a stream of bytes.
PURE: takes bytes and returns values (queued.core.journal_records); no file,
clock, socket or trio access.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final

from queued.core.errors import BadMagicError, ChecksumMismatchError, CorruptRecordError
from queued.core.journal_records import (
    CHECK_BYTE,
    CHECK_RECORD_SIZE,
    CHECK_STRUCT,
    CMD_CHECK,
    CMD_COMPACTED,
    CMD_FLAGS,
    CMD_PUT,
    CMD_READ_DELAYS,
    CMD_READ_DONE,
    CMD_READ_ERRORS,
    CMD_READ_HEAD,
    COMPACTED_STRUCT,
    DELAY_BYTE,
    DELAY_ENTRY_STRUCT,
    DELAY_RECORD_SIZE,
    DELAY_STRUCT,
    ERROR_ENTRY_STRUCT,
    FLAGS_BYTE,
    FLAGS_RECORD_SIZE,
    FLAGS_STRUCT,
    I32_STRUCT,
    I64_STRUCT,
    MAGIC_SIZE,
    MAX_DATA_SIZE,
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
    Put,
    ReadDelays,
    ReadDone,
    ReadErrors,
    ReadHead,
    Record,
    Sentinel,
    TornTail,
    Unknown,
    crc_seed,
)
from queued.core.wire import NEED_DATA


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
    if command == CMD_CHECK and words != 2:
        return 0, f"CHECK with {words} header words (must be 2)"
    if command == CMD_COMPACTED and words != 4:
        return 0, f"COMPACTED with {words} header words (must be 4)"
    if command == CMD_FLAGS and words != 1:
        return 0, f"FLAGS with {words} header words (must be 1)"
    if command >= 8 and words == 0:
        return 0, f"command {command} carries data but has no header"
    return 1 + 4 * words, None


def _entries(name: str, entry: struct.Struct, buf: bytearray, pos: int, hdr: int, size: int,
             start: int) -> tuple[tuple[int, int], ...]:
    """The (id, value) entries of a READ_ERRORS or READ_DELAYS record at buf[pos]."""
    if hdr != 5:
        raise CorruptRecordError(start, f"{name} with {hdr // 4} header words (must be 1)")
    if size % entry.size:
        raise CorruptRecordError(start, f"{name} data size {size} not a multiple of "
                                        f"{entry.size}")
    return tuple(entry.unpack_from(buf, pos + hdr + k)
                 for k in range(0, size, entry.size))


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
    `DelayedPut`; a DELAY record followed by anything but a PUT is corrupt.
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
        self._buf = bytearray()
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
        if self._pos > 0 and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._base += self._pos
            self._pos = 0
        self._buf += data

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
        if cmd in (FLAGS_BYTE, DELAY_BYTE):  # another command 5 shape is someone else's
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
        if command == CMD_PUT:
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
        elif command == CMD_CHECK:
            _, length, crc = CHECK_STRUCT.unpack_from(buf, pos)
            covered = start - self.batch_start
            if length != covered or crc != self._crc:
                raise ChecksumMismatchError(
                    start,
                    f"check record covers {length} bytes crc {crc:08x}, "
                    f"found {covered} bytes crc {self._crc:08x}",
                )
            record = Check(length, crc)
        elif command == CMD_COMPACTED:
            _, first_number, last_number = COMPACTED_STRUCT.unpack_from(buf, pos)
            record = Compacted(first_number, last_number)
        else:
            record = Unknown(command, cmd & 0x0F, size)
        if command == CMD_CHECK:
            self.batch_start = start + total
            self._crc = crc_seed(self.batch_start)
            self.last_check_end = start + total
            self.sealed = True
        else:
            self._crc = zlib.crc32(memoryview(buf)[pos : pos + total], self._crc)
        self._pos = pos + total
        return Decoded(record, start, start + total)

    def _flagged_put(self, avail: int) -> Event:
        """A FLAGS and/or DELAY record and the PUT after them, as one Put carrying the
        flags (a DelayedPut carrying the due time too)."""
        buf, pos, start = self._buf, self._pos, self.offset
        at = pos
        flags = 0
        due: int | None = None
        if buf[at] == FLAGS_BYTE:
            flags = FLAGS_STRUCT.unpack_from(buf, at)[1]
            at += FLAGS_RECORD_SIZE
            if avail <= at - pos:
                return self._short(avail)
        if buf[at] == DELAY_BYTE:
            if avail < at - pos + DELAY_RECORD_SIZE + 1:
                return self._short(avail)
            due = DELAY_STRUCT.unpack_from(buf, at)[1]
            at += DELAY_RECORD_SIZE
        lead = "DELAY" if due is not None else "FLAGS"
        cmd = buf[at]
        if cmd == PUT_BYTE:
            hdr = PUT_HEADER_SIZE
        elif cmd == PUT_EXPIRE_BYTE:
            hdr = PUT_EXPIRE_HEADER_SIZE
        else:
            raise CorruptRecordError(start, f"{lead} record followed by command byte {cmd:#04x}, "
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
        record = (Put(xid, data, added, expire, errs, flags) if due is None
                  else DelayedPut(xid, data, added, expire, errs, flags, due))
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
        self, puts: list[int] | None = None, flags: dict[int, int] | None = None,
        delays: dict[int, int] | None = None,
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
        With `delays`, likewise the due time of each PUT led by a DELAY record.
        """
        if self._error is not None:
            raise self._error
        if self._done is not None:
            return self._done
        mark = len(puts) if puts is not None else 0
        try:
            ev = self._batch(puts, flags, delays)
        except CorruptRecordError as exc:
            self._error = exc
            if puts is not None:
                del puts[mark:]
            raise
        if puts is not None and not isinstance(ev, Batch):
            del puts[mark:]
        return ev

    def _batch(
        self, puts: list[int] | None, flags: dict[int, int] | None,
        delays: dict[int, int] | None = None,
    ) -> Batch | EndOfData | TornTail | Sentinel:
        if self._magic_pending and not self._take_magic():
            return NEED_DATA
        if self.offset != self.batch_start:
            raise RuntimeError("next_batch called inside a batch")
        buf = self._buf
        n = len(buf)
        start = pos = self._pos
        base = self._base
        offsets: list[int] = [] if puts is None else puts  # the batch's PUTs, file offsets
        mark = len(offsets)
        note = offsets.append
        data_bytes = 0
        delayed = 0
        cap = self.max_data_size
        unpack_i32 = I32_STRUCT.unpack_from
        unpack_size_id = SIZE_ID_STRUCT.unpack_from
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
            except (IndexError, struct.error):  # past the bytes received so far
                return self._short_batch(start, n)
            if cmd == CHECK_BYTE:
                if pos + CHECK_RECORD_SIZE > n:
                    return self._short_batch(start, n)
                _, length, crc = CHECK_STRUCT.unpack_from(buf, pos)
                found = zlib.crc32(memoryview(buf)[start:pos], crc_seed(base + start))
                if length != pos - start or crc != found:
                    raise ChecksumMismatchError(
                        base + pos,
                        f"check record covers {length} bytes crc {crc:08x}, "
                        f"found {pos - start} bytes crc {found:08x}",
                    )
                end = pos + CHECK_RECORD_SIZE
                self._pos = end
                self.batch_start = self.last_check_end = base + end
                self._crc = crc_seed(self.batch_start)
                self.sealed = True
                count = len(offsets) - mark
                if not count:
                    return Batch(base + start, base + end, 0, 0, 0, 0)
                first = I64_STRUCT.unpack_from(buf, offsets[mark] - base + PUT_ID_AT)[0]
                last = I64_STRUCT.unpack_from(buf, offsets[-1] - base + PUT_ID_AT)[0]
                return Batch(base + start, base + end, count, first, last, data_bytes, delayed)
            elif cmd == 0:
                if pos == start:
                    self._done = EndOfData(base + pos, zero_byte=True)
                    return self._done
                self._done = TornTail(base + start, pos - start)
                return self._done
            elif cmd == FLAGS_BYTE:  # an item's flags: its PUT follows (the fast loop's)
                at = pos + FLAGS_RECORD_SIZE
                if at >= n:
                    return self._short_batch(start, n)
                if buf[at] == DELAY_BYTE:  # flags, then a due time: the DELAY branch checks
                    if flags is not None:
                        flags[base + at + DELAY_RECORD_SIZE] = FLAGS_STRUCT.unpack_from(buf, pos)[1]
                    pos = at
                    continue
                if buf[at] != put_byte and buf[at] != put_expire_byte:
                    raise CorruptRecordError(base + pos, f"FLAGS record followed by command "
                                                         f"byte {buf[at]:#04x}, not a PUT")
                if flags is not None:
                    flags[base + at] = FLAGS_STRUCT.unpack_from(buf, pos)[1]
                pos = at
                continue
            elif cmd == DELAY_BYTE:  # an item's due time: its PUT follows (the fast loop's)
                at = pos + DELAY_RECORD_SIZE
                if at >= n:
                    return self._short_batch(start, n)
                if buf[at] != put_byte and buf[at] != put_expire_byte:
                    raise CorruptRecordError(base + pos, f"DELAY record followed by command "
                                                         f"byte {buf[at]:#04x}, not a PUT")
                if delays is not None:
                    delays[base + at] = DELAY_STRUCT.unpack_from(buf, pos)[1]
                delayed += 1
                pos = at
                continue
            else:
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

    A check record carries the length of what it covers, so it can be found
    without parsing what precedes it: this is how recovery tells a torn tail
    (nothing valid after the damage) from corruption in the middle (a later
    batch still verifies, so acknowledged data follows the damage).
    """
    buf = data if isinstance(data, bytes | bytearray) else bytes(data)
    n = len(buf)
    marker = bytes([CHECK_BYTE])
    pos = buf.find(marker, start)
    while pos >= 0 and pos + CHECK_RECORD_SIZE <= n:
        _, length, crc = CHECK_STRUCT.unpack_from(buf, pos)
        begin = pos - length
        if 0 < length <= pos - start:
            budget -= length
            if budget < 0:
                return -1
            if zlib.crc32(memoryview(buf)[begin:pos], crc_seed(base + begin)) == crc:
                return pos
        pos = buf.find(marker, pos + 1)
    return None
