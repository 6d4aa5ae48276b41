"""Durable file primitives and the two values every storage module shares.

Owns what a segment is to the journal (`SegmentInfo`: its ids, size and sparse
index) and reading one back, a reader's checkpoint file (`Checkpoint`, read and
written atomically), and the crash-safe file steps (temp + fsync + rename +
directory fsync).
Synchronous file I/O only; callers on the event loop run it in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

from queued.errors import CorruptRecordError, DataDirError, JournalError
from queued.journal import format as jf
from queued.storage import fileio

#: Sparse index stride: one (first_id, offset) entry per this many bytes.
INDEX_STRIDE: Final = 1 << 20
#: Bytes read per call when reading a segment back.
READ_BACK_CHUNK = 1 << 20


@dataclass(slots=True)
class SegmentInfo:
    """What the journal knows of one writer segment (mutable: the active one grows)."""

    number: int
    path: Path
    size: int
    count: int = 0
    first_id: int = 0
    last_id: int = 0
    sealed: bool = True
    compacted_from: int | None = None  # first segment number this one replaced
    inode: int = 0  # to notice the file was replaced under a stale SegmentInfo (0 = unknown)
    #: sparse (first id of a batch, its offset), ascending, for seeking read-back
    index: list[tuple[int, int]] = field(default_factory=list)
    #: bytes of item data in the segment; None once a batch was noted without it
    data_bytes: int | None = 0
    #: PUT records led by a DELAY record, as recovery counted them (startup looks for
    #: delayed items only where > 0; appends made since start are not counted)
    delayed: int = 0
    #: PRODUCER and DEDUP records, as recovery counted them (start-up reads marks back
    #: only where > 0; appends made since start are counted by the journal)
    marks: int = 0
    #: the queue's life this segment belongs to (its head's INCARNATION record; 0 = none)
    incarnation: int = 0

    def note_batch(
        self, offset: int, end: int, count: int, first_id: int, last_id: int,
        data_bytes: int | None = None, delayed: int = 0, marks: int = 0,
    ) -> None:
        self.delayed += delayed
        self.marks += marks
        if count:
            if data_bytes is None or self.data_bytes is None:
                self.data_bytes = None
            else:
                self.data_bytes += data_bytes
            if not self.count:
                self.first_id = first_id
            if not self.index or offset - self.index[-1][1] >= INDEX_STRIDE:
                self.index.append((first_id, offset))
            self.count += count
            self.last_id = last_id
        self.size = max(self.size, end)

    def seek_offset(self, from_id: int) -> int:
        """Offset of a batch start at or before the first record with id >= from_id."""
        best = jf.MAGIC_SIZE
        for first_id, offset in self.index:
            if first_id > from_id:
                break
            best = offset
        return best


def read_segment(seg: SegmentInfo, from_id: int, to_id: int | None) -> Iterator[jf.Put]:
    """PUT records of `seg` with from_id <= id (<= to_id), in order, up to seg.size.

    Streams in chunks from the nearest indexed batch; raises FileNotFoundError when
    the file was replaced under a stale `seg` (compaction), JournalError on a record
    cut short. Synchronous file I/O.
    """
    for rec in _records(seg, seg.seek_offset(from_id)):
        if isinstance(rec, jf.Put) and rec.id >= from_id:
            if to_id is not None and rec.id > to_id:
                return
            yield rec


def segment_marks(seg: SegmentInfo) -> list[jf.ProducerMark | jf.DedupMark]:
    """The PRODUCER and DEDUP records of one segment, in order (synchronous file I/O)."""
    return [rec for rec in _records(seg, jf.MAGIC_SIZE)
            if isinstance(rec, (jf.ProducerMark, jf.DedupMark))]


def _records(seg: SegmentInfo, offset: int) -> Iterator[jf.Record]:
    """The records of `seg` from `offset` (a batch start) up to seg.size, streamed."""
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
                data = f.read(min(remaining, READ_BACK_CHUNK)) if remaining > 0 else b""
                remaining -= len(data)
                dec.receive_data(data)
                continue
            if isinstance(ev, jf.Decoded):
                yield ev.record
                continue
            if isinstance(ev, jf.TornTail):
                raise JournalError(f"{seg.path}: record cut short at {ev.offset}")
            return


def fsync_dir(path: Path) -> None:
    fileio.fsync_dir(path)


#: The file `probe_writable` writes and removes. No journal file has this name (a queue
#: name comes before the first dot), so recovery, `check` and Spark never read it.
PROBE_NAME = ".queued-write-probe"


def probe_writable(directory: Path) -> None:
    """Prove that `directory` takes writes: create it if missing, write, fsync and remove
    a probe file, fsync the directory. Raises DataDirError naming the step that failed.

    A mode bit proves nothing (root ignores modes), and a file system that went read-only,
    is full or fails shows only on a real write and fsync.
    """
    probe = directory / PROBE_NAME
    step = "create the directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        step = f"create {PROBE_NAME}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            step = f"write {PROBE_NAME}"
            os.write(fd, b"queued: this directory takes writes\n")
            step = f"fsync {PROBE_NAME}"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = f"remove {PROBE_NAME}"
        probe.unlink()
        step = "fsync the directory"
        fsync_dir(directory)
    except OSError as exc:
        raise DataDirError(
            f"data dir {directory} is not writable: cannot {step}: {exc.strerror or exc}"
        ) from exc


def unlink_durably(path: Path) -> None:
    """Remove `path` (if there) and make the removal durable."""
    try:
        fileio.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def write_temp(path: Path, data: bytes) -> Path:
    """`path`'s temp file (`~~`) holding `data`, fsynced; the caller renames it."""
    tmp = path.with_name(jf.temp_name(path.name))
    fd = fileio.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fileio.write_all(fd, data)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    return tmp


