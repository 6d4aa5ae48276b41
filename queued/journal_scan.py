"""Read-only scans of journal directories for bulk readers (the Spark data source).

Owns listing a directory's segments and checkpoints and streaming a segment's items
out as columns, in bounded chunks, through the pure decoder (`RecordDecoder`):
only verified batches of our files are returned, and a torn tail (a batch still
being written by a live server) ends the scan. Never writes or repairs a file, and
imports no pyspark or pyarrow, so it is tested without Spark.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from queued import journal_format as jf
from queued.errors import CorruptRecordError, QueuedError
from queued.recovery import Checkpoint, read_checkpoint

#: Bytes read from a segment file per read call; bounds a scan's memory.
CHUNK_SIZE = 8 << 20
#: Rows per `PutColumns` chunk at most.
ROWS_PER_CHUNK = 65536



class ScanError(QueuedError):
    """A journal file a scan cannot read (corrupt in the middle, not a segment)."""


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """One writer segment file found in a directory."""

    queue: str
    number: int
    path: str
    size: int


@dataclass(slots=True)
class PutColumns:
    """Up to ROWS_PER_CHUNK items of one segment, column by column, in id order."""

    ids: list[int] = field(default_factory=list)
    add_times: list[int] = field(default_factory=list)  # ms since the epoch
    expire_times: list[int | None] = field(default_factory=list)  # None = never
    error_counts: list[int] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class IdFilter:
    """Which ids a scan returns: after `after`, up to `upto` (0 = no bound), not in `skip`."""

    after: int = 0
    upto: int = 0
    skip: frozenset[int] = frozenset()

    @classmethod
    def pending(cls, checkpoint: Checkpoint) -> IdFilter:
        """What a reader has not consumed yet: above its head and not READ_DONE."""
        return cls(after=checkpoint.head, skip=frozenset(checkpoint.done))

    @property
    def is_all(self) -> bool:
        return self.after <= 0 and self.upto <= 0 and not self.skip

    def wants_range(self, first_id: int, last_id: int) -> bool:
        """Whether a batch or segment holding ids first..last may hold a wanted id."""
        return last_id > self.after and (self.upto <= 0 or first_id <= self.upto)


def list_segments(directory: str | os.PathLike[str],
                  queues: Collection[str] | None = None) -> list[SegmentRef]:
    """Writer segments of `directory` (a data directory or an archive_dir), by queue
    then segment number; checkpoints, temp files and anything else are skipped."""
    found: list[SegmentRef] = []
    with os.scandir(directory) as it:
        for entry in it:
            name = jf.parse_file_name(entry.name)
            if name is None or name.role is not jf.FileRole.SEGMENT:
                continue
            if queues is not None and name.queue not in queues:
                continue
            try:
                if not entry.is_file():
                    continue
                size = entry.stat().st_size
            except FileNotFoundError:  # retired by compaction meanwhile
                continue
            found.append(SegmentRef(name.queue, name.number, entry.path, size))
    found.sort(key=lambda s: (s.queue, s.number))
    return found


def reader_checkpoint(directory: str | os.PathLike[str], queue: str,
                      reader: str = "") -> Checkpoint:
    """A reader's durable position in a data directory; head 0 when it has no checkpoint
    file (as recovery does). Raises ScanError when the checkpoint cannot be trusted."""
    path = Path(directory) / jf.checkpoint_name(queue, reader)
    try:
        return read_checkpoint(path)
    except FileNotFoundError:
        return Checkpoint()
    except CorruptRecordError as exc:
        raise ScanError(f"{path}: unreadable checkpoint ({exc}); the server would replay "
                        "this reader from its oldest segment") from exc


def scan_segment(path: str | os.PathLike[str], ids: IdFilter = IdFilter(), *,
                 chunk_size: int = CHUNK_SIZE,
                 rows_per_chunk: int = ROWS_PER_CHUNK) -> Iterator[PutColumns]:
    """The items of one segment that `ids` selects, in chunks of at most
    `rows_per_chunk` rows, reading the file `chunk_size` bytes at a time.

    Our (sealed) files yield only batches whose check record verifies; files of
    another implementation yield every structurally valid record. Either way the
    scan stops quietly at a torn tail or a zero byte (the newest segment of a
    running server ends mid-batch while a write is in flight) and raises ScanError
    on corruption.
    """
    scanner = _Scanner(os.fspath(path), ids, rows_per_chunk)
    with open(path, "rb") as f:
        try:
            yield from scanner.run(f, chunk_size)
        except CorruptRecordError as exc:
            raise ScanError(f"{os.fspath(path)}: {exc}; `queued check` on the directory "
                            "says more") from exc


@dataclass(slots=True)
class SegmentSummary:
    """Ids and counts of one segment's verified items (one pass over its batches)."""

    count: int = 0
    first_id: int = 0
    last_id: int = 0
    data_bytes: int = 0
    compacted: bool = False  # a compaction output: holds only the stragglers of its range
    #: (first_id, last_id, count) of each batch with items, ascending
    batches: list[tuple[int, int, int]] = field(default_factory=list)


