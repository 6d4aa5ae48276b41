"""One data directory: recovery of every queue at startup, the writer loop, retiring files.

Owns the directory listing, the recovery report, the loop that hands every
queue with planned appends to the writer (queued.storage.writer) in one round
and the results back, retiring files (delete or archive) and deleting queues.
Never touches a file of another directory except `archive_dir` and its own
quarantine folder.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from queued.config.policies import DataDirConfig, FsyncPolicy, JournalConfig
from queued.errors import (
    CorruptJournalError,
    CorruptRecordError,
    JournalClosedError,
    NotSavedError,
)
from queued.journal import format as jf
from queued.journal.names import PAUSED_FILE
from queued.stats import HistogramSnapshot
from queued.storage import fileio
from queued.storage.files import (
    NO_CHECKPOINT,
    Checkpoint,
    SegmentInfo,
    decode_checkpoint,
    fsync_dir,
    read_dedup,
    read_producers,
    segment_marks,
    write_checkpoint,
    write_file_atomic,
)
from queued.storage.intent_log import INTENT_FILE
from queued.storage.intent_log import replay as replay_intents
from queued.storage.journal import Planned, QueueJournal, ReaderWork
from queued.storage.recovery import Damage, scan_segment
from queued.storage.synced_files import NEVER, SegmentFile
from queued.storage.write_plans import Chunk, ReaderOp
from queued.storage.writer import ReaderFile, Writer, WriteResult

log = logging.getLogger("queued.datadir")

#: The console's chart history (queued.server.history), written at a clean shutdown and
#: removed when read back at start. No "." in it: never a journal file name.
HISTORY_FILE = "queued-history"


@dataclass(slots=True)
class QueueRecovery:
    queue: str
    segments: int = 0
    records: int = 0
    bytes: int = 0
    truncated_bytes: int = 0
    temps_removed: int = 0
    unreadable_checkpoints: list[str] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RecoveryReport:
    queues: dict[str, QueueRecovery] = field(default_factory=dict)
    seconds: float = 0.0
    #: the totals of queues dropped from `queues` since (parked: see DataDir.park_queue),
    #: so the report's figures stay what the start-up recovery found
    forgotten: QueueRecovery = field(default_factory=lambda: QueueRecovery(""))
    #: intent log records written back into their segments before recovery read them
    intents_replayed: int = 0

    def forget(self, name: str) -> None:
        """Drop queue `name`'s entry (its memory), keeping its figures in the totals."""
        rep = self.queues.pop(name, None)
        if rep is not None:
            self.forgotten.records += rep.records
            self.forgotten.bytes += rep.bytes
            self.forgotten.truncated_bytes += rep.truncated_bytes

    @property
    def records(self) -> int:
        return self.forgotten.records + sum(q.records for q in self.queues.values())

    @property
    def bytes(self) -> int:
        return self.forgotten.bytes + sum(q.bytes for q in self.queues.values())

    @property
    def truncated_bytes(self) -> int:
        return self.forgotten.truncated_bytes + sum(
            q.truncated_bytes for q in self.queues.values())

    def summary(self) -> str:
        return (
            f"recovered {len(self.queues)} queues, {self.records} records, {self.bytes} bytes "
            f"in {self.seconds:.3f}s; truncated {self.truncated_bytes} bytes"
            + (f"; {self.intents_replayed} intent log records written back"
               if self.intents_replayed else "")
        )


@dataclass(frozen=True, slots=True)
class DataDirStats:
    path: str
    queues: int
    rounds: int
    fsync: HistogramSnapshot  # seconds per fsync (journal files; not directories)
    recovery_seconds: float
    truncated_bytes: int
    #: the intent log: passes it made durable, times it was settled, records the start-up
    #: wrote back
    intent_appends: int = 0
    intent_settles: int = 0
    intents_replayed: int = 0


