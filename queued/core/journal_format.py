"""Journal records <-> bytes, the incremental decoder, and journal file names.

Owns the byte layout of seed 002 (Kestrel's journal) plus our checksum record.
PURE: no file, clock, socket or trio access here — it takes bytes and returns
values, so recovery, `queued dump`, hypothesis tests and Spark all share it.
"""

from __future__ import annotations

import enum
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from queued.core.errors import BadMagicError, ChecksumMismatchError, CorruptRecordError

# -- magic bytes and command numbers (seed 002) ---------------------------------

WRITER_MAGIC: Final = b"\x27\x64\x26\x03"
READER_MAGIC: Final = b"\x26\x3c\x26\x03"
MAGIC_SIZE: Final = 4

CMD_READ_HEAD: Final = 0
CMD_COMPACTED: Final = 6  # ours: marks a segment rewritten by compaction
CMD_CHECK: Final = 7  # ours: unused by the seed, no data block, so seed readers skip it
CMD_PUT: Final = 8
CMD_READ_DONE: Final = 9

PUT_BYTE: Final = 0x86  # command 8, 6 header words
PUT_EXPIRE_BYTE: Final = 0x88  # command 8, 8 header words
READ_HEAD_BYTE: Final = 0x02  # command 0, 2 header words
READ_DONE_BYTE: Final = 0x91  # command 9, 1 header word (the data byte count)
CHECK_BYTE: Final = 0x72  # command 7, 2 header words: covered length, crc32
COMPACTED_BYTE: Final = 0x64  # command 6, 4 header words: i64 first, i64 last segment number

_PUT = struct.Struct("<Biiqq")  # cmd, size, error_count, id, add_time
_PUT_EXPIRE = struct.Struct("<Biiqqq")  # ... expire_time
_READ_HEAD = struct.Struct("<Bq")
_READ_DONE_HDR = struct.Struct("<Bi")
_CHECK = struct.Struct("<BII")
_COMPACTED = struct.Struct("<Bqq")
_Q = struct.Struct("<q")
_SIZE_ID = struct.Struct("<xi4xq")  # a PUT's data size and id
PUT_ID_AT: Final = 9  # a PUT's id (i64): after the command byte, size and error count
_I32 = struct.Struct("<i")

PUT_HEADER_SIZE: Final = _PUT.size  # 25
PUT_EXPIRE_HEADER_SIZE: Final = _PUT_EXPIRE.size  # 33
CHECK_RECORD_SIZE: Final = _CHECK.size  # 9

MAX_ID: Final = (1 << 63) - 1
MAX_DATA_SIZE: Final = (1 << 31) - 1
_U64 = struct.Struct("<Q")


def crc_seed(offset: int) -> int:
    """The CRC a batch starting at file offset `offset` begins from.

    Seeding with the offset ties a check record to its place in the file, so
    bytes that merely look like a valid batch (an item's payload holding a
    crafted check record, say) do not verify anywhere else.
    """
    return zlib.crc32(_U64.pack(offset))


#: A check record covering nothing; written right after the magic of every file
#: we create, so recovery knows the file is sealed (ours) even if its first
#: batch is torn.
EMPTY_CHECK: Final = _CHECK.pack(CHECK_BYTE, 0, crc_seed(MAGIC_SIZE))


# -- records --------------------------------------------------------------------


@dataclass(slots=True)
class Put:
    """An item added to a queue (writer files only).

    Treat it as frozen. It is not declared frozen because one is made per item on
    every hot path (put, recovery, read-behind), and a frozen dataclass's __init__
    costs about 4x more (object.__setattr__ per field).
    """

    id: int
    data: bytes
    add_time_ms: int
    expire_time_ms: int | None = None
    error_count: int = 0


@dataclass(frozen=True, slots=True)
class ReadHead:
    """A reader's head: every id <= head has been consumed (0 = nothing yet)."""

    id: int


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Ids above the head that were confirmed out of order, sorted ascending."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Check:
    """Our checksum record: crc32 of the `length` bytes before it."""

    length: int
    crc: int


