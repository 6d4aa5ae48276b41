"""The writer: every queue's open segment file and the write + fsync rounds (group commit).

Owns the file handles and their state (fd, size, unsynced bytes, last fsync,
failure) and one round: for each queue with planned chunks one writev and one
fsync, in a worker thread, or inline on the event loop for a small round that
needs no fsync and opens no file. Never reports a chunk written unless the
fsync policy's syncs covering it succeeded; after a failed fsync (or a write
error it cannot trim away) that queue's file refuses writes for good.
Knows nothing of tickets, readers or ids beyond what a chunk carries.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import trio

from queued.config.policies import FsyncMode, FsyncPolicy
from queued.errors import JournalWriteError
from queued.journal import format as jf
from queued.stats import FSYNC_BUCKETS, Histogram, HistogramSnapshot
from queued.storage import fileio
from queued.storage.files import fsync_dir, write_file_atomic, write_temp

# Failures are the queue's journal failing, as operators know it: log under its name.
log = logging.getLogger("queued.journal")

#: write() errors after which the file can be trimmed back and appends retried later.
RECOVERABLE_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: Item data at least this large is written from the caller's buffer (writev), not copied.
ZERO_COPY_BYTES = 4096
T = TypeVar("T")
#: Most iovecs one writev takes (IOV_MAX on Linux).
IOV_MAX = 1024
#: Threads that write and sync several queues' files of one round at once.
ROUND_THREADS = 8
#: A round this small, without fsync or new files, runs on the event loop itself.
INLINE_ROUND_BYTES = 256 * 1024
#: Segment files a round on the caller's thread syncs together (`fileio.sync_files`)
#: rather than one fsync each, from this many on.
SYNC_TOGETHER = 4


@dataclass(slots=True)
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


@dataclass(slots=True)
class WriteResult:
    """One queue's share of a round: the chunks written and durable, in order, and
    the error that stopped the rest (chunks past len(written) were not stored)."""

    written: list[Written]
    error: BaseException | None = None


class SyncedFile:
    """What a queue's files share on the writer side: the fd, the fsync policy and its
    bookkeeping (unsynced bytes, last fsync), the failure that ends writes.

    Touched only by a round: in the worker thread, or inline on the loop while
    no thread runs one. `fsync` is the queue's current policy (its journal keeps
    it up to date); `failed` is read from the loop.
    """

    __slots__ = ("_failed", "_fd", "_last_fsync", "_size", "_unsynced", "directory",
                 "fsync", "fsyncs", "observe_fsync", "queue", "write_errors")

    def __init__(
        self,
        directory: Path,
        queue: str,
        fsync: FsyncPolicy,
        observe_fsync: Callable[[float], None],
    ) -> None:
        self.directory = directory
        self.queue = queue
        self.fsync = fsync
        self.fsyncs = 0
        self.write_errors = 0
        self.observe_fsync = observe_fsync
        self._fd: int | None = None
        self._size = 0
        self._unsynced = False
        self._last_fsync = time.monotonic()
        self._failed: JournalWriteError | None = None

    @property
    def failed(self) -> JournalWriteError | None:
        """Set once writes can no longer be trusted; reads of the past still work."""
        return self._failed

    def describe(self) -> str:
        return f"queue {self.queue!r}"

    def set_failed(self, why: str) -> JournalWriteError:
        """Refuse writes from now on (logged); what the writer does after a failed fsync."""
        self._failed = JournalWriteError(f"{self.describe()} refuses writes: {why}")
        log.error("%s", self._failed)
        return self._failed

    def fsync_if_due(self) -> None:
        """Under a periodic policy: fsync when the interval since the last one is over."""
        due = self._last_fsync + self.fsync.interval_ms / 1000
        if self._unsynced and time.monotonic() >= due:
            self._fsync()

    def periodic_fsync(self) -> None:
        """fsync_if_due for a file with nothing to write: a failure, having no append
        to report to, makes the file refuse writes (and is logged)."""
        try:
            self.fsync_if_due()
        except OSError as exc:
            self.set_failed(f"fsync failed: {exc}")

    def fsync_deadline(self) -> float | None:
        """When a periodic fsync falls due (time.monotonic()), if one is owed."""
        if self.fsync.mode is FsyncMode.PERIODIC and self._unsynced and not self._failed:
            return self._last_fsync + self.fsync.interval_ms / 1000
        return None

    def close(self) -> None:
        """fsync what is unsynced and close the file (a later write opens it again)."""
        if self._fd is not None:
            try:
                if self._unsynced:
                    fileio.fsync(self._fd)
                    self._unsynced = False
            finally:
                fileio.close(self._fd)
                self._fd = None

    def _trimmed(self, exc: OSError, trim: Callable[[], None]) -> BaseException:
        """After a failed write: `trim` takes the partial batch off (the file ends on a
        batch again); a full disk is then refused but not fatal, anything else (or a
        failed trim) makes the file refuse writes."""
        try:
            trim()
        except OSError as trim_exc:
            return self.set_failed(
                f"write failed ({exc}) and the partial batch could not be trimmed ({trim_exc})"
            )
        if exc.errno in RECOVERABLE_WRITE_ERRNOS:
            return JournalWriteError(
                f"{self.describe()}: write refused, nothing stored: {os.strerror(exc.errno)}"
            )
        return self.set_failed(f"write failed: {exc}")

    def _sync_by_policy(self) -> None:
        if self.fsync.mode is FsyncMode.ALWAYS:
            self._fsync()
        elif self.fsync.mode is FsyncMode.PERIODIC:
            self.fsync_if_due()

    def _inline_ok(self) -> bool:
        """True when a write now needs no fsync (the file being open is the caller's)."""
        if self.fsync.mode is FsyncMode.ALWAYS or self._failed is not None:
            return False
        deadline = self.fsync_deadline()  # periodic: no fsync may fall due in this round
        return deadline is None or deadline > time.monotonic()

    @property
    def fd(self) -> int | None:
        return self._fd

    def synced_with_others(self) -> None:
        """A sync of many files at once (`fileio.sync_files`) covered this one."""
        if self._fd is not None and self._unsynced:
            self.fsyncs += 1
        self._unsynced = False
        self._last_fsync = time.monotonic()

    def _fsync(self) -> None:
        if self._fd is not None and self._unsynced:
            started = time.monotonic()
            fileio.fsync(self._fd)
            self.fsyncs += 1
            self.observe_fsync(time.monotonic() - started)
        self._unsynced = False
        self._last_fsync = time.monotonic()


class SegmentFile(SyncedFile):
    """One queue's active segment, writer side (see SyncedFile)."""

    __slots__ = ("_last_number", "_number", "incarnation")

    def __init__(
        self,
        directory: Path,
        queue: str,
        fsync: FsyncPolicy,
        last_number: int,
        observe_fsync: Callable[[float], None],
    ) -> None:
        super().__init__(directory, queue, fsync, observe_fsync)
        self._number = 0
        self._last_number = last_number
        #: the queue's incarnation, named in the head of every segment it opens (0: none)
        self.incarnation = 0

    def write(self, chunks: Sequence[Chunk], *, sync: bool = True) -> WriteResult:
        """Write the chunks, then sync as the policy says. Nothing is returned as
        written unless the fsync policy's syncs for it succeeded. `sync=False`: the
        caller syncs this file (and its directory) with others at once, and drops the
        result if that fails (`Writer.write_round_now`)."""
        if self._failed is not None:
            # Chunks planned before the failure was known: writing them and fsyncing again
            # would "succeed" (Linux reports a write-back error once), acknowledging data
            # behind pages the kernel may have dropped.
            return WriteResult([], self._failed)
        done: list[Written] = []
        created_any = False
        error: BaseException | None = None
        never = self.fsync.mode is FsyncMode.NEVER
        for chunk in chunks:
            if (chunk.rotate or self._fd is None) and self._fd is not None:
                # The segment being left holds batches of this round: sync it first.
                try:
                    if not never:
                        self._fsync()
                except OSError as exc:
                    return WriteResult([], self.set_failed(f"fsync failed: {exc}"))
                fileio.close(self._fd)
                self._fd = None
            created = False
            try:
                prefix = b""
                if self._fd is None:
                    prefix = self._open_segment()
                    created = created_any = True
                assert self._fd is not None
                offset = self._size + len(prefix)
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
            self._size += written
            self._unsynced = True
            done.append(
                Written(self._number, created, offset, self._size, chunk.count,
                        chunk.first_id, chunk.last_id,
                        os.fstat(self._fd).st_ino if created else 0)
            )
        if not sync:
            return WriteResult(done, error)
        try:
            self._sync_by_policy()
            if created_any and not never:
                fsync_dir(self.directory)
        except OSError as exc:
            # After a failed fsync the page cache may have dropped our pages: the
            # files can no longer be trusted for writes (reads of the past still work).
            return WriteResult([], self.set_failed(f"fsync failed: {exc}"))
        return WriteResult(done, error)

    def can_write_inline(self, chunks: Sequence[Chunk]) -> bool:
        """True when writing `chunks` needs no fsync and opens no file."""
        if self._fd is None or any(c.rotate for c in chunks):
            return False
        return self._inline_ok()

    def _open_segment(self) -> bytes:
        """Create the next segment file; returns the bytes it must start with."""
        number = max(int(time.time() * 1000), self._last_number + 1)
        path = self.directory / jf.segment_name(self.queue, number)
        fd = fileio.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fd, self._number, self._size = fd, number, 0
        self._last_number = number
        return jf.segment_head(self.incarnation)

    def _write_failed(self, exc: OSError, created: bool) -> BaseException:
        """Trim a partial write so the file ends on a batch again, or give up writing."""
        self.write_errors += 1

        def trim() -> None:
            fd = self._fd
            if fd is not None:
                if created:
                    fileio.close(fd)
                    self._fd = None
                    fileio.unlink(self.directory / jf.segment_name(self.queue, self._number))
                else:
                    fileio.ftruncate(fd, self._size)

        return self._trimmed(exc, trim)


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


class ReaderFile(SyncedFile):
    """One reader's checkpoint file `q.read.<name>`, writer side (see SyncedFile).

    Between checkpoints (rewrites) confirms and error counts are appended as checked
    batches, synced by the queue's fsync policy in the same round as its puts. A rewrite
    replaces the file and covers every append planned before it: the appends that went
    to the old file need no sync of their own. A file that is missing when an append
    comes is created empty first if `create_missing` (a reader that has no file yet reads
    as head 0, as recovery reads a missing one), else the append fails.
    """

    __slots__ = ("create_missing", "path", "reader")

    def __init__(
        self,
        directory: Path,
        queue: str,
        reader: str,
        fsync: FsyncPolicy,
        observe_fsync: Callable[[float], None],
    ) -> None:
        super().__init__(directory, queue, fsync, observe_fsync)
        self.reader = reader
        self.path = directory / jf.checkpoint_name(queue, reader)
        self.create_missing = False

    def describe(self) -> str:
        return f"queue {self.queue!r} reader {self.reader!r}"

    def write(self, ops: Sequence[ReaderOp]) -> None:
        """Carry out `ops` in order, then sync the appends as the policy says; sets
        `failed` on every op that is not durable. One that fails stops the rest."""
        covered = 0  # ops before this index are durable whatever the last sync does
        for i, op in enumerate(ops):
            try:
                if op.remove:
                    self._remove()
                    covered = i + 1
                elif op.rewrite is not None:
                    self._rewrite(op.rewrite)
                    covered = i + 1
                elif self._failed is not None:
                    raise self._failed
                else:
                    self._append(op)
            except (OSError, JournalWriteError) as exc:
                error = exc if isinstance(exc, JournalWriteError) else self._op_failed(exc, op)
                for rest in ops[i:]:
                    rest.failed = error
                ops = ops[:i]
                break
        try:
            self._sync_by_policy()
        except OSError as exc:
            error = self.set_failed(f"fsync failed: {exc}")
            for op in ops[covered:]:
                op.failed = error

    def can_write_inline(self, ops: Sequence[ReaderOp]) -> bool:
        """True when `ops` are appends to the open file that need no fsync now."""
        return self._fd is not None and all(op.appends for op in ops) and self._inline_ok()

    def _append(self, op: ReaderOp) -> None:
        if self._fd is None:
            self._open()
            assert self._fd is not None
        records = jf.encode_reader_records(op.head, op.done, op.errors, op.delays)
        _writev_all(self._fd, [records, jf.encode_check(records, self._size)])
        self._size += len(records) + jf.CHECK_RECORD_SIZE
        self._unsynced = True

    def _open(self) -> None:
        try:
            fd = fileio.open_fd(self.path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            if not self.create_missing:  # not durable yet (its first checkpoint failed)
                raise JournalWriteError(
                    f"{self.describe()}: {self.path.name} is missing") from None
            write_file_atomic(self.path, jf.encode_checkpoint(0, ()))
            fd = fileio.open_fd(self.path, os.O_WRONLY | os.O_APPEND)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._unsynced = False

    def _drop_fd(self) -> None:
        """Forget the open file: it was replaced or removed, so what it holds unsynced
        is covered or moot."""
        fd, self._fd = self._fd, None
        self._unsynced = False
        if fd is not None:
            fileio.close(fd)

    def _rewrite(self, content: bytes) -> None:
        tmp = self.path.with_name(jf.temp_name(self.path.name))
        try:
            write_temp(self.path, content)
            fileio.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                fileio.unlink(tmp, missing_ok=True)
            raise
        self._drop_fd()
        try:
            fsync_dir(self.directory)
        except OSError as exc:
            raise self.set_failed(f"directory fsync failed: {exc}") from exc

    def _remove(self) -> None:
        self._drop_fd()
        fileio.unlink(self.path, missing_ok=True)
        fsync_dir(self.directory)

    def _op_failed(self, exc: OSError, op: ReaderOp) -> BaseException:
        """An append's partial batch is trimmed off (else writes end); a failed rewrite or
        removal leaves the file as it was and is reported, not fatal."""
        self.write_errors += 1
        if not op.appends:
            what = "removing" if op.remove else "writing"
            error = JournalWriteError(f"{self.describe()}: {what} {self.path.name} failed: {exc}")
            error.__cause__ = exc  # (callers name the OS error alone: see write_checkpoints)
            return error
        def trim() -> None:
            if self._fd is not None:
                fileio.ftruncate(self._fd, self._size)

        return self._trimmed(exc, trim)


def run_round(
    work: Sequence[tuple[SegmentFile, Sequence[Chunk]]], periodic: Sequence[SyncedFile],
    pool: ThreadPoolExecutor | None = None,
    readers: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]] = (),
) -> list[WriteResult]:
    """The round itself (synchronous): write every queue's chunks and every reader's
    ops, then the periodic fsyncs that fell due in files with nothing to write. With a
    `pool`, several files are written and synced at once (their fsyncs share the file
    system's journal commits: 100 files' fsyncs took 4 ms instead of 11 ms, measured);
    a file is only ever touched by one thread. Reader ops report on themselves."""
    if readers:
        jobs: list[Callable[[], WriteResult | None]] = [
            *(functools.partial(file.write, chunks) for file, chunks in work),
            *(functools.partial(rfile.write, ops) for rfile, ops in readers)]
        if pool is not None and len(jobs) > 1:
            outs = list(pool.map(_call, jobs))
        else:
            outs = [job() for job in jobs]
        results = cast(list[WriteResult], outs[: len(work)])
    elif pool is not None and len(work) > 1:
        results = list(pool.map(_write_one, work))
    else:
        results = [file.write(chunks) for file, chunks in work]
    for file in periodic:
        file.periodic_fsync()
    return results


