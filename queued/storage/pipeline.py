"""The pipelined commit: a pass's appends under fsync "always" made durable by a sync on
a thread of its own, while the event loop goes on with the next passes.

A pass writes its batches at once (into the page cache), as before; what makes them
durable (an fsync of each file it appended to, or the intent log's one fdatasync for
many files, else syncfs) runs on the sync thread, and the thread wakes the caller
(`notify`) when it is done. The passes written while a sync runs wait for it and then
share the next one (group commit: one sync for all of them); syncs run one at a time,
in order, so a pass is durable only once every pass before it is. Each pass gets the
number of the sync (`SyncGroup.seq`) its replies must wait for; `done` is the last one
ended. What a sync covers is noted on the files and journals (`finish`) on the caller's
thread, never on the sync thread, which touches nothing but the fds and the intent log
(which has a lock of its own).

Only appends to open files go this way; a pass that opens, rotates, replaces or removes
a file waits for the syncs under way and commits on its own (the data directory's
`commit_now`). While a sync is under way or waits to start, the pipeline holds the
writer's round lock (taken without waiting, let go when the last sync ends), so no
round, pause, parking or deletion touches the files meanwhile.

A failed sync fails every file it covered (they refuse writes from then on, as after
any failed fsync), and with them every later pass's appends to those files, whatever
their own sync says (Linux reports a write-back error once).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from queued.config.policies import FsyncMode
from queued.storage import fileio
from queued.storage.intent_log import PASS_BYTES, Intent, IntentLog
from queued.storage.journal import Planned, QueueJournal, ReaderWork
from queued.storage.synced_files import ReaderFile, SegmentFile, SyncedFile
from queued.storage.write_plans import Chunk, ReaderOp, WriteResult

log = logging.getLogger("queued.journal")

ALWAYS: Final = FsyncMode.ALWAYS
#: Segment files of one sync from which it is made one durable point (the intent log,
#: else syncfs) rather than an fsync of each.
SYNC_TOGETHER: Final = 4

#: One pass's part of a sync: its journals' chunks with their results, and its reader
#: file ops (finished in this order once the sync ends).
PassWork = tuple[list[tuple[QueueJournal, list[Planned]]], list[WriteResult],
                 list[tuple[QueueJournal, ReaderWork]]]


class SyncGroup:
    """The passes one sync covers, and what it must sync."""

    __slots__ = ("failed", "files", "intents", "nbytes", "passes", "segments", "seq")

    def __init__(self, seq: int, logged: bool) -> None:
        self.seq = seq
        self.passes: list[PassWork] = []
        #: the files appended to (segments first seen first), and the segment files
        self.files: dict[SyncedFile, None] = {}
        self.segments: list[SegmentFile] = []
        #: the segments' bytes, for the intent log (None: it is not used)
        self.intents: list[Intent] | None = [] if logged else None
        self.nbytes = 0
        #: after the sync: the files it could not make durable, and why
        self.failed: dict[SyncedFile, str] = {}


class SyncThread:
    """One OS thread that runs the syncs, one at a time, and calls `notify` after each
    (from the thread: an eventfd write, say). Started on first use."""

    def __init__(self, notify: Callable[[], None]) -> None:
        self.notify = notify
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._ended: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="queued-sync",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def ended(self) -> bool:
        """The job started last has ended (taken: true once per job)."""
        try:
            self._ended.get_nowait()
        except queue.Empty:
            return False
        return True

    def wait(self) -> None:
        """Until the job started last has ended (blocking)."""
        self._ended.get()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()  # (never raises: a job notes its own failures)
            del job
            self._ended.put(1)
            self.notify()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


class Pipeline:
    """A data directory's pipelined commit; see the module docstring. Called from one
    thread (the event loop's) but for the job it hands the sync thread."""

    def __init__(self, directory: Path, intents: IntentLog,
                 observe_fsync: Callable[[float], None]) -> None:
        self.directory = directory
        self.intents = intents
        self.observe_fsync = observe_fsync
        self.notify: Callable[[], None] = lambda: None
        self.thread = SyncThread(self._notify)
        self.running: SyncGroup | None = None  # its sync is under way
        self.waiting: SyncGroup | None = None  # written, its sync starts after running's
        self.last = 0  # the seq of the newest group
        self.done = 0  # the seq of the newest group ended
        self.syncs = 0  # syncs run (a sync covers every pass of its group)
        self.passes = 0  # passes that went this way

    def _notify(self) -> None:
        self.notify()

    @property
    def busy(self) -> bool:
        """A sync is under way or waits to start (the writer's lock is the pipeline's)."""
        return self.running is not None

    @property
    def latest(self) -> int:
        """The seq a pass that wrote nothing to sync waits for: the newest group's."""
        return self.last

    def can_take(self, files: Sequence[tuple[SegmentFile, Sequence[Chunk]]],
                 reader_ops: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]]) -> bool:
        """Whether a pass of these writes can go this way: every file under "always",
        or that a sync under way or waiting covers (its policy may have changed since),
        is appended to as it is open (anything else waits for the syncs and commits
        alone)."""
        running, waiting = self.running, self.waiting
        for f, chunks in files:
            if (f.fsync.mode is ALWAYS or (running is not None and f in running.files)
                    or (waiting is not None and f in waiting.files)) and (
                    not f.can_append(chunks)):
                return False
        for rf, ops in reader_ops:
            if (rf.fsync.mode is ALWAYS or (running is not None and rf in running.files)
                    or (waiting is not None and rf in waiting.files)) and (
                    not rf.can_append(ops)):
                return False
        return True

    def write(self, work: list[tuple[QueueJournal, list[Planned]]],
              files: Sequence[tuple[SegmentFile, Sequence[Chunk]]],
              readers: list[tuple[QueueJournal, ReaderWork]],
              reader_ops: Sequence[tuple[ReaderFile, Sequence[ReaderOp]]]) -> int:
        """Write a pass (`can_take` said so; the caller holds the writer's lock for the
        pipeline when nothing is under way): files under "always" with no sync, the others
        by their policy. The seq of the group it joined; 0 if it has nothing to sync
        (then the caller finishes it, with `results`... see DataDir.commit_pass)."""
        group = self.waiting
        if group is None:
            self.last += 1
            group = self.waiting = SyncGroup(self.last, self.intents.usable)
        results: list[WriteResult] = []
        gfiles = group.files
        for f, chunks in files:
            if f.fsync.mode is ALWAYS and f.failed is None:
                for c in chunks:
                    group.nbytes += c.nbytes
                results.append(f.write(chunks, sync=False, intents=group.intents))
                if f not in gfiles:
                    gfiles[f] = None
                    group.segments.append(f)
            else:
                results.append(f.write(chunks))
        for rf, ops in reader_ops:
            if rf.fsync.mode is ALWAYS and rf.failed is None:
                rf.write(ops, sync=False)
                gfiles[rf] = None
            else:
                rf.write(ops)
        group.passes.append((work, results, readers))
        self.passes += 1
        if self.running is None:
            self._start()
        return group.seq

    def _start(self) -> None:
        group = self.waiting
        assert group is not None and self.running is None
        self.waiting = None
        self.running = group
        # (the fds read here: the thread touches no file's state)
        segments = [(f, f.fd) for f in group.segments]
        others: list[tuple[SyncedFile, int | None]] = [
            (f, f.fd) for f in group.files if not isinstance(f, SegmentFile)]
        intents = group.intents
        if (intents is None or len(segments) < SYNC_TOGETHER or group.nbytes > PASS_BYTES):
            intents = None

        def job() -> None:
            started = time.monotonic()
            failed = group.failed
            try:
                if len(segments) >= SYNC_TOGETHER:
                    logged = False
                    if intents is not None:
                        try:
                            self.intents.append(intents)
                            logged = True
                        except OSError:
                            pass  # (the log said why): the files are synced instead
                    if not logged:
                        try:
                            fileio.sync_files([fd for _, fd in segments if fd is not None],
                                              self.directory)
                        except OSError as exc:
                            for seg, _ in segments:
                                failed[seg] = f"the pass's sync failed: {exc}"
                else:
                    others.extend(segments)
                for file, fd in others:
                    if fd is None:
                        continue
                    try:
                        fileio.fsync(fd)
                    except OSError as exc:
                        failed[file] = f"fsync failed: {exc}"
            except Exception as exc:  # pragma: no cover (a bug: fail it all, loudly)
                log.exception("the pipeline's sync failed")
                for file in group.files:
                    failed[file] = f"the sync failed: {exc!r}"
            self.observe_fsync(time.monotonic() - started)

        self.syncs += 1
        self.thread.start(job)

    def poll(self) -> SyncGroup | None:
        """The running group, if its sync has ended (the next one is started)."""
        if self.running is None or not self.thread.ended():
            return None
        return self._ended()

    def wait(self) -> SyncGroup | None:
        """The running group once its sync ends (blocking); None if none runs."""
        if self.running is None:
            return None
        self.thread.wait()
        return self._ended()

    def _ended(self) -> SyncGroup:
        group = self.running
        assert group is not None
        self.running = None
        after = self.waiting
        for f in group.files:
            why = group.failed.get(f)
            if why is not None:
                if f.failed is None:
                    f.set_failed(why)
            elif after is None or f not in after.files:
                f.synced_with_others()  # (one the next group appended to stays unsynced)
        if after is not None:
            self._start()
        self.done = group.seq
        return group

    @staticmethod
    def results_of(group: SyncGroup, work: PassWork) -> PassWork:
        """A pass's results as its group's sync leaves them: an append to a file that
        failed (in this sync or an earlier one) failed, whatever its write said."""
        journals, results, readers = work
        if group.failed or any(f.failed is not None for f in group.files):
            results = [r if j.file.failed is None or not r.written else
                       WriteResult([], j.file.failed)
                       for (j, _), r in zip(journals, results, strict=True)]
            for _, ops in readers:
                for rf, rops in ops:
                    if rf.failed is not None:
                        for op in rops:
                            if op.failed is None:
                                op.failed = rf.failed
        return journals, results, readers

    def close(self) -> None:
        self.thread.close()