@dataclass(frozen=True, slots=True)
class Compacted:
    """Ours: this segment replaces segments numbered first..last (itself is `last`).

    Written first in a compaction's output, so recovery can finish a compaction
    that crashed after the rename by removing the replaced segments.
    """

    first_number: int
    last_number: int


@dataclass(frozen=True, slots=True)
class Unknown:
    """A record with a command number we do not know; skipped, kept for reports."""

    command: int
    header_words: int
    data_size: int


Record = Put | ReadHead | ReadDone | Check | Compacted | Unknown


def encode_put(put: Put) -> bytes:
    data = put.data
    if not 0 < put.id <= MAX_ID:
        raise ValueError(f"item id out of range: {put.id}")
    if len(data) > MAX_DATA_SIZE:
        raise ValueError("item data larger than 2 GiB - 1")
    try:
        if put.expire_time_ms is None:
            head = _PUT.pack(PUT_BYTE, len(data), put.error_count, put.id, put.add_time_ms)
        else:
            head = _PUT_EXPIRE.pack(
                PUT_EXPIRE_BYTE, len(data), put.error_count, put.id, put.add_time_ms,
                put.expire_time_ms,
            )
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None
    return head + data


def put_header_packer(
    add_time_ms: int, expire_time_ms: int | None = None, error_count: int = 0
) -> Callable[[int, int], bytes]:
    """A function (data size, id) -> PUT header bytes, for many items sharing the
    other fields. Raises ValueError at once when a shared field is out of range."""
    try:
        if expire_time_ms is None:
            _PUT.pack(PUT_BYTE, 0, error_count, 1, add_time_ms)
            pack, cmd = _PUT.pack, PUT_BYTE
            return lambda size, xid: pack(cmd, size, error_count, xid, add_time_ms)
        _PUT_EXPIRE.pack(PUT_EXPIRE_BYTE, 0, error_count, 1, add_time_ms, expire_time_ms)
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None
    pack_e = _PUT_EXPIRE.pack
    return lambda size, xid: pack_e(
        PUT_EXPIRE_BYTE, size, error_count, xid, add_time_ms, expire_time_ms
    )


def encode_read_head(head: ReadHead) -> bytes:
    return _READ_HEAD.pack(READ_HEAD_BYTE, head.id)


def encode_read_done(done: ReadDone) -> bytes:
    ids = done.ids
    return _READ_DONE_HDR.pack(READ_DONE_BYTE, 8 * len(ids)) + struct.pack(f"<{len(ids)}q", *ids)


def encode_check(covered: bytes | bytearray | memoryview, offset: int) -> bytes:
    """The check record sealing `covered`: the bytes since the previous check,
    which start at file offset `offset`."""
    return _CHECK.pack(CHECK_BYTE, len(covered), zlib.crc32(covered, crc_seed(offset)))


def encode_record(record: Record) -> bytes:
    if isinstance(record, Put):
        return encode_put(record)
    if isinstance(record, ReadHead):
        return encode_read_head(record)
    if isinstance(record, ReadDone):
        return encode_read_done(record)
    if isinstance(record, Check):
        return _CHECK.pack(CHECK_BYTE, record.length, record.crc)
    if isinstance(record, Compacted):
        return _COMPACTED.pack(COMPACTED_BYTE, record.first_number, record.last_number)
    raise TypeError(f"cannot encode {record!r}")


def encode_check_crc(length: int, crc: int) -> bytes:
    """A check record from a crc already computed (from crc_seed(offset) on)."""
    return _CHECK.pack(CHECK_BYTE, length, crc)


def seal(batch: bytes | bytearray, offset: int) -> bytes:
    """`batch` followed by the check record covering it, for file offset `offset`."""
    return bytes(batch) + encode_check(batch, offset)


def encode_checkpoint(head: int, done_ids: tuple[int, ...] | list[int]) -> bytes:
    """A whole reader file: magic, seal, READ_HEAD, READ_DONE, seal."""
    body = encode_read_head(ReadHead(head)) + encode_read_done(ReadDone(tuple(sorted(done_ids))))
    return READER_MAGIC + EMPTY_CHECK + seal(body, MAGIC_SIZE + CHECK_RECORD_SIZE)