class DataDir:
    """All queues of one directory; see the module docstring."""

    def __init__(
        self,
        path: Path,
        config: DataDirConfig,
        queue_config: Callable[[str], JournalConfig],
    ) -> None:
        self.path = path
        self.config = config
        self.queue_config = queue_config
        self.queues: dict[str, QueueJournal] = {}
        self.report = RecoveryReport()
        #: its rounds (a test holds one by replacing the writer's `run_round`)
        self.writer = Writer(path)
        self._dirty: dict[QueueJournal, None] = {}
        self._wake = trio.Event()
        self._closing = False
        self._writer_done = trio.Event()
        self._in_round = False  # the writer took chunks and has not finished them
        #: planned changes wait for `commit_now` (the reactor's pass: one write per file)
        self.deferring = False
        #: when the sleeping writer wakes by itself (-inf while it is awake)
        self._asleep_until = float("-inf")

    # -- opening and recovery -----------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | Path,
        config: DataDirConfig | None = None,
        queue_config: Callable[[str], JournalConfig] | None = None,
    ) -> DataDir:
        """Recover every queue in `path` (synchronous: run it in a thread from trio)."""
        started = time.monotonic()
        dd = cls(Path(path), config or DataDirConfig(), queue_config or (lambda _: JournalConfig()))
        fileio.mkdir(dd.path)
        # Before any segment is read: what the intent log stands for, back in its files.
        dd.report.intents_replayed = replay_intents(dd.path)[0]
        by_queue: dict[str, list[tuple[str, jf.JournalFileName]]] = {}
        for entry in sorted(os.listdir(dd.path)):
            parsed = jf.parse_file_name(entry)
            if parsed is None:
                if entry.startswith((PAUSED_FILE, HISTORY_FILE)) or entry == INTENT_FILE:
                    continue  # (read by `paused_queues`; a temp of it, by its next write)
                if (dd.path / entry).is_file():
                    log.warning("data dir: ignoring %s (not a journal file name)", entry)
                continue
            by_queue.setdefault(parsed.queue, []).append((entry, parsed))
        for name, files in sorted(by_queue.items()):
            dd.queues[name] = dd._recover_queue(name, files)
        dd.report.seconds = time.monotonic() - started
        log.info("data dir %s: %s", dd.path, dd.report.summary())
        return dd

    def _recover_queue(
        self, name: str, entries: list[tuple[str, jf.JournalFileName]], *, report: bool = True
    ) -> QueueJournal:
        rep = QueueRecovery(name)
        if report:
            self.report.queues[name] = rep
        config = self.queue_config(name)
        segments: list[SegmentInfo] = []
        readers: dict[str, Checkpoint] = {}
        for entry, parsed in entries:
            if parsed.role is jf.FileRole.TEMP:
                fileio.unlink(self.path / entry)
                rep.temps_removed += 1
                log.info("recovery: removed leftover temp file %s", entry,
                         extra={"event": "recovery_temp_removed", "file_name": entry})
        files = [parsed for _, parsed in entries]
        quarantine = self.path / self.config.quarantine_dir_name
        numbers = sorted(f.number for f in files if f.role is jf.FileRole.SEGMENT)
        # Only the newest segment can be torn: the writer fsyncs a segment before
        # it rotates away (unless fsync is "never").
        never = config.fsync.mode is NEVER
        for number in numbers:
            path = self.path / jf.segment_name(name, number)
            result = scan_segment(path, number, self.config.corruption, quarantine,
                                  tail_may_tear=never or number == numbers[-1])
            rep.truncated_bytes += result.truncated_bytes
            rep.damage.extend(result.damage)
            if result.quarantined_to is not None:
                rep.quarantined.append(str(result.quarantined_to))
            segments.append(result.segment)
        segments = self._finish_compactions(name, segments)
        prev: SegmentInfo | None = None
        for seg in segments:
            if seg.count and prev is not None and seg.first_id <= prev.last_id:
                raise CorruptJournalError(
                    f"queue {name!r}: segment {seg.path.name} starts at id {seg.first_id}, "
                    f"not after id {prev.last_id} of {prev.path.name}; refusing to start"
                )
            if seg.count:
                prev = seg
        for f in files:
            if f.role is not jf.FileRole.CHECKPOINT:
                continue
            path = self.path / jf.checkpoint_name(name, f.reader)
            try:
                data = path.read_bytes()
                readers[f.reader], end = decode_checkpoint(data)
                if end < len(data):
                    # A crash while a confirm was being appended: it was never acknowledged.
                    # Written anew, so the next append follows a verified batch.
                    log.warning("recovery: checkpoint %s: cut a torn tail of %d bytes at "
                                "offset %d", path.name, len(data) - end, end,
                                extra={"event": "recovery_checkpoint_tail",
                                       "checkpoint": path.name, "offset": end,
                                       "cut_bytes": len(data) - end})
                    rep.truncated_bytes += len(data) - end
                    write_checkpoint(path, readers[f.reader])
            except (CorruptRecordError, OSError) as exc:
                log.error(
                    "recovery: checkpoint %s unreadable (%s): replaying reader %r from the "
                    "oldest segment", path.name, exc, f.reader,
                    extra={"event": "recovery_checkpoint_unreadable", "checkpoint": path.name},
                )
                rep.unreadable_checkpoints.append(path.name)
                readers[f.reader] = Checkpoint()
                write_checkpoint(path, readers[f.reader])
        if not readers:
            readers[""] = Checkpoint()
        # Above every id a file names: after a power cut a reader's file may name ids
        # whose PUT records were not synced yet (fsync "<ms>" or "never").
        last_id = max(
            [s.last_id for s in segments]
            + [cp.head for cp in readers.values()]
            + [cp.done[-1] for cp in readers.values() if cp.done]
            + [cp.errors[-1][0] for cp in readers.values() if cp.errors]
            + [cp.delays[-1][0] for cp in readers.values() if cp.delays]
        )
        rep.segments = len(segments)
        rep.records = sum(s.count for s in segments)
        rep.bytes = sum(s.size for s in segments)
        j = self._journal(name, config, segments, readers, last_id)
        marks, keys = self._marks(name, files, segments, last_id)
        if marks:
            j.producer_marks = marks
        if keys:
            j.dedup_marks = keys
        return j

    def _marks(self, name: str, files: list[jf.JournalFileName], segments: list[SegmentInfo],
               last_id: int) -> tuple[list[jf.ProducerMark], list[jf.DedupMark]]:
        """The queue's producer marks and deduplication keys: its snapshots, then every
        PRODUCER and DEDUP record of its segments (the queue keeps the newest per producer
        or key). A mark naming ids above the last one recovered is dropped: its put was
        torn, never acknowledged."""
        marks: list[jf.ProducerMark] = []
        keys: list[jf.DedupMark] = []
        roles = {f.role for f in files}
        if jf.FileRole.PRODUCERS in roles:
            path = self.path / jf.producers_name(name)
            try:
                marks = read_producers(path)
            except (CorruptRecordError, OSError) as exc:
                # Never a loss: the producers it named fall back to at-least-once.
                log.error("recovery: producer snapshot %s unreadable (%s): its producers "
                          "start afresh", path.name, exc,
                          extra={"event": "recovery_producers_unreadable"})
        if jf.FileRole.DEDUP in roles:
            path = self.path / jf.dedup_name(name)
            try:
                keys = read_dedup(path)
            except (CorruptRecordError, OSError) as exc:
                # Never a loss: the keys it named fall back to at-least-once.
                log.error("recovery: key snapshot %s unreadable (%s): its keys are "
                          "forgotten", path.name, exc,
                          extra={"event": "recovery_dedup_unreadable"})
        for seg in segments:
            if seg.marks:
                for m in segment_marks(seg):
                    if isinstance(m, jf.DedupMark):
                        keys.append(m)
                    else:
                        marks.append(m)
        return ([m for m in marks if m.first_id + m.count - 1 <= last_id],
                [k for k in keys if k.first_id + k.count - 1 <= last_id])

    def _finish_compactions(self, name: str, segments: list[SegmentInfo]) -> list[SegmentInfo]:
        """Remove segments a completed compaction replaced (crash before their removal)."""
        replaced: set[int] = set()
        for seg in segments:
            if seg.compacted_from is not None:
                for other in segments:
                    if seg.compacted_from <= other.number < seg.number:
                        replaced.add(other.number)
        if not replaced:
            return segments
        leftovers = [s for s in segments if s.number in replaced]
        log.warning(
            "recovery: queue %s: finishing an interrupted compaction, retiring %s",
            name, ", ".join(s.path.name for s in leftovers),
            extra={"event": "recovery_compaction_finished", "queue": name},
        )
        self.retire_segments(leftovers)
        return [s for s in segments if s.number not in replaced]

    # -- queues ---------------------------------------------------------------------

    def queue(self, name: str) -> QueueJournal:
        """The journal of queue `name`, created empty on first use."""
        j = self.queues.get(name)
        if j is None:
            if not jf.valid_name(name):
                raise ValueError(f"invalid queue name {name!r}")
            j = self._journal(name, self.queue_config(name), [], {"": NO_CHECKPOINT}, 0)
            self.queues[name] = j
        return j

    def _journal(
        self, name: str, config: JournalConfig, segments: list[SegmentInfo],
        readers: dict[str, Checkpoint], last_id: int,
    ) -> QueueJournal:
        last_number = max((s.number for s in segments), default=0)
        file = self.writer.segment_file(name, config.fsync, last_number)
        # A queue with no segment starts a new life (deleted and created again, Spark's
        # streams must tell); one with segments keeps the newest incarnation they name (a
        # header recovery rewrote names none).
        file.incarnation = next((s.incarnation for s in reversed(segments) if s.incarnation),
                                0) if segments else max(int(time.time() * 1000), 1)
        return QueueJournal(self, name, config, segments, readers, last_id, file)

    # -- parking (the broker parks idle queues: queued.broker.parking) ---------------

    def load_queue(
        self, name: str, segments: Sequence[int], readers: Sequence[str], last_id: int
    ) -> QueueJournal:
        """Recover parked queue `name` from its files as start-up does, here and now
        (`read_parked_queue` then `adopt_queue`, on the caller's thread)."""
        if name in self.queues:
            raise RuntimeError(f"queue {name!r} is loaded already")
        j = self.read_parked_queue(name, segments, readers, last_id)
        self.adopt_queue(j)
        return j

    def read_parked_queue(
        self, name: str, segments: Sequence[int], readers: Sequence[str], last_id: int
    ) -> QueueJournal:
        """Parked queue `name`'s journal recovered from its files as start-up does, not
        yet one of this data dir's queues (`adopt_queue`). Touches only that queue's files
        and nothing of this object's state, so it may run on a worker thread while the
        event loop goes on (the files of a parked queue change only when it is deleted,
        which waits for a load under way). `segments` and `readers` name its files (no
        listing of a directory that may hold 10,000 queues); a reader whose checkpoint
        was never written has none. Ids stay above `last_id`."""
        entries = [(jf.segment_name(name, n), jf.JournalFileName(name, jf.FileRole.SEGMENT,
                                                                  number=n))
                   for n in segments]
        for reader in readers:
            file_name = jf.checkpoint_name(name, reader)
            if (self.path / file_name).exists():
                entries.append((file_name, jf.JournalFileName(name, jf.FileRole.CHECKPOINT,
                                                              reader=reader)))
        if (self.path / jf.producers_name(name)).exists():
            entries.append((jf.producers_name(name), jf.JournalFileName(
                name, jf.FileRole.PRODUCERS)))
        if (self.path / jf.dedup_name(name)).exists():
            entries.append((jf.dedup_name(name), jf.JournalFileName(name, jf.FileRole.DEDUP)))
        j = self._recover_queue(name, entries, report=False)
        j.last_id = max(j.last_id, last_id)
        return j

    def adopt_queue(self, journal: QueueJournal) -> None:
        """A journal `read_parked_queue` made is this data dir's queue from now on."""
        if journal.name in self.queues:
            raise RuntimeError(f"queue {journal.name!r} is loaded already")
        self.queues[journal.name] = journal

    async def sync_segment(self, journal: QueueJournal) -> None:
        """fsync what `journal`'s segment has written and not synced, whatever its policy,
        between rounds (a round may be writing it)."""
        async with self.writer.paused():
            await trio.to_thread.run_sync(journal.file.sync_now)

    async def park_queue(self, name: str, detach: Callable[[QueueJournal], bool]) -> bool:
        """Forget queue `name`'s journal and close its files (they stay) if it has
        nothing planned and nothing unsynced and `detach` agrees; True if it was parked.

        `detach` runs with no writer round under way and nothing between it and the
        closing yields: what it checks still holds when the files close. A load of the
        queue after that opens new handles (its first append starts a new segment)."""
        async with self.writer.paused():
            j = self.queues.get(name)
            if (j is None or j.planned or j.has_reader_ops or j in self._dirty
                    or j.fsync_deadline() is not None or j.failed is not None
                    or not detach(j)):
                return False
            del self.queues[name]
            self.report.forget(name)  # (its figures stay in the totals)
            j.close()
            try:
                j.close_files()  # nothing to fsync (checked above): closing is all it does
            except OSError as exc:
                log.error("parking queue %s: closing its files: %s", name, exc)
            return True

    async def delete_queue(self, name: str, *, parked: bool = False) -> None:
        """Remove every file of queue `name` (after its pending appends finish);
        `parked`: a queue whose journal is not loaded (see park_queue)."""
        j = self.queues.pop(name, None)
        if j is None and not parked:
            return
        if j is not None:
            j.close()
            self._dirty.pop(j, None)
            j.fail_pending(JournalClosedError(f"queue {name!r} was deleted"))

        def remove() -> None:
            if j is not None:
                j.close_files()
            self.settle_intents()
            # List the directory now: a round or compaction may have made files since.
            for entry in os.listdir(self.path):
                parsed = jf.parse_file_name(entry)
                if parsed is not None and parsed.queue == name:
                    fileio.unlink(self.path / entry, missing_ok=True)
            fsync_dir(self.path)

        # No round, compaction or checkpoint of this queue may run while its files go.
        async with self.writer.paused():
            if j is None:
                await trio.to_thread.run_sync(remove)
                return
            async with j.maintenance_lock:
                await trio.to_thread.run_sync(remove)

    def paused_queues(self) -> set[str]:
        """The queues paused durably (`save_paused`); synchronous, for the start-up."""
        try:
            text = (self.path / PAUSED_FILE).read_text("ascii")
        except FileNotFoundError:
            return set()
        return {line for line in text.split() if jf.valid_name(line)}

    async def save_paused(self, names: set[str]) -> None:
        """Make `names` the paused queues, durably (temp, fsync, rename, directory fsync),
        in a worker thread: a pause is answered once it would survive a crash."""
        data = "".join(f"{n}\n" for n in sorted(names)).encode("ascii")
        await trio.to_thread.run_sync(write_file_atomic, self.path / PAUSED_FILE, data)

    def retire_segments(self, segs: list[SegmentInfo]) -> None:
        """Retire dead segments, durably: with archive_dir, originals move there and
        compaction outputs are deleted (their records are in the archived originals
        already); without it, all are deleted."""
        archive = self.config.archive_dir
        self.settle_intents()
        for seg in segs:
            if archive is None or seg.compacted_from is not None:
                fileio.unlink(seg.path, missing_ok=True)
                continue
            fileio.mkdir(archive)
            try:
                fileio.replace(seg.path, archive / seg.path.name)
            except OSError:  # another filesystem: a durable copy first, then remove
                self.copy_to_archive(seg.path)
                fileio.unlink(seg.path)
        if archive is not None and archive.exists():
            fsync_dir(archive)
        fsync_dir(self.path)

    def settle_intents(self) -> None:
        """No record of the intent log stands for a segment from here on: call it before
        a segment is removed, renamed over or moved (queued.storage.intent_log)."""
        self.writer.settle_intents()

    def copy_to_archive(self, path: Path) -> None:
        """A durable copy of `path` in archive_dir (the original stays)."""
        archive = self.config.archive_dir
        assert archive is not None
        fileio.mkdir(archive)
        fileio.copy_file(path, archive / path.name)
        fsync_dir(archive)

    # -- the writer loop --------------------------------------------------------------

    def reader_file(self, queue: str, reader: str, fsync: FsyncPolicy) -> ReaderFile:
        return self.writer.reader_file(queue, reader, fsync)

    def note_pending(self, journal: QueueJournal) -> None:
        """`journal` has planned appends (or reader file changes): written here and now
        when no fsync is due (`Writer.write_now`: fsync never, or periodic between its
        fsyncs) and the writer is idle, so the put is durable without a hand-off to the
        writer's task; else the next round takes them (group commit: one fsync for every
        queued append, one per reader file for its confirms). Reader file changes alone
        wait: for `write_ready`, which the connection calls once it has run its batch and
        waits for them, or for the writer's task; the confirms of a batch share one
        append instead of one write each."""
        if self.deferring:
            self._dirty[journal] = None  # the caller commits (`commit_now`)
        elif not (journal.planned and self._write_now(journal)):
            self._dirty[journal] = None
            self._wake.set()

    def write_ready(self) -> None:
        """Write here and now every planned change that needs no fsync and opens no file
        (reader appends of confirms under fsync never or <ms>, say), rather than wait for
        the writer's task; the rest stays for its next round."""
        for journal in list(self._dirty):
            self._write_now(journal)

    def commit_now(self) -> bool:
        """Every planned change (appends, reader file changes) written, and synced as
        each file's fsync policy says, here and now: one round on the caller's thread
        (see `Writer.write_round_now`). False, with nothing done, while the writer's
        task has a round under way (its files are busy): call `wait_round` and again."""
        if not self._dirty:
            return True
        if self._in_round or self._closing or self.writer.busy:
            return False
        # (one loop, not a comprehension per list: a pass's commit usually has one queue)
        work: list[tuple[QueueJournal, list[Planned]]] = []
        files: list[tuple[SegmentFile, Sequence[Chunk]]] = []
        readers: list[tuple[QueueJournal, ReaderWork]] = []
        reader_ops: list[tuple[ReaderFile, Sequence[ReaderOp]]] = []
        journals = list(self._dirty)
        self._dirty.clear()
        for j in journals:
            chunks = j.take_pending()
            if chunks:
                work.append((j, chunks))
                files.append((j.file, chunks))
            if j.has_reader_ops:
                ops = j.take_reader_ops()
                readers.append((j, ops))
                reader_ops += ops
        results = self.writer.write_round_now(files, reader_ops)
        self._finish_round(work, results, readers)
        # Periodic policy: what was just written owes an fsync the writer's task must
        # come back for (it may sleep past it, or for good when nothing else is written).
        owed = math.inf
        for j in journals:
            d = j.fsync_deadline()
            if d is not None and d < owed:
                owed = d
        if owed < self._asleep_until:
            self._wake.set()
        return True

    async def wait_round(self) -> None:
        """Until the writer has no round (or pause) under way: a checkpoint, say."""
        while self._in_round or self.writer.busy:
            await self.writer.wait_idle()  # (a round holds its lock from start to end)

    def _write_now(self, journal: QueueJournal) -> bool:
        """Write `journal`'s planned changes at once if the writer allows; True if done."""
        if self._in_round or self._closing:
            return False
        readers = journal.planned_readers if journal.has_reader_ops else []
        result = self.writer.write_now(journal.file, journal.planned, readers)
        if result is None:
            return False
        self._dirty.pop(journal, None)
        journal.finish_round(journal.take_pending(), result)
        if readers:
            journal.take_reader_ops()
            journal.finish_reader_ops(readers)
        owed = journal.fsync_deadline()  # periodic: this write owes an fsync
        if owed is not None and owed < self._asleep_until:
            self._wake.set()  # the writer sleeps past it: it must look again
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer loop: one round = one writer call for every queue with planned appends.

        Shielded from cancellation: it ends with `aclose` (as `open_data_dir`, in
        queued.storage.opening, always calls it), since a shutdown still writes
        (checkpoints are rounds too)."""
        task_status.started()
        with trio.CancelScope(shield=True):
            await self._run()

    async def _run(self) -> None:
        try:
            while True:
                if not self._dirty:
                    if self._closing:
                        return
                    deadline = min(
                        (d for j in self.queues.values() if (d := j.fsync_deadline())),
                        default=None,
                    )
                    # The fsync deadlines are on the monotonic clock of the worker thread.
                    self._asleep_until = float("inf") if deadline is None else deadline
                    wait = self._asleep_until - time.monotonic()
                    with trio.move_on_after(max(0.0, wait)):
                        await self._wake.wait()
                    self._asleep_until = float("-inf")  # awake: it looks before sleeping
                # Appends from here on set a fresh event and are taken next round.
                self._wake = trio.Event()
                work = [(j, j.take_pending()) for j in self._dirty]
                readers = [(j, ops) for j in self._dirty if (ops := j.take_reader_ops())]
                work = [(j, chunks) for j, chunks in work if chunks]
                self._dirty.clear()
                now = time.monotonic()
                periodic = [
                    f for j in self.queues.values() if j.fsync_deadline() is not None
                    for f in j.files() if (d := f.fsync_deadline()) is not None and d <= now
                ]
                if not (work or readers or periodic):
                    continue  # woken to look at a new fsync deadline: sleep until it
                # No write here and now until these are written: they come first.
                self._in_round = True
                try:
                    results = await self.writer.write_round(
                        [(j.file, chunks) for j, chunks in work], periodic,
                        [pair for _, ops in readers for pair in ops],
                    )
                finally:
                    self._in_round = False
                self._finish_round(work, results, readers)
                # Not kept until the next round (an idle server may have none for long):
                # a parked queue's journal and files must go now.
                del work, readers, results, periodic
        finally:
            self._writer_done.set()

    @staticmethod
    def _finish_round(
        work: list[tuple[QueueJournal, list[Planned]]], results: Sequence[WriteResult],
        readers: list[tuple[QueueJournal, ReaderWork]],
    ) -> None:
        """Back from a round: note what was written (a function of its own, so its loop
        variables do not keep the last journal alive in the writer loop's frame)."""
        for (j, chunks), result in zip(work, results, strict=True):
            j.finish_round(chunks, result)
        for j, ops in readers:
            j.finish_reader_ops(ops)

    async def aclose(self) -> None:
        """Finish pending appends, fsync and close every segment; NotSavedError lists the
        queues whose segment could not be fsynced and closed."""
        self._closing = True
        for j in self.queues.values():
            j.close()  # appends from now on fail at once instead of waiting forever
        self._wake.set()
        with trio.CancelScope(shield=True):
            await self._writer_done.wait()
            for j in self.queues.values():  # anything queued after the writer's last round
                j.fail_pending(JournalClosedError(f"queue {j.name!r}: data dir closed"))

            def close_all() -> None:
                unsaved: list[str] = []
                for j in self.queues.values():
                    try:
                        j.close_files()
                    except OSError as exc:  # close the others all the same
                        unsaved.append(f"queue {j.name}: journal not fsynced and closed "
                                       f"({exc.strerror or exc}); what it wrote since its "
                                       f"last fsync may be lost")
                        log.error("closing queue %s: %s", j.name, exc)
                try:
                    self.writer.intents.close()  # every file it names synced, then gone
                except OSError as exc:
                    unsaved.append(f"intent log: not settled ({exc.strerror or exc}); the "
                                   f"next start writes its records back")
                if unsaved:
                    raise NotSavedError(unsaved)

            try:
                await trio.to_thread.run_sync(close_all)
            finally:
                self.writer.close()

    def statistics(self) -> DataDirStats:
        writer = self.writer.statistics()
        return DataDirStats(
            path=str(self.path),
            queues=len(self.queues),
            rounds=writer.rounds,
            fsync=writer.fsync,
            recovery_seconds=self.report.seconds,
            truncated_bytes=self.report.truncated_bytes,
            intent_appends=self.writer.intents.appends,
            intent_settles=self.writer.intents.settles,
            intents_replayed=self.report.intents_replayed,
        )
