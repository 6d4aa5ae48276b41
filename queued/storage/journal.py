"""The journal of one queue: planning appends, tickets, the segment index, read-back,
checkpoints, compaction and size limits.

Owns the queue's segment list and reader checkpoint files. Appends are planned
here on the trio side (ids, chunks that become checked batches, tickets) and
written by the writer (queued.storage.writer) in the data directory's rounds:
one write + one fsync per queue per round. So are the readers' files: confirms and
abort error counts appended between checkpoints, and the checkpoints themselves,
each reader's changes in the order they were planned. Never acknowledges an append
(or a confirm) before its bytes are written and, under fsync "always", fsynced.
Knows nothing of sockets or protocols, and of its data directory only what
`JournalHost` says.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, Final, Protocol

import trio

from queued.config.policies import FsyncPolicy, FullPolicy, JournalConfig, MiB
from queued.errors import (
    JournalClosedError,
    JournalFullError,
    JournalWriteError,
)
from queued.journal import format as jf
from queued.reader.shared import NO_ENTRIES, NO_ITEMS, NO_LIST
from queued.storage import compaction
from queued.storage.compaction import CompactionResult, SegmentStore
from queued.storage.files import (
    Checkpoint,
    SegmentInfo,
    encode_checkpoint,
    read_segment,
    write_dedup,
    write_producers,
)
from queued.storage.writer import (
    ZERO_COPY_BYTES,
    Chunk,
    ReaderFile,
    ReaderOp,
    SegmentFile,
    SyncedFile,
    WriteResult,
)

log = logging.getLogger("queued.journal")

#: One check record covers at most this much: its length field is 32 bits.
MAX_BATCH_BYTES = 64 * MiB

#: What a journal's planned chunks hold until the first (its reader ops and reader files
#: hold NO_ENTRIES): a server may hold 10,000 idle queues, an empty list or dict each is
#: ~60 B; shared and immutable, as a reader's empty containers are (queued.reader.shared),
#: and a list, as the attribute's type says.
NO_CHUNKS: Final[Any] = NO_LIST


@dataclass(frozen=True, slots=True)
class JournalStats:
    queue: str
    segments: int
    bytes: int
    pending_bytes: int
    last_id: int
    appends: int
    items_appended: int
    batches_written: int
    fsyncs: int
    write_errors: int
    failed: bool
    readers: int


def put_overhead(flags: int, delayed: bool = False) -> int:
    """Most journal bytes one item takes beyond its data (for room checks)."""
    return (jf.PUT_EXPIRE_HEADER_SIZE + (jf.FLAGS_RECORD_SIZE if flags else 0)
            + (jf.DELAY_RECORD_SIZE if delayed else 0))


def headers_overhead(headers: Sequence[bytes] | None) -> int:
    """Journal bytes the HEADERS records of items with `headers` (blocks) take."""
    if not headers:
        return 0
    return sum(map(len, headers)) + jf.HEADERS_HEAD_SIZE * sum(map(bool, headers))


class Ticket:
    """Done once a planned write is durable, or failed (`error`). What was changed in
    memory ahead of a write that fails can be undone by `on_failure` callbacks, run when
    the failure is known, before anyone waiting for the ticket wakes. A trio event is
    made only for a task that waits (`wait`): the reactor's passes, which answer after
    their commit, never do, and most tickets are theirs."""

    __slots__ = ("_event", "done", "error", "undo")

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None
        self.undo: list[Callable[[BaseException], None]] | None = None
        self._event: trio.Event | None = None

    def set(self) -> None:
        """Done (with `error` as it stands): wake whoever waits."""
        self.done = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Until done."""
        if not self.done:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()

    def on_failure(self, undo: Callable[[BaseException], None]) -> None:
        """Call `undo(error)` if the write fails (now, if it failed already)."""
        if self.done:
            if self.error is not None:
                undo(self.error)
        elif self.undo is None:
            self.undo = [undo]
        else:
            self.undo.append(undo)

    def resolve(self, error: BaseException | None) -> None:
        """The write is durable (None) or failed: run the undos, then wake the waiters."""
        self.error = error
        undo, self.undo = self.undo, None
        if error is not None and undo is not None:
            for fn in undo:
                try:
                    fn(error)
                except Exception:  # a bug there must not stop the writer's loop
                    log.exception("undoing what a failed write acknowledged failed")
        self.set()