# -- decoding -------------------------------------------------------------------


class FileKind(enum.Enum):
    WRITER = "writer"
    READER = "reader"


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = Sentinel.NEED_DATA


@dataclass(frozen=True, slots=True)
class EndOfData:
    """Valid data ends at `offset`: a zero command byte, or the input ended on a boundary."""

    offset: int
    zero_byte: bool


@dataclass(frozen=True, slots=True)
class TornTail:
    """The input ended `missing` bytes short of completing the record at `offset`."""

    offset: int
    available: int


@dataclass(frozen=True, slots=True)
class Batch:
    """A verified batch: bytes [offset, end) ending in a good check record."""

    offset: int
    end: int
    count: int  # PUT records in it
    first_id: int  # 0 when count == 0
    last_id: int
    data_bytes: int = field(default=0, compare=False)  # item data in its PUT records


@dataclass(frozen=True, slots=True)
class Decoded:
    """One record and where it sits: bytes [offset, end) of the file."""

    record: Record
    offset: int
    end: int


Event = Decoded | EndOfData | TornTail | Sentinel


#: PUT header layouts: (cmd, size, error_count, id, add_time[, expire_time]). Public for
#: bulk readers that walk batches `RecordDecoder.next_batch` has verified (journal_scan).
PUT_STRUCT = _PUT
PUT_EXPIRE_STRUCT = _PUT_EXPIRE


def record_length(buf: bytes | bytearray | memoryview, pos: int) -> int:
    """Bytes (header and data) of the record at buf[pos], which a decoder has already
    checked for shape: only command bytes >= 0x80 carry data, sized by their first word."""
    cmd = buf[pos]
    data = _I32.unpack_from(buf, pos + 1)[0] if cmd >= 0x80 else 0
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
    if command >= 8 and words == 0:
        return 0, f"command {command} carries data but has no header"
    return 1 + 4 * words, None


