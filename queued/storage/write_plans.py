"""What a writer's round is given and what it reports: the chunks of records a journal
planned for one segment file, the changes planned for a reader's checkpoint file, and
what was written where.

Owns these values only; the journal (queued.storage.journal) fills them, the files
(queued.storage.synced_files) carry them out. No file is touched here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: Item data at least this large is written from the caller's buffer (writev), not copied.
ZERO_COPY_BYTES: Final = 4096


@dataclass(slots=True, init=False)
class Chunk:
    """Records planned for the writer (by the journal); one chunk becomes one checked batch.

    Small records are copied into `small`; large items are kept as references
    in `pieces` so a batch of big items reaches the kernel with one copy.
    """

    rotate: bool  # start a new segment before writing this
    pieces: list[bytes | bytearray] = field(default_factory=list)
    small: bytearray = field(default_factory=bytearray)
    nbytes: int = 0
    count: int = 0
    first_id: int = 0
    last_id: int = 0

    # (written out, with the others made per round here: a compiled class compiles an
    # `__init__` in its body, not the one `dataclass` makes; see queued.journal.records.Put)
    def __init__(self, rotate: bool, pieces: list[bytes | bytearray] | None = None,
                 small: bytearray | None = None, nbytes: int = 0, count: int = 0,
                 first_id: int = 0, last_id: int = 0) -> None:
        self.rotate = rotate
        self.pieces = [] if pieces is None else pieces
        self.small = bytearray() if small is None else small
        self.nbytes = nbytes
        self.count = count
        self.first_id = first_id
        self.last_id = last_id

    def add(self, head: bytes, data: bytes) -> None:
        if len(data) >= ZERO_COPY_BYTES:
            if self.small:
                self.pieces.append(self.small)
                self.small = bytearray()
            self.pieces.append(head)
            self.pieces.append(data)
        else:
            self.small += head
            self.small += data
        self.nbytes += len(head) + len(data)

    def take_pieces(self) -> list[bytes | bytearray]:
        if self.small:
            self.pieces.append(self.small)
            self.small = bytearray()
        return self.pieces


@dataclass(slots=True, init=False)
class Written:
    """What the writer did with one chunk: bytes [offset, end) of segment `number`."""

    number: int
    created: bool  # the segment was created for it
    offset: int
    end: int
    count: int
    first_id: int
    last_id: int
    inode: int  # of a created segment, else 0

    def __init__(self, number: int, created: bool, offset: int, end: int, count: int,
                 first_id: int, last_id: int, inode: int) -> None:
        self.number = number
        self.created = created
        self.offset = offset
        self.end = end
        self.count = count
        self.first_id = first_id
        self.last_id = last_id
        self.inode = inode


@dataclass(slots=True, init=False)
class WriteResult:
    """One queue's share of a round: the chunks written and durable, in order, and
    the error that stopped the rest (chunks past len(written) were not stored)."""

    written: list[Written]
    error: BaseException | None = None

    def __init__(self, written: list[Written], error: BaseException | None = None) -> None:
        self.written = written
        self.error = error



@dataclass(eq=False, slots=True)
class ReaderOp:
    """One change to a reader's checkpoint file, planned by the journal and carried out
    by a round in plan order: records appended as one checked batch (`head`: a
    READ_HEAD, `done`: a READ_DONE, `errors`: a READ_ERRORS), or the whole file written
    anew (`rewrite`: temp, fsync, rename, directory fsync, whatever the fsync policy), or
    the file removed durably (`remove`). The round sets `failed` if it did not become
    durable under the queue's fsync policy."""

    rewrite: bytes | None = None
    remove: bool = False
    head: int | None = None
    done: list[int] = field(default_factory=list)
    errors: dict[int, int] = field(default_factory=dict)
    delays: dict[int, int] = field(default_factory=dict)  # a READ_DELAYS
    failed: BaseException | None = None

    @property
    def appends(self) -> bool:
        return self.rewrite is None and not self.remove

