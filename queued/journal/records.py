"""Journal records and their bytes: magic, command bytes, layouts, encoding, decoder events.

Owns the byte layout of seed 002 (Kestrel's journal) plus ours: the extension envelope
(command 13: check, FLAGS, DELAY, COMPACTED, INCARNATION, PRODUCER, HEADERS, DEDUP), the
older forms of those
records (still read, never written), and READ_ERRORS / READ_DELAYS (reader files); and
the values decoding yields. PURE: no file, clock, socket or trio access;
queued.journal.format is the one import for users.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from queued.sansio import MAX_DEDUP_KEY, MAX_DELAY_MS, NeedData

__all__ = ["MAX_DEDUP_KEY", "MAX_DELAY_MS"]  # (re-exported: journal_format lists every name)

#: (a C static compiled, rather than a look-up in the module's globals at each use)
crc32: Final = zlib.crc32

# -- magic bytes and command numbers (seed 002) ---------------------------------

WRITER_MAGIC: Final = b"\x27\x64\x26\x03"
READER_MAGIC: Final = b"\x26\x3c\x26\x03"
MAGIC_SIZE: Final = 4

CMD_READ_HEAD: Final = 0
CMD_PUT: Final = 8
CMD_READ_DONE: Final = 9
CMD_READ_DELAYS: Final = 10  # ours, reader files only: due times aborts gave (a data block)
CMD_READ_ERRORS: Final = 11  # ours, reader files only: abort error counts (a data block)
CMD_EXT: Final = 13  # ours: the extension envelope, every record we add (the kinds below)

PUT_BYTE: Final = 0x86  # command 8, 6 header words
PUT_EXPIRE_BYTE: Final = 0x88  # command 8, 8 header words
READ_HEAD_BYTE: Final = 0x02  # command 0, 2 header words
READ_DONE_BYTE: Final = 0x91  # command 9, 1 header word (the data byte count)
READ_ERRORS_BYTE: Final = 0xB1  # command 11, 1 header word (the data byte count)
READ_DELAYS_BYTE: Final = 0xA1  # command 10, 1 header word (the data byte count)

# The extension envelope. libkestrel's RecordReader (and any reader of the seed that skips
# an unknown record by its data size) steps over a command 8-15 with one header word
# whatever its data holds, so every record we add is one: EXT_BYTE, i32 data size, then
# the data block: a kind byte and the kind's fields (little-endian). One command for all
# of them, because only 13-15 were free: new records add a kind, not a command. 13, the
# lowest, leaves 14 and 15 free for what cannot be an envelope kind. A kind this
# version does not know is skipped like an unknown command (its bytes are still summed
# into the batch's check record). Kind 0 is never written (zeroed bytes are not a record).
EXT_BYTE: Final = 0xD1  # command 13, 1 header word (the data byte count)
EXT_CHECK: Final = 1  # u32 covered length, u32 crc32: ends a batch
EXT_FLAGS: Final = 2  # u32 memcache flags of the PUT that follows
EXT_DELAY: Final = 3  # i64 due time (unix ms) of the PUT that follows (after FLAGS)
EXT_COMPACTED: Final = 4  # i64 first, i64 last segment number a compaction replaced
EXT_INCARNATION: Final = 5  # i64: which life of its queue a segment belongs to
EXT_PRODUCER: Final = 6  # u8 id length, id, u64 sequence, i64 first id, u32 count, i64 ms
EXT_HEADERS: Final = 7  # the headers block (journal.headers) of the PUT that follows
EXT_DEDUP: Final = 8  # u8 key length, key, i64 first id, u32 count, i64 ms

# The older forms of the same records (written by releases before the envelope): a
# command byte with its fields as header words. Read everywhere, forever; never written.
# libkestrel releases skip them, but a reader skipping by data size alone does not.
OLD_CMD_FLAGS: Final = 4
OLD_CMD_DELAY: Final = 5
OLD_CMD_COMPACTED: Final = 6
OLD_CMD_CHECK: Final = 7
OLD_CMD_INCARNATION: Final = 12
OLD_CHECK_BYTE: Final = 0x72  # command 7, 2 header words: covered length, crc32
OLD_COMPACTED_BYTE: Final = 0x64  # command 6, 4 header words: i64 first, i64 last
OLD_FLAGS_BYTE: Final = 0x41  # command 4, 1 header word: u32 flags of the next PUT
OLD_DELAY_BYTE: Final = 0x52  # command 5, 2 header words: i64 due time of the next PUT
OLD_INCARNATION_BYTE: Final = 0xC3  # command 12, 3 header words: i32 0, i64 incarnation

#: Record layouts, shared with the decoder. The PUT ones also serve bulk readers
#: that walk batches `RecordDecoder.next_batch` has verified (journal_scan).
PUT_STRUCT: Final = struct.Struct("<Biiqq")  # cmd, size, error_count, id, add_time
PUT_EXPIRE_STRUCT: Final = struct.Struct("<Biiqqq")  # ... expire_time
READ_HEAD_STRUCT: Final = struct.Struct("<Bq")
READ_DONE_STRUCT: Final = struct.Struct("<Bi")
READ_ERRORS_STRUCT: Final = struct.Struct("<Bi")
READ_DELAYS_STRUCT: Final = struct.Struct("<Bi")
EXT_HEAD_STRUCT: Final = struct.Struct("<BiB")  # EXT_BYTE, data size, kind
CHECK_STRUCT: Final = struct.Struct("<BiBII")  # EXT_BYTE, 9, EXT_CHECK, length, crc
FLAGS_STRUCT: Final = struct.Struct("<BiBI")  # EXT_BYTE, 5, EXT_FLAGS, flags
DELAY_STRUCT: Final = struct.Struct("<BiBq")  # EXT_BYTE, 9, EXT_DELAY, due ms
COMPACTED_STRUCT: Final = struct.Struct("<BiBqq")  # EXT_BYTE, 17, EXT_COMPACTED, first, last
INCARNATION_STRUCT: Final = struct.Struct("<BiBq")  # EXT_BYTE, 9, EXT_INCARNATION, incarnation
PRODUCER_HEAD_STRUCT: Final = struct.Struct("<BiBB")  # EXT_BYTE, size, kind (PRODUCER/DEDUP), len
PRODUCER_TAIL_STRUCT: Final = struct.Struct("<QqIq")  # sequence, first id, count, time ms
DEDUP_TAIL_STRUCT: Final = struct.Struct("<qIq")  # first id, count, ms (after kind, length, key)
OLD_CHECK_STRUCT: Final = struct.Struct("<BII")
OLD_COMPACTED_STRUCT: Final = struct.Struct("<Bqq")
OLD_FLAGS_STRUCT: Final = struct.Struct("<BI")
OLD_DELAY_STRUCT: Final = struct.Struct("<Bq")
OLD_INCARNATION_STRUCT: Final = struct.Struct("<Biq")
ERROR_ENTRY_STRUCT: Final = struct.Struct("<qi")  # a READ_ERRORS entry: item id, error count
I32_HEAD_STRUCT: Final = struct.Struct("<Bi")  # a command byte and one i32 header word
DELAY_ENTRY_STRUCT: Final = struct.Struct("<qq")  # a READ_DELAYS entry: item id, due time (unix ms)
I64_STRUCT: Final = struct.Struct("<q")
SIZE_ID_STRUCT: Final = struct.Struct("<xi4xq")  # a PUT's data size and id
PUT_ID_AT: Final = 9  # a PUT's id (i64): after the command byte, size and error count
I32_STRUCT: Final = struct.Struct("<i")

PUT_HEADER_SIZE: Final = PUT_STRUCT.size  # 25
PUT_EXPIRE_HEADER_SIZE: Final = PUT_EXPIRE_STRUCT.size  # 33
EXT_HEAD_SIZE: Final = EXT_HEAD_STRUCT.size  # 6: what tells one envelope kind from another
HEADERS_HEAD_SIZE: Final = EXT_HEAD_SIZE  # a HEADERS record: EXT_BYTE, 1 + block size, kind
CHECK_RECORD_SIZE: Final = CHECK_STRUCT.size  # 14
FLAGS_RECORD_SIZE: Final = FLAGS_STRUCT.size  # 10
DELAY_RECORD_SIZE: Final = DELAY_STRUCT.size  # 14
OLD_CHECK_RECORD_SIZE: Final = OLD_CHECK_STRUCT.size  # 9
OLD_FLAGS_RECORD_SIZE: Final = OLD_FLAGS_STRUCT.size  # 5
OLD_DELAY_RECORD_SIZE: Final = OLD_DELAY_STRUCT.size  # 9

#: The data size of each envelope kind this version knows (their fields are fixed).
EXT_CHECK_DATA_SIZE: Final = 9
EXT_DATA_SIZES: Final = {EXT_CHECK: EXT_CHECK_DATA_SIZE, EXT_FLAGS: 5, EXT_DELAY: 9,
                         EXT_COMPACTED: 17, EXT_INCARNATION: 9}


def ext_mark(kind: int) -> bytes:
    """The first EXT_HEAD_SIZE bytes of every record of a known envelope kind."""
    return EXT_HEAD_STRUCT.pack(EXT_BYTE, EXT_DATA_SIZES[kind], kind)


CHECK_MARK: Final = ext_mark(EXT_CHECK)
FLAGS_MARK: Final = ext_mark(EXT_FLAGS)
DELAY_MARK: Final = ext_mark(EXT_DELAY)
COMPACTED_MARK: Final = ext_mark(EXT_COMPACTED)
INCARNATION_MARK: Final = ext_mark(EXT_INCARNATION)

MAX_ID: Final = (1 << 63) - 1
MAX_DATA_SIZE: Final = (1 << 31) - 1
MAX_FLAGS: Final = (1 << 32) - 1  # memcache flags are 32-bit unsigned


def crc_seed(offset: int) -> int:
    """The CRC a batch starting at file offset `offset` begins from.

    Seeding with the offset ties a check record to its place in the file, so
    bytes that merely look like a valid batch (an item's payload holding a
    crafted check record, say) do not verify anywhere else.
    """
    # (compiled, `int.to_bytes` is mypyc's own op: 950 instructions with the crc, against
    # 1,100 through a `struct` pack, callgrind)
    return crc32(offset.to_bytes(8, "little"))


#: A check record covering nothing; written right after the magic of every file
#: we create, so recovery knows the file is sealed (ours) even if its first
#: batch is torn.
EMPTY_CHECK: Final = CHECK_STRUCT.pack(EXT_BYTE, 9, EXT_CHECK, 0, crc_seed(MAGIC_SIZE))
#: Its older form, which files of earlier releases start with.
OLD_EMPTY_CHECK: Final = OLD_CHECK_STRUCT.pack(OLD_CHECK_BYTE, 0, crc_seed(MAGIC_SIZE))


def check_at(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int, int] | None:
    """(covered length, crc, record size) of the check record, either form, wholly in
    `buf` at `pos`; None when there is none there."""
    if buf[pos:pos + EXT_HEAD_SIZE] == CHECK_MARK and pos + CHECK_RECORD_SIZE <= len(buf):
        _, _, _, length, crc = CHECK_STRUCT.unpack_from(buf, pos)
        return length, crc, CHECK_RECORD_SIZE
    if pos < len(buf) and buf[pos] == OLD_CHECK_BYTE and pos + OLD_CHECK_RECORD_SIZE <= len(buf):
        _, length, crc = OLD_CHECK_STRUCT.unpack_from(buf, pos)
        return length, crc, OLD_CHECK_RECORD_SIZE
    return None


def sealed_start(head: bytes | bytearray | memoryview) -> int:
    """Where the first batch of a file starting with `head` begins: after the magic and
    the empty check record (either form) of a sealed file; 0 when it has none (a file of
    the seed's writer, or a damaged one)."""
    new = MAGIC_SIZE + CHECK_RECORD_SIZE
    if head[MAGIC_SIZE:new] == EMPTY_CHECK:
        return new
    old = MAGIC_SIZE + OLD_CHECK_RECORD_SIZE
    if head[MAGIC_SIZE:old] == OLD_EMPTY_CHECK:
        return old
    return 0


# -- records --------------------------------------------------------------------


@dataclass(slots=True, init=False)
class Put:
    """An item added to a queue (writer files only).

    Treat it as frozen. It is not declared frozen because one is made per item on
    every hot path (put, recovery, read-behind), and a frozen dataclass's __init__
    costs about 4x more (object.__setattr__ per field).

    `flags`: the item's memcache flags (u32). Non-zero flags are journaled as a FLAGS
    record right before the PUT (seed readers skip it as an unknown record); flags 0
    write nothing. The field costs no memory: an object of five slots already takes
    the allocator's 80-byte size class, which holds a sixth.

    `headers`: b"" here; a HeadedPut (or a DelayedPut) holds an item's headers block.

    Its `__init__` is written out (the dataclass's, with `init=False`): a compiled class
    compiles one written in its body, while the one `dataclass` makes is Python, run on
    every item (and slower there than in a pure build). The same for its subclasses and
    the other objects made per request on the put path.
    """

    id: int
    data: bytes
    add_time_ms: int
    expire_time_ms: int | None = None
    error_count: int = 0
    flags: int = 0

    def __init__(self, id: int, data: bytes, add_time_ms: int,
                 expire_time_ms: int | None = None, error_count: int = 0,
                 flags: int = 0) -> None:
        self.id = id
        self.data = data
        self.add_time_ms = add_time_ms
        self.expire_time_ms = expire_time_ms
        self.error_count = error_count
        self.flags = flags

    def with_error_count(self, error_count: int) -> Put:
        """A copy with `error_count` (of its own class: a DelayedPut or HeadedPut
        stays one); `dataclasses.replace` would run the standard library's Python."""
        return Put(self.id, self.data, self.add_time_ms, self.expire_time_ms, error_count,
                   self.flags)

    @property
    def headers(self) -> bytes:
        """The item's headers block (queued.journal.headers); b"": none. Not a slot:
        a seventh slot moves every Put to the allocator's next size class."""
        return b""


@dataclass(slots=True, init=False)
class DelayedPut(Put):
    """A Put with a delay: invisible to readers until `due_ms` (unix ms).

    Journaled as a DELAY record right before the PUT (after its FLAGS record, if any);
    seed readers skip it as an unknown record and see a plain PUT. A subclass rather
    than a seventh slot on Put: a seventh slot moves every Put to the next allocator
    size class (+8 bytes per item held), and puts without a delay must pay nothing.
    `headers` (b"": none) is its eighth slot, in the same size class as seven.
    """

    due_ms: int = 0
    headers: bytes = b""

    def __init__(self, id: int, data: bytes, add_time_ms: int,
                 expire_time_ms: int | None = None, error_count: int = 0, flags: int = 0,
                 due_ms: int = 0, headers: bytes = b"") -> None:
        self.id = id
        self.data = data
        self.add_time_ms = add_time_ms
        self.expire_time_ms = expire_time_ms
        self.error_count = error_count
        self.flags = flags
        self.due_ms = due_ms
        self.headers = headers

    def with_error_count(self, error_count: int) -> Put:
        return DelayedPut(self.id, self.data, self.add_time_ms, self.expire_time_ms,
                          error_count, self.flags, self.due_ms, self.headers)


@dataclass(slots=True, init=False)
class HeadedPut(Put):
    """A Put with headers (and no delay: a delayed one is a DelayedPut with headers).

    Journaled as a HEADERS record leading the PUT (before its FLAGS and DELAY records);
    seed readers skip it. A subclass for the reason DelayedPut is one: items without
    headers pay nothing, not a slot, not a byte.
    """

    headers: bytes = b""

    def __init__(self, id: int, data: bytes, add_time_ms: int,
                 expire_time_ms: int | None = None, error_count: int = 0, flags: int = 0,
                 headers: bytes = b"") -> None:
        self.id = id
        self.data = data
        self.add_time_ms = add_time_ms
        self.expire_time_ms = expire_time_ms
        self.error_count = error_count
        self.flags = flags
        self.headers = headers

    def with_error_count(self, error_count: int) -> Put:
        return HeadedPut(self.id, self.data, self.add_time_ms, self.expire_time_ms,
                         error_count, self.flags, self.headers)


@dataclass(frozen=True, slots=True)
class ReadHead:
    """A reader's head: every id <= head has been consumed (0 = nothing yet)."""

    id: int


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Ids above the head that were confirmed out of order, sorted ascending."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadErrors:
    """Ours (reader files): the error counts of items this reader returned with an abort,
    (id, count) pairs; a later record for an id replaces an earlier one. PUT records are
    shared by every reader and never rewritten, so an abort's count lives here."""

    entries: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ReadDelays:
    """Ours (reader files): the due times of items this reader returned with an abort that
    carried a delay, (id, due ms) pairs; a later record for an id replaces an earlier one."""

    entries: tuple[tuple[int, int], ...]


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
class Incarnation:
    """Ours, at a segment's head: which life of its queue the segment belongs to."""

    incarnation: int


#: Longest producer id (bytes) a PRODUCER record holds; sequences are u64 from 1.
MAX_PRODUCER_ID: Final = 64
MAX_SEQUENCE: Final = (1 << 64) - 1
#: A PRODUCER record's data size without its id: kind, id length, the tail.
PRODUCER_FIXED_DATA: Final = 2 + PRODUCER_TAIL_STRUCT.size  # 30


@dataclass(frozen=True, slots=True)
class ProducerMark:
    """Ours (exactly-once puts): producer `producer` of this queue stored the put with
    sequence `sequence` as items `first_id` .. `first_id + count - 1` at `time_ms`.
    Journaled after the put's last PUT record, in the same batch; also what a queue's
    producer snapshot file (`q.producers`) holds, one per producer."""

    producer: bytes
    sequence: int
    first_id: int
    count: int
    time_ms: int


def producer_record(mark: ProducerMark) -> bytes:
    """The PRODUCER record of `mark` (extension kind 6, 35 + id length bytes)."""
    n = len(mark.producer)
    if not 0 < n <= MAX_PRODUCER_ID:
        raise ValueError(f"producer id of {n} bytes (1..{MAX_PRODUCER_ID})")
    return (PRODUCER_HEAD_STRUCT.pack(EXT_BYTE, PRODUCER_FIXED_DATA + n, EXT_PRODUCER, n)
            + mark.producer + PRODUCER_TAIL_STRUCT.pack(mark.sequence, mark.first_id,
                                                        mark.count, mark.time_ms))


def decode_producer(buf: bytes | bytearray | memoryview, pos: int, size: int,
                    ) -> ProducerMark | None:
    """The PRODUCER record at buf[pos] whose data size is `size`; None when its fields
    do not add up (the caller reports corruption)."""
    n = buf[pos + EXT_HEAD_SIZE] if size >= PRODUCER_FIXED_DATA else -1
    if n <= 0 or n > MAX_PRODUCER_ID or size != PRODUCER_FIXED_DATA + n:
        return None
    start = pos + PRODUCER_HEAD_STRUCT.size
    return ProducerMark(bytes(buf[start:start + n]),
                        *PRODUCER_TAIL_STRUCT.unpack_from(buf, start + n))


#: A DEDUP record's data size without its key: kind, key length, the tail.
DEDUP_FIXED_DATA: Final = 2 + DEDUP_TAIL_STRUCT.size  # 22


@dataclass(frozen=True, slots=True)
class DedupMark:
    """Ours (deduplication keys): the put carrying key `key` was stored as items
    `first_id` .. `first_id + count - 1` at `time_ms`. Journaled after the put's last PUT
    record, in the same batch; also what a queue's key snapshot file (`q.dedup`) holds."""

    key: bytes
    first_id: int
    count: int
    time_ms: int


def dedup_record(mark: DedupMark) -> bytes:
    """The DEDUP record of `mark` (extension kind 8, 27 + key length bytes)."""
    n = len(mark.key)
    if not 0 < n <= MAX_DEDUP_KEY:
        raise ValueError(f"deduplication key of {n} bytes (1..{MAX_DEDUP_KEY})")
    return (PRODUCER_HEAD_STRUCT.pack(EXT_BYTE, DEDUP_FIXED_DATA + n, EXT_DEDUP, n) + mark.key
            + DEDUP_TAIL_STRUCT.pack(mark.first_id, mark.count, mark.time_ms))


def decode_dedup(buf: bytes | bytearray | memoryview, pos: int, size: int) -> DedupMark | None:
    """The DEDUP record at buf[pos] whose data size is `size`; None when its fields do
    not add up (the caller reports corruption)."""
    n = buf[pos + EXT_HEAD_SIZE] if size >= DEDUP_FIXED_DATA else -1
    if n <= 0 or n > MAX_DEDUP_KEY or size != DEDUP_FIXED_DATA + n:
        return None
    start = pos + PRODUCER_HEAD_STRUCT.size
    return DedupMark(bytes(buf[start:start + n]), *DEDUP_TAIL_STRUCT.unpack_from(buf, start + n))


@dataclass(frozen=True, slots=True)
class Unknown:
    """A record with a command number (or, command EXT_BYTE's, a kind) we do not know;
    skipped, kept for reports."""

    command: int
    header_words: int
    data_size: int
    kind: int = 0  # an extension record's kind byte; 0 for other commands


Record = (Put | ReadHead | ReadDone | ReadErrors | ReadDelays | Check | Compacted | Incarnation
          | ProducerMark | DedupMark | Unknown)


def flags_record(flags: int) -> bytes:
    """What goes before a PUT for its flags: nothing for 0, else a FLAGS record."""
    if not 0 <= flags <= MAX_FLAGS:
        raise ValueError(f"flags out of range (0..{MAX_FLAGS}): {flags}")
    return FLAGS_STRUCT.pack(EXT_BYTE, 5, EXT_FLAGS, flags) if flags else b""


def delay_record(due_ms: int) -> bytes:
    """The DELAY record that goes right before a PUT (after its FLAGS record)."""
    try:
        return DELAY_STRUCT.pack(EXT_BYTE, 9, EXT_DELAY, due_ms)
    except struct.error:
        raise ValueError(f"due time out of range: {due_ms}") from None


def headers_record(block: bytes) -> bytes:
    """The HEADERS record that leads a PUT (before its FLAGS and DELAY records): the
    envelope around a headers block; b"" (no record) for an empty block."""
    if not block:
        return b""
    if len(block) >= MAX_DATA_SIZE:
        raise ValueError("headers block larger than 2 GiB")
    return EXT_HEAD_STRUCT.pack(EXT_BYTE, 1 + len(block), EXT_HEADERS) + block


def encode_put(put: Put) -> bytes:
    data = put.data
    if not 0 < put.id <= MAX_ID:
        raise ValueError(f"item id out of range: {put.id}")
    if len(data) > MAX_DATA_SIZE:
        raise ValueError("item data larger than 2 GiB - 1")
    try:
        if put.expire_time_ms is None:
            head = PUT_STRUCT.pack(PUT_BYTE, len(data), put.error_count, put.id, put.add_time_ms)
        else:
            head = PUT_EXPIRE_STRUCT.pack(
                PUT_EXPIRE_BYTE, len(data), put.error_count, put.id, put.add_time_ms,
                put.expire_time_ms,
            )
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None
    if type(put) is DelayedPut:
        head = delay_record(put.due_ms) + head
    if put.flags:
        head = flags_record(put.flags) + head
    if put.headers:
        return headers_record(put.headers) + head + data
    return head + data


def put_head(size: int, xid: int, add_time_ms: int, expire_time_ms: int | None = None,
             error_count: int = 0, flags: int = 0) -> bytes:
    """One PUT's header bytes (led by its FLAGS record when `flags` is not 0): what
    `put_header_packer(...)(size, xid)` gives, for a single item without making the
    packer. Raises ValueError when a field is out of range."""
    try:
        if expire_time_ms is None:
            head = PUT_STRUCT.pack(PUT_BYTE, size, error_count, xid, add_time_ms)
        else:
            head = PUT_EXPIRE_STRUCT.pack(PUT_EXPIRE_BYTE, size, error_count, xid, add_time_ms,
                                          expire_time_ms)
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None
    return flags_record(flags) + head if flags else head


def put_header_packer(
    add_time_ms: int, expire_time_ms: int | None = None, error_count: int = 0, flags: int = 0,
    due_ms: int | None = None,
) -> Callable[[int, int], bytes]:
    """A function (data size, id) -> PUT header bytes (led by the FLAGS record when
    `flags` is not 0, then the DELAY record when `due_ms` is given), for many items
    sharing the other fields. Raises ValueError at once when a shared field is out of
    range."""
    try:
        if flags or due_ms is not None:
            lead = flags_record(flags) + (b"" if due_ms is None else delay_record(due_ms))
            plain = put_header_packer(add_time_ms, expire_time_ms, error_count)
            return lambda size, xid: lead + plain(size, xid)
        if expire_time_ms is None:
            PUT_STRUCT.pack(PUT_BYTE, 0, error_count, 1, add_time_ms)
            pack, cmd = PUT_STRUCT.pack, PUT_BYTE
            return lambda size, xid: pack(cmd, size, error_count, xid, add_time_ms)
        PUT_EXPIRE_STRUCT.pack(PUT_EXPIRE_BYTE, 0, error_count, 1, add_time_ms, expire_time_ms)
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None
    pack_e = PUT_EXPIRE_STRUCT.pack
    return lambda size, xid: pack_e(
        PUT_EXPIRE_BYTE, size, error_count, xid, add_time_ms, expire_time_ms
    )


def pack_put_heads(
    datas: Sequence[bytes], first_id: int, add_time_ms: int,
    expire_time_ms: int | None = None, error_count: int = 0, flags: int = 0,
    due_ms: int | None = None, packer: Callable[[int, int], bytes] | None = None,
) -> list[bytes]:
    """`put_header_packer`'s headers for many items at once, one per item of `datas`,
    their ids consecutive from `first_id`. The usual plain put's in one loop: compiled,
    the packer's closure is a call through Python's calling convention per item.
    `packer`: the caller's `put_header_packer` of the same fields, if it made one (else
    one is made here)."""
    try:
        if expire_time_ms is None and not flags and due_ms is None:
            pack = PUT_STRUCT.pack
            heads: list[bytes] = []
            xid = first_id
            for d in datas:
                heads.append(pack(PUT_BYTE, len(d), error_count, xid, add_time_ms))
                xid += 1
            return heads
        if packer is None:
            packer = put_header_packer(add_time_ms, expire_time_ms, error_count, flags,
                                       due_ms)
        return list(map(packer, map(len, datas), range(first_id, first_id + len(datas))))
    except struct.error as exc:
        raise ValueError(f"PUT field out of range: {exc}") from None


def encode_read_head(head: ReadHead) -> bytes:
    return READ_HEAD_STRUCT.pack(READ_HEAD_BYTE, head.id)


def encode_read_done(done: ReadDone) -> bytes:
    ids = done.ids
    return READ_DONE_STRUCT.pack(READ_DONE_BYTE, 8 * len(ids)) + struct.pack(f"<{len(ids)}q", *ids)


def _encode_entries(name: str, cmd: int, entry: struct.Struct,
                    entries: tuple[tuple[int, int], ...]) -> bytes:
    """A reader-file record of (id, value) entries: READ_ERRORS or READ_DELAYS."""
    try:
        return I32_HEAD_STRUCT.pack(cmd, entry.size * len(entries)) + (
            b"".join(entry.pack(i, v) for i, v in entries))
    except struct.error as exc:
        raise ValueError(f"{name} entry out of range: {exc}") from None


def encode_read_errors(errors: ReadErrors) -> bytes:
    return _encode_entries("READ_ERRORS", READ_ERRORS_BYTE, ERROR_ENTRY_STRUCT, errors.entries)


def encode_read_delays(delays: ReadDelays) -> bytes:
    return _encode_entries("READ_DELAYS", READ_DELAYS_BYTE, DELAY_ENTRY_STRUCT, delays.entries)


def encode_reader_records(
    head: int | None, done: list[int] | tuple[int, ...], errors: dict[int, int],
    delays: dict[int, int] | None = None,
) -> bytes:
    """Records appended to a reader file (unsealed): a READ_HEAD if `head` is given, a
    READ_DONE of `done` (sorted here), a READ_ERRORS of `errors` and a READ_DELAYS of
    `delays`, each only if non-empty."""
    out = b"" if head is None else encode_read_head(ReadHead(head))
    if done:
        out += encode_read_done(ReadDone(tuple(sorted(done))))
    if errors:
        out += encode_read_errors(ReadErrors(tuple(sorted(errors.items()))))
    if delays:
        out += encode_read_delays(ReadDelays(tuple(sorted(delays.items()))))
    return out


def encode_check(covered: bytes | bytearray | memoryview, offset: int) -> bytes:
    """The check record sealing `covered`: the bytes since the previous check,
    which start at file offset `offset`."""
    return CHECK_STRUCT.pack(EXT_BYTE, 9, EXT_CHECK, len(covered),
                             crc32(covered, crc_seed(offset)))


def encode_record(record: Record) -> bytes:
    if isinstance(record, Put):
        return encode_put(record)
    if isinstance(record, ReadHead):
        return encode_read_head(record)
    if isinstance(record, ReadDone):
        return encode_read_done(record)
    if isinstance(record, ReadErrors):
        return encode_read_errors(record)
    if isinstance(record, ReadDelays):
        return encode_read_delays(record)
    if isinstance(record, Check):
        return CHECK_STRUCT.pack(EXT_BYTE, 9, EXT_CHECK, record.length, record.crc)
    if isinstance(record, Compacted):
        return COMPACTED_STRUCT.pack(EXT_BYTE, 17, EXT_COMPACTED, record.first_number,
                                     record.last_number)
    if isinstance(record, Incarnation):
        return incarnation_record(record.incarnation)
    if isinstance(record, ProducerMark):
        return producer_record(record)
    if isinstance(record, DedupMark):
        return dedup_record(record)
    raise TypeError(f"cannot encode {record!r}")


def encode_check_crc(length: int, crc: int) -> bytes:
    """A check record from a crc already computed (from crc_seed(offset) on)."""
    return CHECK_STRUCT.pack(EXT_BYTE, 9, EXT_CHECK, length, crc)


def seal(batch: bytes | bytearray, offset: int) -> bytes:
    """`batch` followed by the check record covering it, for file offset `offset`."""
    return bytes(batch) + encode_check(batch, offset)


def incarnation_record(incarnation: int) -> bytes:
    """The INCARNATION record: which life of its queue a segment belongs to (the ms at
    which the queue was created; a queue deleted and created again gets a new one)."""
    return INCARNATION_STRUCT.pack(EXT_BYTE, 9, EXT_INCARNATION, incarnation)


def segment_head(incarnation: int, compacted: Compacted | None = None) -> bytes:
    """The bytes a writer segment starts with: magic, the empty seal, then (when there
    is anything to say) one sealed batch of a COMPACTED marker and the INCARNATION
    record. Incarnation 0 (queues from before incarnations, or other implementations)
    writes no record, as flags 0 write none."""
    head = WRITER_MAGIC + EMPTY_CHECK
    body = b"" if compacted is None else encode_record(compacted)
    if incarnation:
        body += incarnation_record(incarnation)
    return head + seal(body, len(head)) if body else head


#: Bytes enough to hold any `segment_head` (of this release's form, longer than the old).
SEGMENT_HEAD_MAX: Final = (MAGIC_SIZE + CHECK_RECORD_SIZE + COMPACTED_STRUCT.size
                           + INCARNATION_STRUCT.size + CHECK_RECORD_SIZE)


def encode_checkpoint(
    head: int, done_ids: tuple[int, ...] | list[int],
    errors: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
    delays: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
) -> bytes:
    """A whole reader file: magic, seal, READ_HEAD, READ_DONE[, READ_ERRORS][, READ_DELAYS],
    seal."""
    body = encode_read_head(ReadHead(head)) + encode_read_done(ReadDone(tuple(sorted(done_ids))))
    if errors:
        body += encode_read_errors(ReadErrors(tuple(sorted(errors))))
    if delays:
        body += encode_read_delays(ReadDelays(tuple(sorted(delays))))
    return READER_MAGIC + EMPTY_CHECK + seal(body, MAGIC_SIZE + CHECK_RECORD_SIZE)


# -- what decoding yields ---------------------------------------------------------


class FileKind(enum.Enum):
    WRITER = "writer"
    READER = "reader"


#: The decoders answer NEED_DATA as every parser here does (one marker: `wire`'s).
Sentinel: TypeAlias = NeedData


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
    delayed: int = field(default=0, compare=False)  # PUT records led by a DELAY record
    marks: int = field(default=0, compare=False)  # PRODUCER and DEDUP records in it
    #: size of its check record (the records end at end - check_size): 9 for the old form
    check_size: int = field(default=CHECK_RECORD_SIZE, compare=False)


@dataclass(slots=True, init=False)
class Decoded:
    """One record and where it sits: bytes [offset, end) of the file.

    Treat it as frozen; it is not declared so, and its `__init__` is written out, for
    Put's reasons: one is made per record `RecordDecoder` returns (read-behind, scans,
    the recovery of another writer's files; our sealed segments recover by the batch),
    and a frozen dataclass's `__init__` cost ~1.2 µs, compiled or not.
    """

    record: Record
    offset: int
    end: int

    def __init__(self, record: Record, offset: int, end: int) -> None:
        self.record = record
        self.offset = offset
        self.end = end


Event = Decoded | EndOfData | TornTail | Sentinel