@dataclass(slots=True, init=False)
class Planned(Chunk):
    """A chunk waiting for the writer, with the tickets of the appends it carries."""

    tickets: list[Ticket] = field(default_factory=list)
    marks: int = 0  # PRODUCER and DEDUP records in it

    # (written out, as Chunk's is: one is made per queue and round, so Chunk's part goes
    # through its `__init__` (named: a slots dataclass is a new class, which zero-argument
    # super() does not see); the dataclass's own signature, Chunk's fields first:
    # tests/test_dataclass_inits.py)
    def __init__(self, rotate: bool, pieces: list[bytes | bytearray] | None = None,
                 small: bytearray | None = None, nbytes: int = 0, count: int = 0,
                 first_id: int = 0, last_id: int = 0, tickets: list[Ticket] | None = None,
                 marks: int = 0) -> None:
        Chunk.__init__(self, rotate, pieces, small, nbytes, count, first_id, last_id)
        self.tickets = [] if tickets is None else tickets
        self.marks = marks


@dataclass(eq=False, slots=True)
class PlannedOp(ReaderOp):
    """A reader file change waiting for the writer; appends planned before the next
    round are merged into one (one batch, one ticket). `checkpoint`: the durable
    position a rewrite makes."""

    ticket: Ticket = field(default_factory=Ticket)
    checkpoint: Checkpoint | None = None


#: A reader's file and the changes a round is to make to it, in plan order.
ReaderWork = list[tuple[ReaderFile, list[PlannedOp]]]


class JournalHost(SegmentStore, Protocol):
    """What a journal needs from its data directory (queued.storage.datadir.DataDir).

    A protocol rather than an import: the directory owns its journals, so a
    journal may not import it.
    """

    @property
    def path(self) -> Path: ...

    def note_pending(self, journal: QueueJournal, /) -> None:
        """`journal` has planned chunks or reader ops: write them now or in the next
        writer round."""
        ...

    def reader_file(self, queue: str, reader: str, fsync: FsyncPolicy, /) -> ReaderFile:
        """The writer side of a reader's checkpoint file."""
        ...

    async def sync_segment(self, journal: QueueJournal, /) -> None:
        """fsync what `journal`'s segment has written and not synced, between rounds."""
        ...


