"""The writer's files: every queue's open segment file and every reader's checkpoint file,
writer side, each with its fsync policy's bookkeeping.

Owns the file handles and their state (fd, size, unsynced bytes, last fsync, failure):
a chunk written as one checked batch, a reader's ops carried out, and the syncs the
queue's fsync policy asks for. Never reports a chunk written unless the fsync policy's
syncs covering it succeeded; after a failed fsync (or a write error it cannot trim
away) that file refuses writes for good. Which files a round writes, and on which
thread, is the writer's (queued.storage.writer); one round touches a file at a time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from queued.config.policies import FsyncMode, FsyncPolicy
from queued.errors import JournalWriteError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage.files import fsync_dir, write_file_atomic, write_temp
from queued.storage.intent_log import Intent
from queued.storage.write_plans import Chunk, ReaderOp, WriteResult, Written

#: (a C static compiled, rather than a look-up in the module's globals at each use)
crc32: Final = zlib.crc32
# Failures are the queue's journal failing, as operators know it: log under its name.
log = logging.getLogger("queued.journal")

#: write() errors after which the file can be trimmed back and appends retried later.
RECOVERABLE_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: Most iovecs one writev takes (IOV_MAX on Linux).
IOV_MAX: Final = 1024
#: The fsync modes, looked up once. Compiled code reading `FsyncMode.ALWAYS` takes a
#: slow attribute look-up on every use (the enum is an interpreted module's, and Python
#: 3.11's EnumType has a `__getattr__` hook); a Final name here is a C static.
ALWAYS: Final = FsyncMode.ALWAYS
NEVER: Final = FsyncMode.NEVER
PERIODIC: Final = FsyncMode.PERIODIC


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
        self.fsync = fsync  # (compiled, as config/policies.py is: its mode is a field read)
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

    def sync_now(self) -> None:
        """fsync what this file has unsynced now, whatever its policy (for a file about to
        be stood for by another: a snapshot of what it holds)."""
        self._fsync()

    def fsync_deadline(self) -> float | None:
        """When a periodic fsync falls due (time.monotonic()), if one is owed."""
        if self.fsync.mode is PERIODIC and self._unsynced and not self._failed:
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
        mode = self.fsync.mode
        if mode is ALWAYS:
            self._fsync()
        elif mode is PERIODIC:
            self.fsync_if_due()

    def _inline_ok(self) -> bool:
        """True when a write now needs no fsync (the file being open is the caller's)."""
        if self.fsync.mode is ALWAYS or self._failed is not None:
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

    __slots__ = ("_last_number", "_name", "_number", "incarnation")

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
        self._name = b""  # the open segment's file name, as the intent log names it
        self._last_number = last_number
        #: the queue's incarnation, named in the head of every segment it opens (0: none)
        self.incarnation = 0

    def write(self, chunks: Sequence[Chunk], *, sync: bool = True,
              intents: list[Intent] | None = None) -> WriteResult:
        """Write the chunks, then sync as the policy says. Nothing is returned as
        written unless the fsync policy's syncs for it succeeded. `sync=False`: the
        caller syncs this file (and its directory) with others at once, and drops the
        result if that fails (`Writer.write_round_now`); `intents`: the bytes each
        write put where are added to it, for the caller's intent log to stand for them
        (queued.storage.intent_log)."""
        if self._failed is not None:
            # Chunks planned before the failure was known: writing them and fsyncing again
            # would "succeed" (Linux reports a write-back error once), acknowledging data
            # behind pages the kernel may have dropped.
            return WriteResult([], self._failed)
        done: list[Written] = []
        created_any = False
        error: BaseException | None = None
        never = self.fsync.mode is NEVER
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
                    crc = crc32(piece, crc)
                check = jf.encode_check_crc(chunk.nbytes, crc)
                written = len(prefix) + chunk.nbytes + len(check)
                buffers = [prefix, *pieces, check] if prefix else [*pieces, check]
                _writev_all(self._fd, buffers, written)
            except OSError as exc:
                error = self._write_failed(exc, created)
                break
            if intents is not None:
                intents.append((self._name, self._size, buffers))
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
        name = jf.segment_name(self.queue, number)
        fd = fileio.open_fd(self.directory / name,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fd, self._number, self._size, self._name = fd, number, 0, name.encode()
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
        # (through a local: mypy would hold `self._fd` None after `_open`, and compiled
        # code checks what it reads against that)
        fd = self._fd if self._fd is not None else self._open()
        records = jf.encode_reader_records(op.head, op.done, op.errors, op.delays)
        _writev_all(fd, [records, jf.encode_check(records, self._size)])
        self._size += len(records) + jf.CHECK_RECORD_SIZE
        self._unsynced = True

    def _open(self) -> int:
        """Open the file for appends (created empty if missing and `create_missing`);
        returns its fd."""
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
        return fd

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


def _writev_all(fd: int, pieces: list[bytes | bytearray], total: int = -1) -> None:
    """Write every piece, in order, with as few syscalls as writev allows. `total`:
    their length when the caller knows it (-1: summed here)."""
    if len(pieces) <= IOV_MAX:  # (a round's batch: one call, no slice)
        n = fileio.writev(fd, pieces)
        if n != (total if total >= 0 else sum([len(p) for p in pieces])):
            _write_rest(fd, pieces, n)
        return
    for i in range(0, len(pieces), IOV_MAX):
        batch = pieces[i : i + IOV_MAX]
        n = fileio.writev(fd, batch)
        if n != sum([len(p) for p in batch]):
            _write_rest(fd, batch, n)


def _write_rest(fd: int, batch: list[bytes | bytearray], n: int) -> None:
    """After a short writev of `batch` that wrote `n` bytes: the rest of it."""
    for p in batch:
        if n >= len(p):
            n -= len(p)
            continue
        view = memoryview(p)[n:]
        n = 0
        while view:
            # (the call outside the slice: compiled, a slice bound is evaluated twice,
            # docs/development.md "Compiled with mypyc")
            wrote = fileio.write(fd, view)
            view = view[wrote:]