def write_file_atomic(path: Path, data: bytes) -> None:
    """temp + fsync + rename + directory fsync: the file is old or new, never half."""
    fileio.replace(write_temp(path, data), path)
    fsync_dir(path.parent)


# -- mark snapshots: producers (exactly-once puts) and deduplication keys --------------


M = TypeVar("M", jf.ProducerMark, jf.DedupMark)


def encode_snapshot(records: Sequence[bytes]) -> bytes:
    """A snapshot file of marks: the writer magic, the empty seal, then one sealed batch
    of their records (the file is read only by us: no seed reader looks at it)."""
    head = jf.WRITER_MAGIC + jf.EMPTY_CHECK
    body = b"".join(records)
    return head + jf.seal(body, len(head)) if body else head


def read_snapshot(path: Path, kind: type[M], what: str) -> list[M]:
    """The marks of type `kind` in a snapshot file; [] if there is none. A snapshot is
    written whole (temp, fsync, rename), so a torn or corrupt one is damage:
    CorruptRecordError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    marks: list[M] = []
    checked = 0
    for ev in jf.decode_all(data, jf.FileKind.WRITER):
        rec = ev.record
        if isinstance(rec, kind):
            marks.append(rec)
        elif isinstance(rec, jf.Check):
            checked = ev.end
    if checked != len(data):
        raise CorruptRecordError(checked, f"{path.name}: {what} cut short")
    return marks


def encode_producers(marks: Sequence[jf.ProducerMark]) -> bytes:
    return encode_snapshot([jf.producer_record(m) for m in marks])


def read_producers(path: Path) -> list[jf.ProducerMark]:
    return read_snapshot(path, jf.ProducerMark, "producer snapshot")


def write_producers(path: Path, marks: Sequence[jf.ProducerMark]) -> None:
    """Replace the snapshot durably (temp + fsync + rename + directory fsync)."""
    write_file_atomic(path, encode_producers(marks))


def encode_dedup(marks: Sequence[jf.DedupMark]) -> bytes:
    return encode_snapshot([jf.dedup_record(m) for m in marks])


def read_dedup(path: Path) -> list[jf.DedupMark]:
    return read_snapshot(path, jf.DedupMark, "key snapshot")


def write_dedup(path: Path, marks: Sequence[jf.DedupMark]) -> None:
    """Replace the key snapshot durably (temp + fsync + rename + directory fsync)."""
    write_file_atomic(path, encode_dedup(marks))


# -- checkpoints ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A reader's durable position: ids <= head and ids in done are consumed; `errors`
    holds the error counts aborts gave to items not consumed yet, (id, count) sorted."""

    head: int = 0
    done: tuple[int, ...] = ()
    errors: tuple[tuple[int, int], ...] = ()
    #: due times aborts with a delay gave to items not consumed yet, (id, due ms) sorted
    delays: tuple[tuple[int, int], ...] = ()


