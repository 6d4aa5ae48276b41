"""The journal of one queue: segments, appends, read-back, checkpoints, size limits.

Owns the queue's writer segments and reader checkpoint files. Appends are
planned here on the trio side and written by the data directory's writer task
(queued.storage.datadir) in a worker thread: one write + one fsync per queue per round.
Never acknowledges an append before its bytes are written and, under fsync
"always", fsynced. Knows nothing of sockets or protocols.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from queued.config.policies import FsyncMode, FullPolicy, JournalConfig, MiB
from queued.core import journal_format as jf
from queued.core.errors import (
    JournalClosedError,
    JournalError,
    JournalFullError,
    JournalWriteError,
)
from queued.storage import compaction
from queued.storage.compaction import CompactionResult
from queued.storage.files import (
    Checkpoint,
    SegmentInfo,
    fsync_dir,
    unlink_durably,
    write_checkpoint,
)

if TYPE_CHECKING:
    from queued.storage.datadir import DataDir

log = logging.getLogger("queued.journal")

#: One check record covers at most this much: its length field is 32 bits.
MAX_BATCH_BYTES = 64 * MiB
#: write() errors after which the file can be trimmed back and appends retried later.
RECOVERABLE_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


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


class Ticket:
    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: BaseException | None = None


#: Item data at least this large is written from the caller's buffer (writev), not copied.
ZERO_COPY_BYTES = 4096
#: Most iovecs one writev takes (IOV_MAX on Linux).
IOV_MAX = 1024


@dataclass(slots=True)
class _Chunk:
    """Records waiting for the writer; one chunk becomes one checked batch.

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
    tickets: list[Ticket] = field(default_factory=list)

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


@dataclass(slots=True)
class _Written:
    """What the writer thread did with one chunk."""

    number: int
    created: bool
    offset: int
    end: int
    count: int
    first_id: int
    last_id: int
    inode: int