class QueueJournal:
    """Segments and durable reader checkpoints of one queue.

    `append` assigns ids and returns once durable under the fsync policy.
    `readers` holds the last checkpoint of each reader that is on disk: it is
    what compaction and size enforcement respect.
    """

    def __init__(
        self,
        host: JournalHost,
        name: str,
        config: JournalConfig,
        segments: list[SegmentInfo],
        readers: dict[str, Checkpoint],
        last_id: int,
        file: SegmentFile,
    ) -> None:
        self.host = host
        self.name = name
        #: the writer side of this queue's active segment (queued.storage.writer)
        self.file = file
        self._reader_files: dict[str, ReaderFile] = NO_ENTRIES  # a dict from the first on
        self.config = config
        self.segments = segments
        self.readers = readers
        self.last_id = last_id
        #: awaited with a segment about to be dropped under drop_oldest (file still there),
        #: after every reader's checkpoint has moved past it
        self.before_drop: Callable[[SegmentInfo], Awaitable[None]] | None = None
        #: awaited before a compaction that removes or rewrites segments (the queue's
        #: producer snapshot is written there: compaction keeps no PRODUCER record)
        self.before_compact: Callable[[], Awaitable[None]] | None = None
        #: the producer marks recovery read (snapshot and segments), for the queue to take
        self.producer_marks: Sequence[jf.ProducerMark] = NO_ITEMS
        #: the deduplication keys recovery read (snapshot and segments), likewise
        self.dedup_marks: Sequence[jf.DedupMark] = NO_ITEMS
        self._pending: list[Planned] = NO_CHUNKS  # a list from the first append on
        self._pending_bytes = 0
        self._reader_ops: dict[str, list[PlannedOp]] = NO_ENTRIES  # a dict from the first op
        # Projection of the active segment including pending chunks, to split
        # batches where segments rotate. None = the next append opens a segment.
        self._proj_size: int | None = None
        self._proj_count = 0
        self._closed = False
        self._maintenance_lock: trio.Lock | None = None  # made on first use (~0.3 KiB a lock)
        self._appends = self._items = self._batches = 0

    @property
    def config(self) -> JournalConfig:
        return self._config

    @config.setter
    def config(self, config: JournalConfig) -> None:
        """Settings may change (a reload); the writer follows the new fsync policy."""
        self._config = config
        self.file.fsync = config.fsync
        for rfile in self._reader_files.values():
            rfile.fsync = config.fsync

    @property
    def maintenance_lock(self) -> trio.Lock:
        """Held while compaction or a drop changes the segment list: no compaction or drop
        of this queue runs inside `async with journal.maintenance_lock` (checkpoints are
        round work: pause the writer for those)."""
        lock = self._maintenance_lock
        if lock is None:
            lock = self._maintenance_lock = trio.Lock()
        return lock

    @property
    def maintenance_busy(self) -> bool:
        """A compaction or drop holds the maintenance lock (or waits for it)."""
        return self._maintenance_lock is not None and self._maintenance_lock.locked()

    # -- appends ----------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments) + self._pending_bytes

    @property
    def failed(self) -> JournalWriteError | None:
        return self.file.failed

    def append_nowait(
        self,
        datas: Sequence[bytes],
        add_time_ms: int,
        expire_time_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        due_ms: int | None = None,
        producer: tuple[bytes, int] | None = None,
        headers: Sequence[bytes] | None = None,
        dedup: Sequence[tuple[int, int, bytes]] = (),
    ) -> tuple[list[jf.Put], Ticket]:
        """Queue `datas` for the writer; ids are assigned here, in order. Non-zero
        `flags` (memcache flags, the same for every item) lead each PUT with a FLAGS
        record; flags 0 write nothing more. `due_ms` (unix ms) leads each PUT with a
        DELAY record and makes the records DelayedPuts; None writes nothing more.
        `producer` (id, sequence): a PRODUCER record follows the last PUT, in its batch,
        so the mark is durable exactly when the whole put is. `headers`: one headers
        block per item (queued.journal.headers; b"" for none), each non-empty one a
        HEADERS record leading its PUT; None: no item has any. `dedup`: (start, end, key)
        of each part of `datas` put with a deduplication key (a put, or the puts of a pass
        joined into this append): a DEDUP record naming datas[start:end] follows the PUT of
        datas[end - 1], and the whole append stays in one batch likewise."""
        if self._closed:
            raise JournalClosedError(f"journal of queue {self.name!r} is closed")
        if self.file.failed is not None:
            raise JournalWriteError(f"queue {self.name!r} refuses writes: {self.file.failed}")
        ticket = Ticket()
        # (exactly bytes: the general path copies anything else to bytes first)
        first: object = datas[0] if len(datas) == 1 else None
        if (type(first) is bytes and due_ms is None and producer is None and not dedup
                and headers is None):
            one = self._append_one(first, ticket, add_time_ms, expire_time_ms, error_count,
                                   flags)
            if one is not None:
                return one, ticket
        # Check everything before touching any state, so a bad item changes nothing.
        pack_head = jf.put_header_packer(add_time_ms, expire_time_ms, error_count, flags,
                                         due_ms)
        if set(map(type, datas)) - {bytes}:
            datas = [d if isinstance(d, bytes) else bytes(d) for d in datas]
        largest = max(map(len, datas), default=0)
        if largest > jf.MAX_DATA_SIZE:
            raise ValueError("item data larger than 2 GiB - 1")
        if self.last_id + len(datas) > jf.MAX_ID:
            raise ValueError("item ids exhausted")
        leads: list[bytes] | None = None  # the HEADERS records, one per item (b"": none)
        if headers is not None:
            if len(headers) != len(datas):
                raise ValueError(f"{len(headers)} headers for {len(datas)} items")
            if any(headers):  # (a put's items often share one block: one record for it)
                memo: dict[bytes, bytes] = {}
                leads = [memo[h] if h in memo else memo.setdefault(h, jf.headers_record(h))
                         for h in headers]
            else:
                headers = None
        puts: list[jf.Put] = []
        limit = self.config.journal_size
        next_id = self.last_id
        if self._proj_size is not None and not self._pending:
            # This call opens a new round's batch, which a check record will seal.
            self._proj_size += jf.CHECK_RECORD_SIZE
        # (one DEDUP record, after the last item: the bulk path's; more: item by item)
        bulk = not dedup or (len(dedup) == 1 and dedup[0][:2] == (0, len(datas)))
        if datas and largest < ZERO_COPY_BYTES and self._proj_size is not None and bulk:
            puts = self._append_small(datas, pack_head, ticket, add_time_ms, expire_time_ms,
                                      error_count, flags, due_ms, leads, headers)
            if puts:
                if producer is None and not dedup:  # (the usual append: nothing follows)
                    self.last_id = puts[-1].id
                    self._appends += 1
                    self._items += len(puts)
                    self.host.note_pending(self)
                    return puts, ticket
                datas = ()  # done in bulk
                next_id = puts[-1].id
        # A put with a producer stays in one segment and one batch (it rotates or starts a
        # batch before its first item, never within): else a cut could keep its first
        # items without its mark.
        trailer = (0 if producer is None else jf.PRODUCER_FIXED_DATA + 5 + len(producer[0])) + (
            sum(jf.DEDUP_FIXED_DATA + 5 + len(k) for _, _, k in dedup))
        whole = 0 if not trailer or not datas else (
            sum(map(len, datas)) + len(pack_head(0, 1)) * len(datas)
            + (sum(map(len, leads)) if leads else 0) + trailer)
        first = self.last_id + 1  # the id of datas[0]
        after: dict[int, list[tuple[int, int, bytes]]] = {}  # last item -> its DEDUP records
        if not bulk:
            for part in dedup:
                after.setdefault(part[1] - 1, []).append(part)
        for i, data in enumerate(datas):
            next_id += 1
            head = pack_head(len(data), next_id)
            if leads is not None:
                head = leads[i] + head
            size = len(head) + len(data)
            chunk = self._pending[-1] if self._pending else None
            # (0: a later item of a put with a producer, which never rotates or splits)
            size_now = 0 if whole and next_id > self.last_id + 1 else whole or size
            if self._proj_size is None or (
                self._proj_count and size_now and self._proj_size + size_now > limit
            ):
                chunk = self._new_chunk(rotate=True)
                self._proj_size = len(jf.segment_head(self.file.incarnation)) + jf.CHECK_RECORD_SIZE
                self._proj_count = 0
            elif chunk is None or (size_now and chunk.nbytes + size_now > MAX_BATCH_BYTES):
                if chunk is not None:  # a split batch gets a check record of its own
                    self._proj_size += jf.CHECK_RECORD_SIZE
                chunk = self._new_chunk(rotate=False)
            chunk.add(head, data)
            if not chunk.count:
                chunk.first_id = next_id
            chunk.count += 1
            chunk.last_id = next_id
            if not chunk.tickets or chunk.tickets[-1] is not ticket:
                chunk.tickets.append(ticket)
            self._proj_size += size
            self._proj_count += 1
            self._pending_bytes += size
            block = b"" if headers is None else headers[i]
            puts.append(jf.DelayedPut(next_id, data, add_time_ms, expire_time_ms, error_count,
                                      flags, due_ms, block) if due_ms is not None else
                        jf.HeadedPut(next_id, data, add_time_ms, expire_time_ms, error_count,
                                     flags, block) if block else
                        jf.Put(next_id, data, add_time_ms, expire_time_ms, error_count, flags))
            for start, end, key in after.get(i, ()):
                self._add_mark(jf.dedup_record(jf.DedupMark(key, first + start, end - start,
                                                            add_time_ms)))
        self.last_id = next_id
        if producer is not None and puts:
            self._add_mark(jf.producer_record(jf.ProducerMark(
                producer[0], producer[1], puts[0].id, len(puts), add_time_ms)))
        if dedup and bulk and puts:
            self._add_mark(jf.dedup_record(jf.DedupMark(dedup[0][2], puts[0].id, len(puts),
                                                        add_time_ms)))
        self._appends += 1
        self._items += len(puts)
        if not puts:
            ticket.set()
        else:
            self.host.note_pending(self)
        return puts, ticket

    def _add_mark(self, mark: bytes) -> None:
        """A PRODUCER or DEDUP record after the last PUT, in the chunk holding it."""
        chunk = self._pending[-1]
        chunk.add(mark, b"")
        chunk.marks += 1
        if self._proj_size is not None:
            self._proj_size += len(mark)
        self._pending_bytes += len(mark)

    def _append_one(self, data: bytes, ticket: Ticket, add_time_ms: int,
                    expire_time_ms: int | None, error_count: int, flags: int,
                    ) -> list[jf.Put] | None:
        """append_nowait's path for one small plain item (no delay, producer, key or
        headers) that fits the current segment and batch: the usual put of a client with
        one request in flight, and each queue's put in a pass fanning in to many. What
        _append_small does for it, without making a packer or the bulk lists. None, with
        nothing changed, when it does not apply (the general path then takes the item).
        Raises ValueError (nothing changed) for a field out of range."""
        size = self._proj_size  # (None: the append opens a segment; the general path)
        if size is None or len(data) >= ZERO_COPY_BYTES:
            return None
        xid = self.last_id + 1
        if xid > jf.MAX_ID:
            return None  # (the general path refuses it)
        head = jf.put_head(len(data), xid, add_time_ms, expire_time_ms, error_count, flags)
        total = len(head) + len(data)
        pending = self._pending
        chunk = pending[-1] if pending else None
        # (no chunk yet: this append opens the round's batch, which a check record seals)
        proj = size + (jf.CHECK_RECORD_SIZE if chunk is None else 0)
        if (proj + total > self.config.journal_size
                or (chunk is not None and chunk.nbytes + total > MAX_BATCH_BYTES)):
            return None
        if chunk is None:
            chunk = self._new_chunk(rotate=False)
        small = chunk.small
        small += head
        small += data
        self._proj_size = proj
        self._booked(chunk, xid, 1, total, ticket)
        self.last_id = xid
        self._appends += 1
        self._items += 1
        self.host.note_pending(self)
        return [jf.Put(xid, data, add_time_ms, expire_time_ms, error_count, flags)]

    def _booked(self, chunk: Planned, first: int, n: int, total: int, ticket: Ticket) -> None:
        """`n` items from id `first` (`total` bytes, records included) were just copied
        into `chunk` for `ticket`: its counts, and the journal's projection, follow."""
        chunk.nbytes += total
        if not chunk.count:
            chunk.first_id = first
        chunk.count += n
        chunk.last_id = first + n - 1
        tickets = chunk.tickets
        if not tickets or tickets[-1] is not ticket:
            tickets.append(ticket)
        assert self._proj_size is not None
        self._proj_size += total
        self._proj_count += n
        self._pending_bytes += total

    def _append_small(
        self,
        datas: Sequence[bytes],
        pack_head: Callable[[int, int], bytes],
        ticket: Ticket,
        add_time_ms: int,
        expire_time_ms: int | None,
        error_count: int,
        flags: int = 0,
        due_ms: int | None = None,
        leads: list[bytes] | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> list[jf.Put]:
        """append_nowait's fast path: small items that fit the current segment and
        batch, encoded in bulk. [] if they don't (the general loop handles it).
        `leads`: each item's HEADERS record and `headers` its block (b"": none)."""
        assert self._proj_size is not None
        n = len(datas)
        total = sum(map(len, datas)) + len(pack_head(0, 1)) * n
        if leads is not None:
            total += sum(map(len, leads))
        chunk = self._pending[-1] if self._pending else None
        if (self._proj_size + total > self.config.journal_size
                or (chunk is not None and chunk.nbytes + total > MAX_BATCH_BYTES)):
            return []
        if chunk is None:
            chunk = self._new_chunk(rotate=False)
        first = self.last_id + 1
        ids = range(first, first + n)
        parts: list[bytes] = [b""] * (2 * n)
        parts[::2] = jf.pack_put_heads(datas, first, add_time_ms, expire_time_ms,
                                       error_count, flags, due_ms, pack_head)
        if leads is not None:
            parts[::2] = map(operator.add, leads, parts[::2])
        parts[1::2] = datas
        chunk.small += b"".join(parts)
        self._booked(chunk, first, n, total, ticket)
        if due_ms is not None:
            return [jf.DelayedPut(i, d, add_time_ms, expire_time_ms, error_count, flags, due_ms,
                                  h) for i, d, h in zip(ids, datas, headers or repeat(b"", n),
                                                        strict=True)]
        if headers is not None:
            return [jf.HeadedPut(i, d, add_time_ms, expire_time_ms, error_count, flags, h) if h
                    else jf.Put(i, d, add_time_ms, expire_time_ms, error_count, flags)
                    for i, d, h in zip(ids, datas, headers, strict=True)]
        # (jf.Put by name, not a local alias: compiled, that is a direct call of the
        # native class's constructor, not a call of a Python type object)
        puts: list[jf.Put] = []
        xid = first
        for d in datas:
            puts.append(jf.Put(xid, d, add_time_ms, expire_time_ms, error_count, flags))
            xid += 1
        return puts

    def _new_chunk(self, *, rotate: bool) -> Planned:
        """A new chunk at the end of the planned ones."""
        chunk = Planned(rotate=rotate)
        if self._pending is NO_CHUNKS:
            self._pending = []
        self._pending.append(chunk)
        return chunk

    async def append(
        self,
        datas: Sequence[bytes],
        add_time_ms: int,
        expire_time_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        headers: Sequence[bytes] | None = None,
    ) -> list[jf.Put]:
        """Journal `datas`; returns the records once durable under the fsync policy."""
        if self.config.max_journal_size:
            await self.make_room(
                sum(len(d) for d in datas) + put_overhead(flags) * len(datas)
                + headers_overhead(headers)
            )
        puts, ticket = self.append_nowait(datas, add_time_ms, expire_time_ms, error_count,
                                          flags, headers=headers)
        await wait_durable(ticket)
        return puts

    async def make_room(self, incoming: int) -> None:
        limit = self.config.max_journal_size
        if not limit or self.total_bytes + incoming <= limit:
            return
        if incoming > limit:  # could never fit: refuse before dropping anything
            raise JournalFullError(
                f"queue {self.name!r}: {incoming} bytes can never fit in "
                f"max_journal_size {limit}"
            )
        await self.compact()
        if self.total_bytes + incoming <= limit:
            return
        if self.config.full_policy is FullPolicy.DROP_OLDEST:
            await self.drop_oldest(limit - incoming)
            if self.total_bytes + incoming <= limit:
                return
        raise JournalFullError(
            f"queue {self.name!r}: journal at {self.total_bytes} bytes, "
            f"max_journal_size is {limit}"
        )

    # -- rounds: the data directory hands pending chunks to the writer and back -------

    @property
    def planned(self) -> Sequence[Planned]:
        """The chunks planned since the last round (not taken)."""
        return self._pending

    def take_pending(self) -> list[Planned]:
        """The chunks planned since the last round, for the writer's next round."""
        chunks, self._pending = self._pending, NO_CHUNKS
        return [] if chunks is NO_CHUNKS else chunks

    @property
    def has_reader_ops(self) -> bool:
        """Reader file changes were planned since the last round."""
        return bool(self._reader_ops)

    @property
    def planned_readers(self) -> ReaderWork:
        """The reader file changes planned since the last round (not taken)."""
        return [(self._reader_file(r), ops) for r, ops in self._reader_ops.items()]

    def take_reader_ops(self) -> ReaderWork:
        """The reader file changes planned since the last round, for the next round."""
        if not self._reader_ops:
            return []
        work = self.planned_readers
        self._reader_ops = NO_ENTRIES
        return work

    def finish_reader_ops(self, work: ReaderWork) -> None:
        """Back on the event loop: the durable checkpoints moved, tickets resolved."""
        for rfile, ops in work:
            for op in ops:
                if op.failed is None:
                    if op.checkpoint is not None:
                        self.readers[rfile.reader] = op.checkpoint
                    elif op.head is not None and rfile.reader in self.readers:
                        cp = self.readers[rfile.reader]
                        if op.head > cp.head:
                            self.readers[rfile.reader] = Checkpoint(
                                op.head, tuple(i for i in cp.done if i > op.head),
                                tuple(e for e in cp.errors if e[0] > op.head),
                                tuple(e for e in cp.delays if e[0] > op.head))
                else:
                    log.error("queue %s: %s", self.name, op.failed)
                    if op.appends and op.done:
                        self._drop_planned_checkpoints(rfile.reader, op.failed)
                op.ticket.resolve(op.failed)

    def _drop_planned_checkpoints(self, reader: str, error: BaseException) -> None:
        """An append of confirms to `reader`'s file failed: checkpoints planned meanwhile
        were taken from a reader that held those confirms as done, which their owners now undo (see
        Ticket.on_failure); written, they would make a refused confirm durable after all.
        They fail instead (the reader stays dirty: the next checkpoint is taken afresh)."""
        ops = self._reader_ops.get(reader)
        if not ops or all(op.checkpoint is None for op in ops):
            return
        kept = []
        for op in ops:
            if op.checkpoint is None:
                kept.append(op)
            else:
                op.ticket.resolve(error)
        if kept:
            self._reader_ops[reader] = kept
        else:
            del self._reader_ops[reader]

    def files(self) -> list[SyncedFile]:
        """The writer side of every file of this queue: its segment and its readers'."""
        return [self.file, *self._reader_files.values()]

    def fsync_deadline(self) -> float | None:
        """When the next periodic fsync of any of this queue's files falls due."""
        if not self._reader_files:
            return self.file.fsync_deadline()
        return min((d for f in self.files() if (d := f.fsync_deadline()) is not None),
                   default=None)

    def close_files(self) -> None:
        """fsync what is unsynced and close every file (synchronous)."""
        errors: list[OSError] = []
        for f in self.files():
            try:
                f.close()
            except OSError as exc:  # close the others all the same
                errors.append(exc)
        if errors:
            raise errors[0]

    def finish_round(self, chunks: list[Planned], result: WriteResult) -> None:
        """Back on the event loop: note what the writer wrote, resolve the tickets."""
        for i, w in enumerate(result.written):
            if w.created:  # the writer only ever appends to the newest segment
                path = self.host.path / jf.segment_name(self.name, w.number)
                self.segments.append(SegmentInfo(w.number, path, size=w.offset, inode=w.inode,
                                                 incarnation=self.file.incarnation))
            self.segments[-1].note_batch(w.offset, w.end, w.count, w.first_id, w.last_id,
                                         marks=chunks[i].marks if i < len(chunks) else 0)
            self._batches += 1
        # One append's chunks are always taken in the same round, so every ticket
        # here is resolved now; it fails if any of its chunks failed.
        error = result.error
        for i, chunk in enumerate(chunks):
            self._pending_bytes -= chunk.nbytes
            if i >= len(result.written):
                for ticket in chunk.tickets:
                    ticket.error = ticket.error or error
        for chunk in chunks:
            for ticket in chunk.tickets:
                ticket.set()
        if error is not None:
            # Start afresh in a new segment: what was planned no longer matches the files.
            self._proj_size = None
            self._proj_count = 0
            log.error("queue %s: append failed: %s", self.name, error)

    # -- read-back ----------------------------------------------------------------

    def iter_puts(self, from_id: int = 1, to_id: int | None = None) -> Iterator[jf.Put]:
        """PUT records with from_id <= id (<= to_id), in order, read from the segments.

        Streams in chunks; never loads a whole segment. Synchronous: call it
        from a worker thread when the backlog is large.
        """
        next_id = from_id
        misses = 0
        while True:
            seg = next(
                (s for s in list(self.segments) if s.count and s.last_id >= next_id), None
            )
            if seg is None or (to_id is not None and next_id > to_id):
                return
            try:
                yield from self.iter_segment(seg, next_id, to_id)
            except FileNotFoundError:
                # Compaction replaced it under us and is about to publish the new
                # list: look it up again after a short pause (bounded).
                misses += 1
                if misses > 50:
                    raise
                time.sleep(0.002 * misses)
                continue
            next_id = max(next_id, seg.last_id + 1)

    def iter_segment(self, seg: SegmentInfo, from_id: int, to_id: int | None) -> Iterator[jf.Put]:
        """PUT records of one segment with from_id <= id (<= to_id); see read_segment."""
        return read_segment(seg, from_id, to_id)

    def iter_unconsumed(self, reader: str = "") -> Iterator[jf.Put]:
        """Items reader `reader`'s durable checkpoint has not consumed."""
        cp = self.readers.get(reader, Checkpoint())
        done = set(cp.done)
        for put in self.iter_puts(cp.head + 1):
            if put.id not in done:
                yield put

    # -- reader files: confirms, error counts, checkpoints ------------------------------

    def note_read(
        self, reader: str, *, done: Sequence[int] = (),
        errors: Sequence[tuple[int, int]] = (), head: int | None = None,
        delays: Sequence[tuple[int, int]] = (),
    ) -> Ticket:
        """Append to reader `reader`'s file, in the next round: ids it consumed (`done`,
        confirms), error counts aborts gave (`errors`), due times aborts with a delay gave
        (`delays`), a new `head`. The ticket is set once that is durable under the fsync
        policy (planned appends share one)."""
        op = self._plan(reader, None)
        op.done.extend(done)
        op.errors.update(errors)
        if delays:
            op.delays.update(delays)
        if head is not None:
            op.head = head if op.head is None else max(op.head, head)
        self.host.note_pending(self)
        return op.ticket

    async def write_producers(self, marks: list[jf.ProducerMark]) -> None:
        """Replace the queue's producer snapshot (`q.producers`) durably.

        The puts its marks name must be on disk first, whatever the fsync policy: under
        `periodic` a written put may not be yet, and a power cut that took it would make
        recovery drop its mark as torn while the snapshot had replaced the producer's
        older mark, whose put stayed (a re-send of it would then be stored twice)."""
        await self.host.sync_segment(self)
        path = self.host.path / jf.producers_name(self.name)
        await trio.to_thread.run_sync(write_producers, path, marks)

    async def write_dedup(self, marks: list[jf.DedupMark]) -> None:
        """Replace the queue's key snapshot (`q.dedup`) durably, the puts its keys name on
        disk first (see write_producers)."""
        await self.host.sync_segment(self)
        path = self.host.path / jf.dedup_name(self.name)
        await trio.to_thread.run_sync(write_dedup, path, marks)

    async def write_checkpoint(
        self, reader: str, head: int, done: Sequence[int] = (),
        errors: Sequence[tuple[int, int]] = (), delays: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Make reader `reader`'s position durable: its file is written anew (temp +
        fsync + rename + dir fsync) in the next round, after every append planned
        before this call and before any planned after it, so `head`, `done` and `errors`
        must be the reader's position now (nothing consumed since they were taken)."""
        cp = Checkpoint(head, tuple(sorted(i for i in done if i > head)),
                        tuple(sorted(e for e in errors if e[0] > head)),
                        tuple(sorted(e for e in delays if e[0] > head)))
        op = self._plan(reader, PlannedOp(rewrite=encode_checkpoint(cp), checkpoint=cp))
        self.host.note_pending(self)
        await wait_durable(op.ticket)

    async def remove_reader(self, reader: str) -> None:
        """Remove reader `reader`'s file (durably, after its planned changes)."""
        self.readers.pop(reader, None)
        op = self._plan(reader, PlannedOp(remove=True))
        self.host.note_pending(self)
        await wait_durable(op.ticket)

    def _plan(self, reader: str, op: PlannedOp | None) -> PlannedOp:
        """Queue `op` for reader `reader`'s file; None: the append planned last, or a new
        one. Raises JournalClosedError once the journal is closed."""
        if self._closed:
            raise JournalClosedError(f"journal of queue {self.name!r} is closed")
        ops = self._reader_ops.get(reader)
        if ops is None:
            if self._reader_ops is NO_ENTRIES:
                self._reader_ops = {}
            ops = self._reader_ops[reader] = []
        if op is None:
            if ops and ops[-1].appends:
                return ops[-1]
            op = PlannedOp()
        ops.append(op)
        return op

    def _reader_file(self, reader: str) -> ReaderFile:
        rfile = self._reader_files.get(reader)
        if rfile is None:
            rfile = self.host.reader_file(self.name, reader, self.config.fsync)
            # A reader the journal knows but whose file is missing is at head 0: a new
            # queue's default reader, or one recovered without a checkpoint.
            rfile.create_missing = reader in self.readers
            if self._reader_files is NO_ENTRIES:
                self._reader_files = {}
            self._reader_files[reader] = rfile
        return rfile

    # -- compaction and size limits -------------------------------------------------

    async def compact(self) -> CompactionResult:
        """Remove dead segments, rewrite straggler-pinned ones; see queued.storage.compaction."""
        async with self.maintenance_lock:
            if self.before_compact is not None:
                plan = compaction.plan_compaction(self.segments, dict(self.readers),
                                                  self.config.compact_live_ratio)
                if plan.dead or plan.runs:
                    await self.before_compact()
            return await compaction.compact(
                self.segments, dict(self.readers), self.config.compact_live_ratio,
                self.iter_segment, self.host,
            )

    async def drop_oldest(self, target_bytes: int) -> None:
        """Drop whole segments, oldest first, until the journal holds at most
        `target_bytes` (the newest always stays); readers' checkpoints move past them."""
        async with self.maintenance_lock:
            while self.total_bytes > target_bytes and len(self.segments) > 1:
                seg = self.segments[0]
                for reader, cp in list(self.readers.items()):
                    if cp.head < seg.last_id:  # appended: the confirms appended stay
                        await wait_durable(self.note_read(reader, head=seg.last_id))
                if not self.readers:
                    await self.write_checkpoint("", seg.last_id)
                if self.before_drop is not None:
                    await self.before_drop(seg)
                await trio.to_thread.run_sync(self.host.retire_segments, [seg])
                self.segments.remove(seg)
                log.warning(
                    "queue %s: journal over max_journal_size, dropped %d items (ids %d..%d)",
                    self.name, seg.count, seg.first_id, seg.last_id,
                )

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Refuse appends from now on (JournalClosedError); planned ones still get written
        by the next round unless `fail_pending` fails them first."""
        self._closed = True

    def fail_pending(self, error: BaseException) -> None:
        """Fail every planned append (and reader file change) that no round has taken."""
        for chunk in self.take_pending():
            self._pending_bytes -= chunk.nbytes
            for ticket in chunk.tickets:
                ticket.error = error
                ticket.set()
        for _, ops in self.take_reader_ops():
            for op in ops:
                op.ticket.resolve(error)

    def statistics(self) -> JournalStats:
        return JournalStats(
            queue=self.name,
            segments=len(self.segments),
            bytes=sum(s.size for s in self.segments),
            pending_bytes=self._pending_bytes,
            last_id=self.last_id,
            appends=self._appends,
            items_appended=self._items,
            batches_written=self._batches,
            fsyncs=sum(f.fsyncs for f in self.files()),
            write_errors=sum(f.write_errors for f in self.files()),
            failed=self.file.failed is not None,
            readers=len(self.readers),
        )


async def wait_durable(ticket: Ticket) -> None:
    await ticket.wait()  # (tickets of one round are set together: wait once)
    if ticket.error is not None:
        raise ticket.error