#: The checkpoint of a reader that has consumed nothing (immutable: one for all).
NO_CHECKPOINT = Checkpoint()


def decode_checkpoint(data: bytes) -> tuple[Checkpoint, int]:
    """A reader file's state, and where its trusted bytes end.

    Ours (sealed: a check record right after the magic) counts only records a verified
    check covers. The file is written whole (magic, check, the checkpoint's batch), then
    confirms and error counts are appended as batches of their own until the next
    checkpoint, so a crash can leave a torn append after the last verified batch: with
    no verified batch after it, that tail is ignored (it was never acknowledged) and the
    returned end is before it. Damage to the checkpoint's own batch (written whole,
    fsynced before its rename: no crash tears it), damage followed by a verified batch,
    a torn seed file (no check records: every record is trusted, as Kestrel does) or a
    negative head raise CorruptRecordError.
    """
    dec = jf.RecordDecoder(jf.FileKind.READER)
    dec.receive_data(data)
    dec.receive_data(b"")
    head = 0
    done: set[int] = set()
    errors: dict[int, int] = {}
    delays: dict[int, int] = {}
    batch: list[jf.Record] = []  # of a sealed file: records since the last check
    checks = 0
    sealed: bool | None = None
    damage: str | None = None

    def apply(rec: jf.Record) -> None:
        nonlocal head
        if isinstance(rec, jf.ReadHead):
            head = rec.id
        elif isinstance(rec, jf.ReadDone):
            done.update(rec.ids)
        elif isinstance(rec, jf.ReadErrors):
            errors.update(rec.entries)
        elif isinstance(rec, jf.ReadDelays):
            delays.update(rec.entries)

    while True:
        try:
            ev = dec.next_event()
        except CorruptRecordError as exc:
            if not sealed:
                raise
            damage = str(exc)
            break
        if isinstance(ev, jf.Decoded):
            rec = ev.record
            if sealed is None:
                sealed = isinstance(rec, jf.Check)
            if isinstance(rec, jf.Check):
                checks += 1
                for pending in batch:
                    apply(pending)
                batch.clear()
            elif sealed:
                batch.append(rec)
            else:
                apply(rec)
            continue
        if isinstance(ev, jf.TornTail):
            if not sealed:
                raise CorruptRecordError(ev.offset, "torn checkpoint")
            damage = "torn tail"
        break
    end = len(data)
    if sealed:
        assert dec.last_check_end is not None
        end = dec.last_check_end
        if end < len(data) and checks < 2:
            raise CorruptRecordError(end, damage or "checkpoint records after the last check "
                                     "record")
        if end < len(data) and jf.find_valid_check_after(data, end) is not None:
            raise CorruptRecordError(
                end, f"{damage or 'records without a check'}, with a verified batch after it")
    if head < 0:
        raise CorruptRecordError(0, f"negative head {head}")
    return Checkpoint(
        head,
        tuple(sorted(i for i in done if i > head)),
        tuple(sorted((i, n) for i, n in errors.items() if i > head and i not in done)),
        tuple(sorted((i, d) for i, d in delays.items() if i > head and i not in done)),
    ), end


def read_checkpoint(path: Path) -> Checkpoint:
    """Decode a reader file (a torn appended tail is left out, see decode_checkpoint);
    raises CorruptRecordError when it cannot be trusted."""
    return decode_checkpoint(path.read_bytes())[0]


def write_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    write_file_atomic(path, encode_checkpoint(checkpoint))


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    """The whole reader file for `checkpoint`."""
    return jf.encode_checkpoint(checkpoint.head, checkpoint.done, checkpoint.errors,
                                checkpoint.delays)