class QueueJournal:
    """Segments and durable reader checkpoints of one queue.

    `append` assigns ids and returns once durable under the fsync policy.
    `readers` holds the last checkpoint of each reader that is on disk: it is
    what compaction and size enforcement respect.
    """

    def __init__(
        self,
        datadir: DataDir,
        name: str,
        config: JournalConfig,
        segments: list[SegmentInfo],
        readers: dict[str, Checkpoint],
        last_id: int,
    ) -> None:
        self.datadir = datadir
        self.name = name
        self.config = config
        self.segments = segments
        self.readers = readers
        self.last_id = last_id
        #: awaited with a segment about to be dropped under drop_oldest (file still there),
        #: after every reader's checkpoint has moved past it
        self.before_drop: Callable[[SegmentInfo], Awaitable[None]] | None = None
        self._pending: list[_Chunk] = []
        self._pending_bytes = 0
        # Projection of the active segment including pending chunks, to split
        # batches where segments rotate. None = the next append opens a segment.
        self._proj_size: int | None = None
        self._proj_count = 0
        # Writer-thread state: touched only inside the writer's worker thread.
        self._fd: int | None = None
        self._fd_number = 0
        self._fd_size = 0
        self._last_number = max((s.number for s in segments), default=0)
        self._unsynced = False
        self._last_fsync = time.monotonic()
        self._failed: JournalWriteError | None = None
        self._closed = False
        self._checkpoint_lock = trio.Lock()
        self._maintenance_lock = trio.Lock()
        self._appends = self._items = self._batches = self._fsyncs = self._write_errors = 0

    # -- appends ----------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments) + self._pending_bytes

    @property
    def failed(self) -> JournalWriteError | None:
        return self._failed

    def append_nowait(
        self,
        datas: Sequence[bytes],
        add_time_ms: int,
        expire_time_ms: int | None = None,
        error_count: int = 0,
    ) -> tuple[list[jf.Put], Ticket]:
        """Queue `datas` for the writer; ids are assigned here, in order."""
        if self._closed:
            raise JournalClosedError(f"journal of queue {self.name!r} is closed")
        if self._failed is not None:
            raise JournalWriteError(f"queue {self.name!r} refuses writes: {self._failed}")
        ticket = Ticket()
        # Check everything before touching any state, so a bad item changes nothing.
        pack_head = jf.put_header_packer(add_time_ms, expire_time_ms, error_count)
        if set(map(type, datas)) - {bytes}:
            datas = [d if isinstance(d, bytes) else bytes(d) for d in datas]
        largest = max(map(len, datas), default=0)
        if largest > jf.MAX_DATA_SIZE:
            raise ValueError("item data larger than 2 GiB - 1")
        if self.last_id + len(datas) > jf.MAX_ID:
            raise ValueError("item ids exhausted")
        puts: list[jf.Put] = []
        limit = self.config.journal_size
        next_id = self.last_id
        if self._proj_size is not None and not self._pending:
            # This call opens a new round's batch, which a check record will seal.
            self._proj_size += jf.CHECK_RECORD_SIZE
        if datas and largest < ZERO_COPY_BYTES and self._proj_size is not None:
            puts = self._append_small(datas, pack_head, ticket, add_time_ms, expire_time_ms,
                                      error_count)
            if puts:
                datas = ()  # done in bulk
                next_id = puts[-1].id
        for data in datas:
            next_id += 1
            head = pack_head(len(data), next_id)
            size = len(head) + len(data)
            chunk = self._pending[-1] if self._pending else None
            if self._proj_size is None or (
                self._proj_count and self._proj_size + size > limit
            ):
                chunk = _Chunk(rotate=True)
                self._pending.append(chunk)
                self._proj_size = jf.MAGIC_SIZE + 2 * jf.CHECK_RECORD_SIZE
                self._proj_count = 0
            elif chunk is None or chunk.nbytes + size > MAX_BATCH_BYTES:
                if chunk is not None:  # a split batch gets a check record of its own
                    self._proj_size += jf.CHECK_RECORD_SIZE
                chunk = _Chunk(rotate=False)
                self._pending.append(chunk)
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
            puts.append(jf.Put(next_id, data, add_time_ms, expire_time_ms, error_count))
        self.last_id = next_id
        self._appends += 1
        self._items += len(puts)
        if not puts:
            ticket.event.set()
        else:
            self.datadir._mark_dirty(self)
        return puts, ticket

    def _append_small(
        self,
        datas: Sequence[bytes],
        pack_head: Callable[[int, int], bytes],
        ticket: Ticket,
        add_time_ms: int,
        expire_time_ms: int | None,
        error_count: int,
    ) -> list[jf.Put]:
        """append_nowait's fast path: small items that fit the current segment and
        batch, encoded in bulk. [] if they don't (the general loop handles it)."""
        assert self._proj_size is not None
        n = len(datas)
        total = sum(map(len, datas)) + len(pack_head(0, 1)) * n
        chunk = self._pending[-1] if self._pending else None
        if (self._proj_size + total > self.config.journal_size
                or (chunk is not None and chunk.nbytes + total > MAX_BATCH_BYTES)):
            return []
        if chunk is None:
            chunk = _Chunk(rotate=False)
            self._pending.append(chunk)
        first = self.last_id + 1
        ids = range(first, first + n)
        parts: list[bytes] = [b""] * (2 * n)
        parts[::2] = map(pack_head, map(len, datas), ids)
        parts[1::2] = datas
        chunk.small += b"".join(parts)
        chunk.nbytes += total
        if not chunk.count:
            chunk.first_id = first
        chunk.count += n
        chunk.last_id = first + n - 1
        if not chunk.tickets or chunk.tickets[-1] is not ticket:
            chunk.tickets.append(ticket)
        self._proj_size += total
        self._proj_count += n
        self._pending_bytes += total
        put = jf.Put
        return [put(i, d, add_time_ms, expire_time_ms, error_count)
                for i, d in zip(ids, datas, strict=True)]

    async def append(
        self,
        datas: Sequence[bytes],
        add_time_ms: int,
        expire_time_ms: int | None = None,
        error_count: int = 0,
    ) -> list[jf.Put]:
        """Journal `datas`; returns the records once durable under the fsync policy."""
        if self.config.max_journal_size:
            await self.make_room(
                sum(len(d) for d in datas) + jf.PUT_EXPIRE_HEADER_SIZE * len(datas)
            )
        puts, ticket = self.append_nowait(datas, add_time_ms, expire_time_ms, error_count)
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
            await self._drop_oldest(limit - incoming)
            if self.total_bytes + incoming <= limit:
                return
        raise JournalFullError(
            f"queue {self.name!r}: journal at {self.total_bytes} bytes, "
            f"max_journal_size is {limit}"
        )

    def _fail_pending(self, error: BaseException) -> None:
        for chunk in self._take_pending():
            self._pending_bytes -= chunk.nbytes
            for ticket in chunk.tickets:
                ticket.error = error
                ticket.event.set()

    def _take_pending(self) -> list[_Chunk]:
        chunks, self._pending = self._pending, []
        return chunks

    # -- the writer thread's half ----------------------------------------------

    def _open_segment(self) -> bytes:
        """Create the next segment file; returns the bytes it must start with."""
        number = max(int(time.time() * 1000), self._last_number + 1)
        path = self.datadir.path / jf.segment_name(self.name, number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fd, self._fd_number, self._fd_size = fd, number, 0
        self._last_number = number
        return jf.WRITER_MAGIC + jf.EMPTY_CHECK

    def _write_chunks(self, chunks: list[_Chunk]) -> tuple[list[_Written], BaseException | None]:
        """Runs in the writer thread. Returns what was written and durable, and the
        error that stopped the round, if any. Nothing is returned as written unless
        the fsync policy's syncs for it succeeded."""
        done: list[_Written] = []
        created_any = False
        error: BaseException | None = None
        never = self.config.fsync.mode is FsyncMode.NEVER
        for chunk in chunks:
            if (chunk.rotate or self._fd is None) and self._fd is not None:
                # The segment being left holds batches of this round: sync it first.
                try:
                    if not never:
                        self._fsync()
                except OSError as exc:
                    return [], self._set_failed(f"fsync failed: {exc}")
                os.close(self._fd)
                self._fd = None
            created = False
            try:
                prefix = b""
                if self._fd is None:
                    prefix = self._open_segment()
                    created = created_any = True
                assert self._fd is not None
                offset = self._fd_size + len(prefix)
                pieces = chunk.take_pieces()
                crc = jf.crc_seed(offset)
                for piece in pieces:
                    crc = zlib.crc32(piece, crc)
                check = jf.encode_check_crc(chunk.nbytes, crc)
                written = len(prefix) + chunk.nbytes + len(check)
                _writev_all(self._fd, [prefix, *pieces, check] if prefix else [*pieces, check])
            except OSError as exc:
                error = self._write_failed(exc, created)
                break
            self._fd_size += written
            self._unsynced = True
            done.append(
                _Written(self._fd_number, created, offset, self._fd_size, chunk.count,
                         chunk.first_id, chunk.last_id,
                         os.fstat(self._fd).st_ino if created else 0)
            )
        policy = self.config.fsync
        try:
            if policy.mode is FsyncMode.ALWAYS:
                self._fsync()
            elif policy.mode is FsyncMode.PERIODIC:
                self.fsync_if_due()
            if created_any and not never:
                fsync_dir(self.datadir.path)
        except OSError as exc:
            # After a failed fsync the page cache may have dropped our pages: the
            # files can no longer be trusted for writes (reads of the past still work).
            return [], self._set_failed(f"fsync failed: {exc}")
        return done, error

    def _set_failed(self, why: str) -> JournalWriteError:
        self._failed = JournalWriteError(f"queue {self.name!r} refuses writes: {why}")
        log.error("%s", self._failed)
        return self._failed

    def _fsync(self) -> None:
        if self._fd is not None and self._unsynced:
            started = time.monotonic()
            os.fsync(self._fd)
            self._fsyncs += 1
            self.datadir._observe_fsync(time.monotonic() - started)
        self._unsynced = False
        self._last_fsync = time.monotonic()

    def fsync_if_due(self) -> None:
        policy = self.config.fsync
        due = self._last_fsync + policy.interval_ms / 1000
        if self._unsynced and time.monotonic() >= due:
            self._fsync()

    def _fsync_deadline(self) -> float | None:
        if self.config.fsync.mode is FsyncMode.PERIODIC and self._unsynced and not self._failed:
            return self._last_fsync + self.config.fsync.interval_ms / 1000
        return None

    def _write_failed(self, exc: OSError, created: bool) -> BaseException:
        """Trim a partial write so the file ends on a batch again, or give up writing."""
        self._write_errors += 1
        fd = self._fd
        try:
            if fd is not None:
                if created:
                    os.close(fd)
                    self._fd = None
                    os.unlink(self.datadir.path / jf.segment_name(self.name, self._fd_number))
                else:
                    os.ftruncate(fd, self._fd_size)
        except OSError as trim_exc:
            return self._set_failed(
                f"write failed ({exc}) and the partial batch could not be trimmed ({trim_exc})"
            )
        if exc.errno in RECOVERABLE_WRITE_ERRNOS:
            return JournalWriteError(
                f"queue {self.name!r}: write refused, nothing stored: {os.strerror(exc.errno)}"
            )
        return self._set_failed(f"write failed: {exc}")

    # -- back on the event loop -------------------------------------------------

    def _apply(
        self, chunks: list[_Chunk], done: list[_Written], error: BaseException | None
    ) -> None:
        for w in done:
            if w.created:  # the writer only ever appends to the newest segment
                path = self.datadir.path / jf.segment_name(self.name, w.number)
                self.segments.append(SegmentInfo(w.number, path, size=w.offset, inode=w.inode))
            self.segments[-1].note_batch(w.offset, w.end, w.count, w.first_id, w.last_id)
            self._batches += 1
        # One append's chunks are always taken in the same round, so every ticket
        # here is resolved now; it fails if any of its chunks failed.
        for i, chunk in enumerate(chunks):
            self._pending_bytes -= chunk.nbytes
            if i >= len(done):
                for ticket in chunk.tickets:
                    ticket.error = ticket.error or error
        for chunk in chunks:
            for ticket in chunk.tickets:
                ticket.event.set()
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
        offset = seg.seek_offset(from_id)
        limit = seg.size
        with seg.path.open("rb") as f:
            if seg.inode and os.fstat(f.fileno()).st_ino != seg.inode:
                raise FileNotFoundError(f"{seg.path} was replaced")
            f.seek(offset)
            dec = jf.RecordDecoder(jf.FileKind.WRITER, start_offset=offset, expect_magic=False)
            remaining = limit - offset
            while True:
                ev = dec.next_event()
                if ev is jf.NEED_DATA:
                    data = f.read(min(remaining, 1 * MiB)) if remaining > 0 else b""
                    remaining -= len(data)
                    dec.receive_data(data)
                    continue
                if isinstance(ev, jf.Decoded):
                    rec = ev.record
                    if isinstance(rec, jf.Put) and rec.id >= from_id:
                        if to_id is not None and rec.id > to_id:
                            return
                        yield rec
                    continue
                if isinstance(ev, jf.TornTail):
                    raise JournalError(f"{seg.path}: record cut short at {ev.offset}")
                return

    def iter_unconsumed(self, reader: str = "") -> Iterator[jf.Put]:
        """Items reader `reader`'s durable checkpoint has not consumed."""
        cp = self.readers.get(reader, Checkpoint())
        done = set(cp.done)
        for put in self.iter_puts(cp.head + 1):
            if put.id not in done:
                yield put

    # -- checkpoints --------------------------------------------------------------

    async def write_checkpoint(self, reader: str, head: int, done: Sequence[int] = ()) -> None:
        """Make reader `reader`'s position durable (temp + fsync + rename + dir fsync)."""
        cp = Checkpoint(head, tuple(sorted(i for i in done if i > head)))
        path = self.datadir.path / jf.checkpoint_name(self.name, reader)
        async with self._checkpoint_lock:
            await trio.to_thread.run_sync(write_checkpoint, path, cp)
            self.readers[reader] = cp

    async def remove_reader(self, reader: str) -> None:
        path = self.datadir.path / jf.checkpoint_name(self.name, reader)
        async with self._checkpoint_lock:
            self.readers.pop(reader, None)
            await trio.to_thread.run_sync(unlink_durably, path)

    # -- compaction and size limits -------------------------------------------------

    async def compact(self) -> CompactionResult:
        """Remove dead segments, rewrite straggler-pinned ones; see queued.storage.compaction."""
        async with self._maintenance_lock:
            return await compaction.compact(self)

    async def _drop_oldest(self, target_bytes: int) -> None:
        async with self._maintenance_lock:
            while self.total_bytes > target_bytes and len(self.segments) > 1:
                seg = self.segments[0]
                for reader, cp in list(self.readers.items()):
                    if cp.head < seg.last_id:
                        await self.write_checkpoint(reader, seg.last_id, cp.done)
                if not self.readers:
                    await self.write_checkpoint("", seg.last_id)
                if self.before_drop is not None:
                    await self.before_drop(seg)
                await trio.to_thread.run_sync(self.datadir.retire_segments, [seg])
                self.segments.remove(seg)
                log.warning(
                    "queue %s: journal over max_journal_size, dropped %d items (ids %d..%d)",
                    self.name, seg.count, seg.first_id, seg.last_id,
                )

    # -- lifecycle ---------------------------------------------------------------------

    def _close_sync(self) -> None:
        if self._fd is not None:
            try:
                if self._unsynced:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None

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
            fsyncs=self._fsyncs,
            write_errors=self._write_errors,
            failed=self._failed is not None,
            readers=len(self.readers),
        )


async def wait_durable(ticket: Ticket) -> None:
    if not ticket.event.is_set():  # tickets of one round are set together: wait once
        await ticket.event.wait()
    if ticket.error is not None:
        raise ticket.error


def _writev_all(fd: int, pieces: list[bytes | bytearray]) -> None:
    """Write every piece, in order, with as few syscalls as writev allows."""
    i = 0
    while i < len(pieces):
        batch = pieces[i : i + IOV_MAX]
        n = os.writev(fd, batch)
        want = sum(len(p) for p in batch)
        if n == want:
            i += len(batch)
            continue
        # A short write: skip what went out, finish the piece it stopped in.
        for p in batch:
            if n >= len(p):
                n -= len(p)
                i += 1
                continue
            view = memoryview(p)[n:]
            while view:
                view = view[os.write(fd, view):]
            i += 1
            break

