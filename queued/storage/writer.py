"""The writer: the write + fsync rounds (group commit) of a data directory.

Owns one round: for each queue with planned chunks one writev and one fsync, every
reader file's ops, and the periodic fsyncs that fell due; where it runs (inline on the
event loop for a small round that needs no fsync and opens no file, else in the round
thread, several files at once on a small pool, or on the caller's thread with one sync
for many files); one round at a time. The files themselves (fds, the fsync policy's
bookkeeping, failures) are queued.storage.synced_files'; the hand-off to the round
thread is queued.storage.round_thread's; what to write is planned by the journal
(queued.storage.write_plans). Knows nothing of tickets, readers or ids beyond what a
chunk carries.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar, cast

import trio

from queued.config.policies import FsyncPolicy
from queued.stats import FSYNC_BUCKETS, Histogram, HistogramSnapshot
from queued.storage import fileio
from queued.storage.intent_log import PASS_BYTES, Intent, IntentLog
from queued.storage.round_thread import RoundThread
from queued.storage.synced_files import ALWAYS, ReaderFile, SegmentFile, SyncedFile
from queued.storage.write_plans import (
    ZERO_COPY_BYTES,
    Chunk,
    ReaderOp,
    WriteResult,
    Written,
)

# The writer's parts, importable from here as before the split.
__all__ = ["INLINE_ROUND_BYTES", "ROUND_THREADS", "SYNC_TOGETHER", "ZERO_COPY_BYTES", "Chunk",
           "ReaderFile", "ReaderOp", "RoundThread", "SegmentFile", "SyncedFile", "WriteResult",
           "Writer", "WriterStats", "Written", "run_round"]

T = TypeVar("T")
#: Threads that write and sync several queues' files of one round at once.
ROUND_THREADS = 8
#: A round this small, without fsync or new files, runs on the event loop itself.
INLINE_ROUND_BYTES = 256 * 1024
#: Segment files a round on the caller's thread syncs together (`fileio.sync_files`)
#: rather than one fsync each, from this many on.
SYNC_TOGETHER: Final = 4
#: ... and a pass of fewer files whose bytes under `always` are at most this many goes
#: through the intent log too: its fdatasync over zeros costs about half the time and
#: CPU of an appended segment's fsync (`bench/fsync_forms.py`: 104 against 205 us for
#: 4 KB, 115 against 215 for 32 KB), more than the log's second copy of so few bytes
#: (docs/benchmarks.md, "The intent log for small passes").
LOG_SMALL_PASS: Final = 32 * 1024


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


#: The signature of `run_round` (`Writer.run_round` holds it).
RoundFunction = Callable[
    [Sequence[tuple[SegmentFile, Sequence[Chunk]]], Sequence[SyncedFile],
     ThreadPoolExecutor | None, Sequence[tuple[ReaderFile, Sequence[ReaderOp]]]],
    list[WriteResult]]


def _created(results: list[WriteResult]) -> bool:
    """Whether a write of `results` made a segment file (loops: compiled, a nested
    generator in `any` costs some 1,000 instructions a pass)."""
    for r in results:
        for w in r.written:
            if w.created:
                return True
    return False


def _write_one(entry: tuple[SegmentFile, Sequence[Chunk]]) -> WriteResult:
    return entry[0].write(entry[1])


def _call(job: Callable[[], T]) -> T:
    return job()


class RoundLock:
    """The lock rounds and pauses hold, with a field that says so: a compiled caller
    reads `held` from the object's struct, where `trio.Lock.locked()` is a call into an
    interpreted method at every pass (~670 instructions, callgrind)."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self.held = False

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        self.held = True

    async def __aexit__(self, *exc_info: object) -> None:
        self.held = False
        self._lock.release()

    def statistics(self) -> trio.LockStatistics:
        """trio's statistics of the lock (who holds it, how many tasks wait)."""
        return self._lock.statistics()


@dataclass(frozen=True, slots=True)
class WriterStats:
    rounds: int
    fsync: HistogramSnapshot  # seconds per fsync (journal files; not directories)