def _write_one(entry: tuple[SegmentFile, Sequence[Chunk]]) -> WriteResult:
    return entry[0].write(entry[1])


def _call(job: Callable[[], T]) -> T:
    return job()


@dataclass(frozen=True, slots=True)
class WriterStats:
    rounds: int
    fsync: HistogramSnapshot  # seconds per fsync (journal files; not directories)


class RoundThread:
    """One OS thread that runs the writer's rounds, started on first use.

    A hand-off costs about 25 us here (a queue there, an eventfd back) against 75-95 us
    for `trio.to_thread.run_sync` (measured on the benchmark machine), and a round under
    fsync always is mostly hand-off and fsync. One job at a time (the writer's lock);
    a job is never abandoned: the caller waits for it shielded, as a round must end.
    Where there is no eventfd (not Linux) it falls back to `trio.to_thread`.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._done_fd = -1
        self._result: tuple[Any, BaseException | None] = (None, None)
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not hasattr(os, "eventfd"):  # pragma: no cover (Linux has it)
            return await trio.to_thread.run_sync(fn, *args)
        if self._thread is None:
            self._done_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._thread = threading.Thread(target=self._work, name="queued-writer",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((fn, args))
        with trio.CancelScope(shield=True):
            while True:
                try:
                    os.eventfd_read(self._done_fd)
                    break
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self._done_fd)
        value, error = self._result
        self._result = (None, None)
        if error is not None:
            raise error
        return cast(T, value)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                self._result = (fn(*args), None)
            except BaseException as exc:  # handed to the caller, raised there
                self._result = (None, exc)
            del job, fn, args  # not kept until the next round: they hold its files and tickets
            os.eventfd_write(self._done_fd, 1)

    def close(self) -> None:
        """Stop the thread (after the job it runs, if any) and close the eventfd."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            os.close(self._done_fd)
            self._done_fd = -1


