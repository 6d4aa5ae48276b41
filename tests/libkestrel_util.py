"""A port of libkestrel's journal reader (Python), to read our files the way Kestrel does.

Ported from the logic of twitter-archive/libkestrel (Apache-2.0): `RecordReader.readNext`
and `readMagic`, `JournalFile.open` (writer files), `BookmarkFile.open` (reader files) and
what `Journal.scala` makes of a bookmark (the last READ_HEAD wins, READ_DONE ids add up).
It keeps libkestrel's quirks, since the point is to see what Kestrel sees: the command
byte is a signed Java byte, a PUT's and a READ_HEAD's fields are read whatever the header
size says, data over 16 MiB is "corrupted", and an unknown command is skipped by where
the reader stands, not by what the seed says.

That last rule differs between two revisions of RecordReader.scala:
- `Skip.DATA_ONLY` (853a6d9, February 2012, where readNext was born): an unknown record
  is skipped by its data size alone, after the command byte and, for commands 8-15, the
  first header word; its other header words are read as the next records.
- `Skip.HEADER_AND_DATA` (f3d9041 and every tagged release, 1.0.0 to 2.0.0): the
  command byte, all header words and the data.
A record we add must read right under both: a command 8-15 with one header word.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

WRITER_HEADER = 0x27642603  # JournalFile.HEADER_WRITER, big-endian
BOOKMARK_HEADER = 0x263C2603  # BookmarkFile.HEADER_BOOKMARK
LARGEST_DATA = 16 * 1024 * 1024  # Record.LARGEST_DATA
READ_HEAD, PUT, READ_DONE = 0, 8, 9  # Record's command numbers


class Skip(enum.Enum):
    """How readNext steps over a command it does not know (see the module doc)."""

    DATA_ONLY = "853a6d9"
    HEADER_AND_DATA = "f3d9041"


class CorruptedJournal(Exception):
    """libkestrel's CorruptedJournalException: `position` is the last valid one."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"{message} at {position}")
        self.position = position


class JavaBufferError(Exception):
    """What a java.nio.ByteBuffer throws: a read past the limit (BufferUnderflowException)
    or a position or limit set past it (IllegalArgumentException). libkestrel lets these
    escape readNext, so Kestrel would fail on them."""


class NotAJournal(Exception):
    """JournalFile.open / BookmarkFile.open on a file with the other magic."""


@dataclass(frozen=True)
class KPut:
    """Record.Put: a QueueItem (expire_time None when the header has 6 words)."""

    id: int
    add_time: int
    expire_time: int | None
    data: bytes
    error_count: int


@dataclass(frozen=True)
class KReadHead:
    id: int


@dataclass(frozen=True)
class KReadDone:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class KUnknown:
    command: int


KRecord = KPut | KReadHead | KReadDone | KUnknown