class RecordDecoder:
    """Incremental decoder for one journal file, h11-style.

    Feed bytes with `receive_data` (b"" means end of file), pull events with
    `next_event`: a `Decoded` record, `NEED_DATA`, `EndOfData` or `TornTail`.
    Corruption raises `CorruptRecordError` (a subclass for bad magic or a
    checksum mismatch) and leaves the decoder in an error state.

    Checksums: bytes are summed from the end of the previous check record; a
    check record that disagrees raises `ChecksumMismatchError`. `last_check_end`
    is the offset after the last verified check record (the last good batch).
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
        size = 0
        if command >= 8:
            size = _I32.unpack_from(buf, pos + 1)[0]
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
                _, _, errs, xid, added = _PUT.unpack_from(buf, pos)
                expire = None
            else:
                _, _, errs, xid, added, expire = _PUT_EXPIRE.unpack_from(buf, pos)
            if xid <= 0:
                raise CorruptRecordError(start, f"PUT with non-positive id {xid}")
            record = Put(xid, bytes(buf[pos + hdr : pos + total]), added, expire, errs)
        elif command == CMD_READ_HEAD:
            record = ReadHead(_READ_HEAD.unpack_from(buf, pos)[1])
        elif command == CMD_READ_DONE:
            if size % 8:
                raise CorruptRecordError(start, f"READ_DONE data size {size} not a multiple of 8")
            ids = struct.unpack_from(f"<{size // 8}q", buf, pos + hdr)
            record = ReadDone(ids)
        elif command == CMD_CHECK:
            _, length, crc = _CHECK.unpack_from(buf, pos)
            covered = start - self.batch_start
            if length != covered or crc != self._crc:
                raise ChecksumMismatchError(
                    start,
                    f"check record covers {length} bytes crc {crc:08x}, "
                    f"found {covered} bytes crc {self._crc:08x}",
                )
            record = Check(length, crc)
        elif command == CMD_COMPACTED:
            _, first_number, last_number = _COMPACTED.unpack_from(buf, pos)
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

    def next_batch(self, puts: list[int] | None = None) -> Batch | EndOfData | TornTail | Sentinel:
        """Fast path for sealed files: skip to the end of the next checked batch.

        Walks record headers without building records and verifies the batch's
        crc in one call. Call it only at a batch boundary (right after the
        magic, a check record, or a previous batch). Bytes after the last check
        record that do not end in one are reported as a `TornTail`.

        With `puts`, the file offset of each PUT record of a returned `Batch` is
        appended to it (bulk readers take the records' fields from there); nothing
        is appended when anything else is returned.
        """
        if self._error is not None:
            raise self._error
        if self._done is not None:
            return self._done
        mark = len(puts) if puts is not None else 0
        try:
            ev = self._batch(puts)
        except CorruptRecordError as exc:
            self._error = exc
            if puts is not None:
                del puts[mark:]
            raise
        if puts is not None and not isinstance(ev, Batch):
            del puts[mark:]
        return ev

    def _batch(self, puts: list[int] | None) -> Batch | EndOfData | TornTail | Sentinel:
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
        cap = self.max_data_size
        unpack_i32 = _I32.unpack_from
        unpack_size_id = _SIZE_ID.unpack_from
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
                _, length, crc = _CHECK.unpack_from(buf, pos)
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
                first = _Q.unpack_from(buf, offsets[mark] - base + PUT_ID_AT)[0]
                last = _Q.unpack_from(buf, offsets[-1] - base + PUT_ID_AT)[0]
                return Batch(base + start, base + end, count, first, last, data_bytes)
            elif cmd == 0:
                if pos == start:
                    self._done = EndOfData(base + pos, zero_byte=True)
                    return self._done
                self._done = TornTail(base + start, pos - start)
                return self._done
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
        _, length, crc = _CHECK.unpack_from(buf, pos)
        begin = pos - length
        if 0 < length <= pos - start:
            budget -= length
            if budget < 0:
                return -1
            if zlib.crc32(memoryview(buf)[begin:pos], crc_seed(base + begin)) == crc:
                return pos
        pos = buf.find(marker, pos + 1)
    return None


# -- file names -----------------------------------------------------------------

NAME_RE: Final = re.compile(r"[A-Za-z0-9_:\-]{1,250}")
TEMP_MARK: Final = "~~"


class FileRole(enum.Enum):
    SEGMENT = "segment"
    CHECKPOINT = "checkpoint"
    TEMP = "temp"


@dataclass(frozen=True, slots=True)
class JournalFileName:
    queue: str
    role: FileRole
    number: int = 0  # segments
    reader: str = ""  # checkpoints ("" = the default reader)


def valid_name(name: str) -> bool:
    return NAME_RE.fullmatch(name) is not None


#: Longest file name most file systems take (NAME_MAX).
NAME_MAX: Final = 255
#: Segment numbers are creation times in ms: 13 digits until the year 2286.
_LONGEST_NUMBER: Final = 10**13


def names_fit(queue: str, reader: str | None = None) -> bool:
    """True if every file of queue (or of its reader) stays within NAME_MAX bytes.

    The name grammar allows 250 characters, but `q.<13 digits>~~` must fit in 255,
    and so must `q.read.<reader>~~`.
    """
    name = segment_name(queue, _LONGEST_NUMBER) if reader is None else checkpoint_name(
        queue, reader)
    return len(temp_name(name).encode()) <= NAME_MAX


def segment_name(queue: str, number: int) -> str:
    return f"{queue}.{number}"


def checkpoint_name(queue: str, reader: str = "") -> str:
    return f"{queue}.read.{reader}"


def temp_name(final_name: str) -> str:
    return final_name + TEMP_MARK


def parse_file_name(name: str) -> JournalFileName | None:
    """What a data-directory entry is, or None when it is not a journal file."""
    queue, dot, rest = name.partition(".")
    if not dot or not valid_name(queue):
        return None
    if TEMP_MARK in name:
        return JournalFileName(queue, FileRole.TEMP)
    if rest.isdigit() and rest.isascii() and (rest == "0" or rest[0] != "0"):
        return JournalFileName(queue, FileRole.SEGMENT, number=int(rest))
    if rest.startswith("read."):
        reader = rest[5:]
        if reader == "" or valid_name(reader):
            return JournalFileName(queue, FileRole.CHECKPOINT, reader=reader)
    return None