class Writer:
    """The rounds of one data directory; see the module docstring."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = trio.Lock()
        self._rounds = 0
        self._fsync = Histogram(FSYNC_BUCKETS)
        self._fsync_lock = threading.Lock()  # files sync from the pool's threads at once
        self._thread = RoundThread()
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the round threads (no round may run: call it after the last one)."""
        self._thread.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def segment_file(self, queue: str, fsync: FsyncPolicy, last_number: int) -> SegmentFile:
        """The writer side of queue `queue`, whose newest segment number is `last_number`."""
        return SegmentFile(self.directory, queue, fsync, last_number, self._observe_fsync)

    def reader_file(self, queue: str, reader: str, fsync: FsyncPolicy) -> ReaderFile:
        """The writer side of reader `reader`'s checkpoint file of queue `queue`."""
        return ReaderFile(self.directory, queue, reader, fsync, self._observe_fsync)

    def _observe_fsync(self, seconds: float) -> None:
        with self._fsync_lock:
            self._fsync.observe(seconds)

    async def write_round(
        self, work: Sequence[tuple[SegmentFile, Sequence[Chunk]]],
        periodic: Sequence[SyncedFile] = (),
        readers: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]] = (),
    ) -> list[WriteResult]:
        """One round: each file's chunks written with one writev and one fsync, each
        reader file's ops carried out (appends: one writev and one fsync), then the due
        periodic fsyncs of `periodic`. Returns one result per `work` entry."""
        async with self._lock:
            if not periodic and all(f.can_write_inline(chunks) for f, chunks in work) and (
                sum(c.nbytes for _, chunks in work for c in chunks) <= INLINE_ROUND_BYTES
            ) and all(rf.can_write_inline(ops) for rf, ops in readers):
                # A small round that needs no fsync and opens no file: a write()
                # into the page cache is cheaper than a hand-off to a thread.
                results = run_round(work, periodic, None, readers)
            else:
                if len(work) + len(readers) > 1 and self._pool is None:
                    self._pool = ThreadPoolExecutor(ROUND_THREADS, "queued-writer")
                results = await self._thread.run(run_round, work, periodic, self._pool, readers)
        self._rounds += 1
        return results

    def write_round_now(
        self, work: Sequence[tuple[SegmentFile, Sequence[Chunk]]],
        readers: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]] = (),
    ) -> list[WriteResult]:
        """A whole round (writes and the fsync policy's syncs) here and now, on the
        caller's thread; not while a round or pause is under way (`busy`). For a
        caller that answers only once the round is done anyway (the reactor's pass): a
        hand-off to the round thread would only add its cost. Several files are synced
        at once by the pool (their fsyncs share the file system's journal commits)."""
        assert not self._lock.locked(), "a round or pause is under way"
        pool = None
        if len(work) + len(readers) > 1 and any(
                f.fsync.mode is FsyncMode.ALWAYS for f in (*(f for f, _ in work),
                                                            *(r for r, _ in readers))):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(ROUND_THREADS, "queued-writer")
            pool = self._pool
        self._rounds += 1
        together = [f for f, _ in work if f.fsync.mode is FsyncMode.ALWAYS]
        if len(together) < SYNC_TOGETHER:
            return run_round(work, (), pool, readers)
        # Many segment files to sync: write them all, then one durable point for them
        # (syncfs: one journal commit) rather than an fsync each.
        results = [file.write(chunks, sync=file.fsync.mode is not FsyncMode.ALWAYS)
                   for file, chunks in work]
        if readers:
            run_round([], (), pool, readers)
        started = time.monotonic()
        try:
            fileio.sync_files([fd for f in together if (fd := f.fd) is not None],
                              self.directory)
        except OSError as exc:
            failed = {id(f): f.set_failed(f"syncfs failed: {exc}") for f in together}
            return [WriteResult([], failed[id(f)]) if id(f) in failed else r
                    for (f, _), r in zip(work, results, strict=True)]
        self._observe_fsync(time.monotonic() - started)
        for f in together:
            f.synced_with_others()
        return results

    async def wait_idle(self) -> None:
        """Until the round or pause under way (if any) is over."""
        async with self._lock:
            pass

    @property
    def busy(self) -> bool:
        """A round or a pause is under way."""
        return self._lock.locked()

    def write_now(
        self, file: SegmentFile, chunks: Sequence[Chunk],
        readers: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]] = (),
    ) -> WriteResult | None:
        """Write `chunks` (and the reader files' `readers` appends) here and now if that
        needs no fsync, opens no file, is small and no round or pause is under way; None
        (nothing done) otherwise. The caller makes sure no earlier chunk of `file` or op
        of those readers waits for a round."""
        if (self._lock.locked() or sum(c.nbytes for c in chunks) > INLINE_ROUND_BYTES
                or (chunks and not file.can_write_inline(chunks))
                or (readers and not all(rf.can_write_inline(ops) for rf, ops in readers))):
            return None
        self._rounds += 1
        for rfile, ops in readers:
            rfile.write(ops)
        return file.write(chunks) if chunks else WriteResult([])

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No round runs inside this block (to remove a queue's files, say)."""
        async with self._lock:
            yield

    def statistics(self) -> WriterStats:
        return WriterStats(rounds=self._rounds, fsync=self._fsync.snapshot())


def _writev_all(fd: int, pieces: list[bytes | bytearray]) -> None:
    """Write every piece, in order, with as few syscalls as writev allows."""
    i = 0
    while i < len(pieces):
        batch = pieces[i : i + IOV_MAX]
        n = fileio.writev(fd, batch)
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
                view = view[fileio.write(fd, view):]
            i += 1
            break