class _Buffer:
    """The little of java.nio.ByteBuffer readNext uses: a position over bytes, little-endian
    gets that throw past the end, and a settable position."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.position

    def _get(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.remaining < size:
            raise JavaBufferError(f"BufferUnderflowException at {self.position}")
        (value,) = struct.unpack_from(fmt, self.data, self.position)
        self.position += size
        return int(value)

    def get(self) -> int:
        return self._get("<b")  # Java's byte is signed

    def get_int(self) -> int:
        return self._get("<i")

    def get_long(self) -> int:
        return self._get("<q")

    def seek(self, position: int) -> None:
        if not 0 <= position <= len(self.data):
            raise JavaBufferError(f"IllegalArgumentException: position {position}")
        self.position = position


class RecordReader:
    """libkestrel's RecordReader over one whole file held in memory."""

    def __init__(self, data: bytes, skip: Skip = Skip.HEADER_AND_DATA) -> None:
        self.reader = _Buffer(data)
        self.skip = skip

    def read_magic(self) -> int:
        if self.reader.remaining < 4:
            raise CorruptedJournal(0, "No header in journal file")
        magic = int.from_bytes(self.reader.data[:4], "big")
        self.reader.seek(4)
        return magic

    def read_next(self) -> KRecord | None:
        reader = self.reader
        last_position = reader.position
        if reader.remaining < 1:
            return None
        command_and_header_size = reader.get()
        if command_and_header_size == 0:
            reader.seek(last_position)
            return None
        command = (command_and_header_size >> 4) & 0xF
        header_size = command_and_header_size & 0xF
        if reader.remaining < header_size * 4:
            raise CorruptedJournal(last_position, f"truncated header: {reader.remaining} left")
        data_size = 0
        if command >= 8:
            data_size = reader.get_int()
            if data_size > LARGEST_DATA:
                raise CorruptedJournal(last_position, "item too large")
            if reader.remaining < data_size + (header_size - 1) * 4:
                raise CorruptedJournal(last_position, "truncated entry")
        if command == READ_HEAD:
            if reader.remaining < 8:
                raise CorruptedJournal(last_position, "corrupted READ_HEAD")
            return KReadHead(reader.get_long())
        if command == PUT:
            if reader.remaining < 20:
                raise CorruptedJournal(last_position, "corrupted PUT")
            error_count = reader.get_int()
            xid = reader.get_long()
            add_time = reader.get_long()
            expire_time = reader.get_long() if header_size > 6 else None
            start = reader.position
            if data_size < 0 or start + data_size > len(reader.data):
                raise JavaBufferError(f"IllegalArgumentException: limit {start + data_size}")
            reader.seek(start + data_size)
            return KPut(xid, add_time, expire_time, reader.data[start:start + data_size],
                        error_count)
        if command == READ_DONE:
            if data_size % 8 != 0:
                raise CorruptedJournal(last_position, "corrupted READ_DONE")
            return KReadDone(tuple(reader.get_long() for _ in range(data_size // 8)))
        # "this is okay. we can skip the ones we don't know."
        if self.skip is Skip.DATA_ONLY:
            reader.seek(reader.position + data_size)
        else:
            reader.seek(last_position + header_size * 4 + data_size + 1)
        return KUnknown(command)

    def records(self) -> list[KRecord]:
        """RecordReader.iterator: readNext until None."""
        out: list[KRecord] = []
        while (record := self.read_next()) is not None:
            out.append(record)
        return out


def open_journal(data: bytes, skip: Skip = Skip.HEADER_AND_DATA) -> RecordReader:
    """JournalFile.open: a writer file, or NotAJournal."""
    reader = RecordReader(data, skip)
    if reader.read_magic() != WRITER_HEADER:
        raise NotAJournal("Not a journal file")
    return reader


def open_bookmark(data: bytes, skip: Skip = Skip.HEADER_AND_DATA) -> RecordReader:
    """BookmarkFile.open: a reader file, or NotAJournal."""
    reader = RecordReader(data, skip)
    if reader.read_magic() != BOOKMARK_HEADER:
        raise NotAJournal("Not a bookmark file")
    return reader


def journal_puts(data: bytes, skip: Skip = Skip.HEADER_AND_DATA) -> list[KPut]:
    """The items Kestrel finds in a writer file (Journal's scan keeps the Puts only)."""
    return [r for r in open_journal(data, skip).records() if isinstance(r, KPut)]


def bookmark_state(data: bytes, skip: Skip = Skip.HEADER_AND_DATA) -> tuple[int, set[int]]:
    """A reader file as Journal.Reader.readState takes it: (head, done ids); the last
    READ_HEAD wins, every READ_DONE adds its ids, anything else is skipped, and done ids
    not above the head are dropped (readState also bounds head and ids by the writer
    files' ids, which a reader file alone does not hold)."""
    head, done = 0, set[int]()
    for record in open_bookmark(data, skip).records():
        if isinstance(record, KReadHead):
            head = record.id
        elif isinstance(record, KReadDone):
            done |= set(record.ids)
    return head, {i for i in done if i > head}