def summarize_segment(path: str | os.PathLike[str], *,
                      chunk_size: int = CHUNK_SIZE) -> SegmentSummary:
    """Count a segment's items without building them (the decoder's batch fast path)."""
    out = SegmentSummary()
    with open(path, "rb") as f:
        head = f.read(jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE + 1)
        out.compacted = head[jf.MAGIC_SIZE:-1] == jf.EMPTY_CHECK and head[-1:] == bytes(
            [jf.COMPACTED_BYTE])
        f.seek(0)
        if head[jf.MAGIC_SIZE:jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE] != jf.EMPTY_CHECK:
            for cols in scan_segment(path, chunk_size=chunk_size):  # another implementation's
                for xid, data in zip(cols.ids, cols.data, strict=True):
                    out.batches.append((xid, xid, 1))
                    out.data_bytes += len(data)
        else:
            dec = jf.RecordDecoder(jf.FileKind.WRITER)
            try:
                while True:
                    ev = dec.next_batch()
                    if ev is jf.NEED_DATA:
                        dec.receive_data(f.read(chunk_size))
                    elif isinstance(ev, jf.Batch):
                        if ev.count:
                            out.batches.append((ev.first_id, ev.last_id, ev.count))
                            out.data_bytes += ev.data_bytes
                    else:
                        break
            except CorruptRecordError as exc:
                raise ScanError(f"{os.fspath(path)}: {exc}") from exc
    if out.batches:
        out.first_id, out.last_id = out.batches[0][0], out.batches[-1][1]
        out.count = sum(b[2] for b in out.batches)
    return out


def nth_id_after(path: str | os.PathLike[str], summary: SegmentSummary, after: int,
                 n: int) -> tuple[int, int]:
    """(id, k): the k-th id (k <= n, as many as there are) of the segment above `after`.

    Uses the batch summary where a batch's ids are contiguous; walks the records of
    the one batch where the n-th id falls otherwise. (0, 0) when none is above.
    """
    taken = 0
    last = 0
    for first_id, last_id, count in summary.batches:
        if last_id <= after:
            continue
        want = n - taken
        if first_id > after and count <= want:
            taken += count
            last = last_id
        elif last_id - first_id + 1 == count:  # contiguous ids: no need to read
            lo = max(first_id, after + 1)
            k = min(want, last_id - lo + 1)
            taken += k
            last = lo + k - 1
        else:
            for cols in scan_segment(path, IdFilter(after=max(after, first_id - 1),
                                                    upto=last_id)):
                k = min(want, len(cols))
                if k:
                    taken += k
                    want -= k
                    last = cols.ids[k - 1]
                if not want:
                    break
        if taken >= n:
            break
    return last, taken