class Writer:
    """The rounds of one data directory; see the module docstring."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = RoundLock()
        self._rounds = 0
        self._fsync = Histogram(FSYNC_BUCKETS)
        self._fsync_lock = threading.Lock()  # files sync from the pool's threads at once
        self._round_thread = RoundThread()
        self._pool: ThreadPoolExecutor | None = None
        #: the one durable point of a pass that wrote many segment files, or few bytes
        self.intents = IntentLog(directory)
        #: the round itself (`run_round`), called through this attribute: the seam a test
        #: replaces on the instance to hold a round (a compiled module calls its own
        #: functions directly, past a replacement of the module's global)
        self.run_round: RoundFunction = run_round

    def close(self) -> None:
        """Stop the round threads (no round may run: call it after the last one) and let
        go of the intent log's file (as it is: `IntentLog.close` settles it first)."""
        self.intents.release()
        self._round_thread.close()
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
                results = self.run_round(work, periodic, None, readers)
            else:
                if len(work) + len(readers) > 1:
                    self._started_pool()
                results = await self._round_thread.run(self.run_round, work, periodic,
                                                       self._pool, readers)
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
        assert not self._lock.held, "a round or pause is under way"
        self._rounds += 1
        one = len(work) + len(readers) < 2
        if one and not (work and work[0][0].fsync.mode is ALWAYS):
            return self.run_round(work, (), None, readers)  # (the usual `never` pass)
        together = [f for f, _ in work if f.fsync.mode is ALWAYS]
        nbytes = 0  # what the log would copy: the bytes of the files synced `always`
        for file, chunks in work:
            if file.fsync.mode is ALWAYS:
                for c in chunks:
                    nbytes += c.nbytes
        # Many segment files to sync, or a small pass: write them all, then one durable
        # point for them rather than an fsync each: the intent log's append (one
        # fdatasync of one file), else (many files) syncfs (every dirty file of the file
        # system written back).
        logged = len(together) >= SYNC_TOGETHER or (
            bool(together) and nbytes <= LOG_SMALL_PASS and self.intents.usable)
        if one and not logged:
            return self.run_round(work, (), None, readers)  # (one file: no pool, no log)
        pool = None
        if together or any(r.fsync.mode is ALWAYS for r, _ in readers):
            pool = self._started_pool()
        if not logged:
            return self.run_round(work, (), pool, readers)
        intents: list[Intent] | None = [] if self.intents.usable else None
        results: list[WriteResult] = []
        for file, chunks in work:
            if file.fsync.mode is ALWAYS:
                results.append(file.write(chunks, sync=False, intents=intents))
            else:
                results.append(file.write(chunks))
        if readers:
            self.run_round([], (), pool, readers)
        started = time.monotonic()
        try:
            if intents is None or nbytes > PASS_BYTES or not self._logged(intents):
                fileio.sync_files([fd for f in together if (fd := f.fd) is not None],
                                  self.directory)
            elif _created(results):
                # A file the pass made: its entry durable too, as after any new file
                # (a later sync of the file alone would not bring it back).
                fileio.fsync_dir(self.directory)
        except OSError as exc:
            failed = {id(f): f.set_failed(f"the pass's sync failed: {exc}") for f in together}
            return [WriteResult([], failed[id(f)]) if id(f) in failed else r
                    for (f, _), r in zip(work, results, strict=True)]
        self._observe_fsync(time.monotonic() - started)
        for f in together:
            f.synced_with_others()
        return results

    def _logged(self, intents: list[Intent]) -> bool:
        """`intents` made durable by the intent log; False (nothing made durable) when
        the log failed: the caller syncs the files instead."""
        if not intents:
            return True
        try:
            self.intents.append(intents)
        except OSError:
            return False  # (the log said why, and whether it takes the next pass)
        return True

    def settle_intents(self) -> None:
        """Before a segment is removed, renamed over or moved: no record of the intent
        log may stand for it (see queued.storage.intent_log). OSError: not settled."""
        self.intents.settle()

    def _started_pool(self) -> ThreadPoolExecutor:
        """The pool that writes and syncs several files at once (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(ROUND_THREADS, "queued-writer")
        return self._pool

    async def wait_idle(self) -> None:
        """Until the round or pause under way (if any) is over."""
        async with self._lock:
            pass

    @property
    def busy(self) -> bool:
        """A round or a pause is under way."""
        return self._lock.held

    def write_now(
        self, file: SegmentFile, chunks: Sequence[Chunk],
        readers: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]] = (),
    ) -> WriteResult | None:
        """Write `chunks` (and the reader files' `readers` appends) here and now if that
        needs no fsync, opens no file, is small and no round or pause is under way; None
        (nothing done) otherwise. The caller makes sure no earlier chunk of `file` or op
        of those readers waits for a round."""
        if (self._lock.held or sum(c.nbytes for c in chunks) > INLINE_ROUND_BYTES
                or (chunks and not file.can_write_inline(chunks))
                or (readers and not all(rf.can_write_inline(ops) for rf, ops in readers))):
            return None
        self._rounds += 1
        for rfile, ops in readers:
            rfile.write(ops)
        return file.write(chunks) if chunks else WriteResult([])

    def paused(self) -> RoundLock:
        """No round runs inside `async with writer.paused()` (to remove a queue's files,
        say): the lock rounds hold. (A lock rather than an async generator, which a
        compiled module cannot hold.)"""
        return self._lock

    def statistics(self) -> WriterStats:
        return WriterStats(rounds=self._rounds, fsync=self._fsync.snapshot())