class _Scanner:
    """The state of one segment scan: the decoder plus a mirror of the bytes fed to it
    (the decoder verifies a batch; the mirror gives its records' fields)."""

    def __init__(self, path: str, ids: IdFilter, rows: int) -> None:
        self.path = path
        self.ids = ids
        self.rows = rows
        self.dec = jf.RecordDecoder(jf.FileKind.WRITER)
        self.buf = bytearray()
        self.base = 0  # file offset of buf[0]
        self.out = PutColumns()

    def _feed(self, data: bytes) -> None:
        self.dec.receive_data(data)
        if data:
            self.buf += data

    def run(self, f: BinaryIO, chunk_size: int) -> Iterator[PutColumns]:
        read = f.read
        head = read(jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE)
        self._feed(head)
        if len(head) < jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE:
            self._feed(b"")
        if head[jf.MAGIC_SIZE:] == jf.EMPTY_CHECK:
            yield from self._sealed(read, chunk_size)
        else:
            yield from self._plain(read, chunk_size)
        if self.out.ids:
            yield self.out

    def _sealed(self, read: Callable[[int], bytes], chunk_size: int) -> Iterator[PutColumns]:
        dec, ids = self.dec, self.ids
        while True:
            ev = dec.next_batch()
            if ev is jf.NEED_DATA:
                # Keep only the bytes from the current batch on (the rest is done with).
                drop = dec.batch_start - self.base
                if drop > 0:
                    del self.buf[:drop]
                    self.base += drop
                self._feed(read(chunk_size))
                continue
            if not isinstance(ev, jf.Batch):
                return  # clean end, zero byte, or a torn tail (a write in flight)
            if ev.count and ids.wants_range(ev.first_id, ev.last_id):
                yield from self._take(ev.offset - self.base, ev.end - self.base)

    def _take(self, pos: int, end: int) -> Iterator[PutColumns]:
        """The PUT records of a verified batch buf[pos:end] (ending in its check record)."""
        buf, out, ids = self.buf, self.out, self.ids
        unpack, unpack_exp = jf.PUT_STRUCT.unpack_from, jf.PUT_EXPIRE_STRUCT.unpack_from
        put, put_exp = jf.PUT_BYTE, jf.PUT_EXPIRE_BYTE
        put_hdr, put_exp_hdr = jf.PUT_HEADER_SIZE, jf.PUT_EXPIRE_HEADER_SIZE
        lo, hi, skip = ids.after, ids.upto, ids.skip
        filtered = not ids.is_all
        rows = self.rows
        end -= jf.CHECK_RECORD_SIZE
        while pos < end:
            cmd = buf[pos]
            if cmd in (put, put_exp):
                expire: int | None
                if cmd == put:
                    _, size, errs, xid, added = unpack(buf, pos)
                    start, expire = pos + put_hdr, None
                else:
                    _, size, errs, xid, added, expire = unpack_exp(buf, pos)
                    start = pos + put_exp_hdr
                pos = start + size
                if filtered and (xid <= lo or (hi > 0 and xid > hi) or xid in skip):
                    continue
                out.ids.append(xid)
                out.add_times.append(added)
                out.expire_times.append(expire)
                out.error_counts.append(errs)
                out.data.append(bytes(buf[start:pos]))
                if len(out.ids) >= rows:
                    yield out
                    self.out = out = PutColumns()
            else:  # COMPACTED, READ records, unknown ones: the decoder checked their shape
                pos += jf.record_length(buf, pos)

    def _plain(self, read: Callable[[int], bytes], chunk_size: int) -> Iterator[PutColumns]:
        """A file without check records (another implementation): every valid record."""
        dec, ids = self.dec, self.ids
        lo, hi, skip = ids.after, ids.upto, ids.skip
        while True:
            ev = dec.next_event()
            if ev is jf.NEED_DATA:
                self.buf.clear()  # the mirror is not needed on this path
                dec.receive_data(read(chunk_size))
                continue
            if not isinstance(ev, jf.Decoded):
                return
            rec = ev.record
            if not isinstance(rec, jf.Put):
                continue
            if rec.id <= lo or (hi > 0 and rec.id > hi) or rec.id in skip:
                continue
            out = self.out
            out.ids.append(rec.id)
            out.add_times.append(rec.add_time_ms)
            out.expire_times.append(rec.expire_time_ms)
            out.error_counts.append(rec.error_count)
            out.data.append(rec.data)
            if len(out.ids) >= self.rows:
                yield out
                self.out = PutColumns()
