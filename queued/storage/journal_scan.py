"""Read-only scans of journal directories for bulk readers (the Spark data source).

Owns listing a directory's segments and checkpoints and streaming a segment's items
out as columns, in bounded chunks, through the pure decoder (`RecordDecoder`):
only verified batches of our files are returned, and a torn tail (a batch still
being written by a live server) ends the scan. Never writes or repairs a file, and
imports no pyspark or pyarrow, so it is tested without Spark.
"""

from __future__ import annotations

import bisect
import mmap
import os
import struct
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

from queued.errors import CorruptRecordError, QueuedError
from queued.journal import format as jf
from queued.storage.files import Checkpoint, read_checkpoint

#: Bytes read from a segment file per read call; bounds a scan's memory.
CHUNK_SIZE = 8 << 20
#: A segment up to this size is read whole, in one call, and walked in place: its chunks
#: are views of those bytes, never copies (a journal_size segment, 16 MiB by default).
WHOLE_FILE_MAX = 64 << 20
#: Rows after which a `PutChunk` is handed out (at the end of the batch reaching it).
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
    """Items of one segment, column by column, in id order (a decoded `PutChunk`)."""

    ids: list[int] = field(default_factory=list)
    add_times: list[int] = field(default_factory=list)  # ms since the epoch
    expire_times: list[int | None] = field(default_factory=list)  # None = never
    error_counts: list[int] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)  # memcache flags (0 for most items)
    headers: list[bytes] = field(default_factory=list)  # headers blocks (b"" for most items)

    def __len__(self) -> int:
        return len(self.ids)


_ID = struct.Struct("<q")  # a PUT's id, at jf.PUT_ID_AT
#: Zero bytes after a chunk's last record, so that a PUT_EXPIRE-sized header can be
#: read at any record offset (a record in a sealed file is followed by at least a
#: check record anyway; a plain file's last one may end the file).
_PAD = bytes(8)


@dataclass(frozen=True, slots=True)
class PutChunk:
    """Some PUT records of one segment, in id order, as the raw bytes they sit in.

    `buf` holds the file's bytes from offset `base` on (a read-only view of the file read
    whole, or a copy); `spans` are the file offsets of the records (each a PUT or
    PUT_EXPIRE of a verified batch), in file order, where a run of same-sized records one
    stride apart may be one `range` (`offsets` lists them one by one); `flags`
    maps the offset of each record led by a FLAGS record to its flags (the others
    have flags 0; it may hold offsets that are not in `offsets`); `headers` likewise
    maps the offset of each record led by a HEADERS record to its block. Every
    record is followed in `buf` by at least 8 bytes, so a bulk reader may read
    `PUT_EXPIRE_HEADER_SIZE` bytes at any record offset (then look at the command
    byte). `columns()` decodes the records in Python; the Spark source decodes all
    of them at once with numpy (`queued.spark.arrow`), a range's with strided reads.
    """

    buf: bytes | memoryview
    base: int
    spans: list[int] | list[int | range]
    flags: dict[int, int] = field(default_factory=dict)
    headers: dict[int, bytes] = field(default_factory=dict)
    rows: int = -1  # how many records (-1: counted here)

    def __post_init__(self) -> None:
        if self.rows < 0:
            object.__setattr__(self, "rows", _count(self.spans))

    def __len__(self) -> int:
        return self.rows

    @property
    def offsets(self) -> list[int]:
        """The records' file offsets, one by one."""
        return _expand(self.spans)

    def columns(self) -> PutColumns:
        out = PutColumns()
        buf, base = self.buf, self.base
        flags, headers = self.flags, self.headers
        out.flags = [flags.get(off, 0) for off in self.offsets] if flags else [0] * len(self)
        out.headers = ([headers.get(off, b"") for off in self.offsets] if headers
                       else [b""] * len(self))
        unpack, unpack_exp = jf.PUT_STRUCT.unpack_from, jf.PUT_EXPIRE_STRUCT.unpack_from
        for off in self.offsets:
            pos = off - base
            expire: int | None
            if buf[pos] == jf.PUT_BYTE:
                _, size, errs, xid, added = unpack(buf, pos)
                start, expire = pos + jf.PUT_HEADER_SIZE, None
            else:
                _, size, errs, xid, added, expire = unpack_exp(buf, pos)
                start = pos + jf.PUT_EXPIRE_HEADER_SIZE
            out.ids.append(xid)
            out.add_times.append(added)
            out.expire_times.append(expire)
            out.error_counts.append(errs)
            out.data.append(bytes(buf[start:start + size]))
        return out


def _count(spans: list[int] | list[int | range]) -> int:
    return sum(1 if isinstance(s, int) else len(s) for s in spans)


def _expand(spans: list[int] | list[int | range]) -> list[int]:
    out: list[int] = []
    for s in spans:
        if isinstance(s, int):
            out.append(s)
        else:
            out.extend(s)
    return out


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


ALL_IDS = IdFilter()


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


def list_segments_with_archive(directory: str | os.PathLike[str],
                               archive: str | os.PathLike[str] | None,
                               queues: Collection[str] | None = None) -> list[SegmentRef]:
    """Writer segments of a data directory together with its `archive_dir`, by queue then
    segment number, each segment once.

    Retiring moves a segment into the archive, so a name is in one place, except where
    compaction rewrote a segment: its output keeps the original's name in the data
    directory (only the stragglers) while the original, with every record, was copied
    to the archive first. Where both hold a name, the archive's copy is the one listed.
    """
    found = {(s.queue, s.number): s for s in list_segments(directory, queues)}
    if archive is not None:
        found.update({(s.queue, s.number): s for s in list_segments(archive, queues)})
    return [found[key] for key in sorted(found)]


#: Command bytes that may come before a segment's first PUT: ours in both forms (the
#: extension envelope, and the older checks, COMPACTED, FLAGS, DELAY and INCARNATION).
_BEFORE_PUTS = frozenset((jf.EXT_BYTE, jf.OLD_CHECK_BYTE, jf.OLD_COMPACTED_BYTE, jf.READ_HEAD_BYTE,
                          jf.OLD_FLAGS_BYTE, jf.OLD_DELAY_BYTE, jf.OLD_INCARNATION_BYTE))


def first_id(path: str | os.PathLike[str]) -> int | None:
    """The id of a segment's first PUT record, from its first few KiB (not verified: use
    it to plan, not to read), or None when there is none there or the file is gone.

    Ids ascend through a queue's segments in number order (a compaction output holds
    stragglers older than every later segment's ids), so the next segment's first id
    bounds this one's last.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        return None
    pos = jf.sealed_start(head) or jf.MAGIC_SIZE
    while pos + jf.PUT_HEADER_SIZE <= len(head):
        cmd = head[pos]
        if cmd in (jf.PUT_BYTE, jf.PUT_EXPIRE_BYTE):
            return int(_ID.unpack_from(head, pos + jf.PUT_ID_AT)[0])
        if cmd not in _BEFORE_PUTS:
            return None  # a zero byte, READ_DONE data, or not a record: no guess
        pos += jf.record_length(head, pos)
    return None


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


def scan_segment(path: str | os.PathLike[str], ids: IdFilter = ALL_IDS, *,
                 chunk_size: int = CHUNK_SIZE, rows_per_chunk: int = ROWS_PER_CHUNK,
                 whole_max: int = WHOLE_FILE_MAX, mapped: bool = False) -> Iterator[PutChunk]:
    """The PUT records of one segment that `ids` selects, in id order, as chunks of
    raw bytes plus record offsets (`PutChunk.columns()` decodes one), reading the
    file whole when it has up to `whole_max` bytes (the chunks are views of those bytes),
    else `chunk_size` bytes at a time. A chunk ends where a read ends, or after the
    batch that brings it to `rows_per_chunk` rows.

    Our (sealed) files yield only records of batches whose check record verifies;
    files of another implementation yield every structurally valid record. Either
    way the scan stops quietly at a torn tail or a zero byte (the newest segment of
    a running server ends mid-batch while a write is in flight, or is still empty
    between its creation and its first write) and raises ScanError on corruption.

    With `mapped`, the file is mapped into memory (whatever its size) rather than read:
    the kernel copies none of its bytes. Only for a file no writer changes any more (a
    segment with a later one after it, or an archived one): a mapped file cut shorter
    while it is read kills the process (SIGBUS), and bytes changed after their batch was
    verified would go out unverified.
    """
    scanner = _Scanner(ids, rows_per_chunk, whole_max, mapped)
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return  # (the newest segment, just made: its head is not written yet)
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
    incarnation: int = 0  # the queue's life it belongs to (its INCARNATION record; 0 = none)
    #: (first_id, last_id, count) of each batch with items, ascending
    batches: list[tuple[int, int, int]] = field(default_factory=list)


def summarize_segment(path: str | os.PathLike[str], *,
                      chunk_size: int = CHUNK_SIZE) -> SegmentSummary:
    """Count a segment's items without building them (the decoder's batch fast path)."""
    out = SegmentSummary()
    with open(path, "rb") as f:
        head = jf.read_segment_head(f.read(jf.SEGMENT_HEAD_MAX))
        out.compacted = head.compacted is not None
        out.incarnation = head.incarnation
        f.seek(0)
        if not head.start:
            for chunk in scan_segment(path, chunk_size=chunk_size):  # another implementation's
                cols = chunk.columns()
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
            for chunk in scan_segment(path, IdFilter(after=max(after, first_id - 1),
                                                     upto=last_id)):
                cols = chunk.columns()
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
    """The state of one segment scan: the decoder verifies each batch and gives its PUT
    offsets (and flags); the wanted ones wait in `offsets` until their chunk is handed out,
    which happens before the decoder is given more bytes (so it still holds theirs)."""

    def __init__(self, ids: IdFilter, rows: int, whole_max: int = WHOLE_FILE_MAX,
                 mapped: bool = False) -> None:
        self.ids = ids
        self.whole_max = whole_max
        self.mapped = mapped
        self.skip = sorted(ids.skip)
        self.rows = rows
        self.dec = jf.RecordDecoder(jf.FileKind.WRITER)
        self.offsets: list[int | range] = []  # wanted PUT records not yet handed out
        self.count = 0  # how many (a range holds many)
        self.sealed = False  # a file of ours: a check record follows each chunk's records
        self.flags: dict[int, int] = {}  # their flags, where not 0
        self.headers: dict[int, bytes] = {}  # their headers blocks, where any
        self.whole: memoryview | None = None  # the file, when read whole

    def _held(self, start: int, end: int, pad: int = 0) -> bytes | memoryview:
        """The file's bytes [start, end) and `pad` more (zeros past the end of the file):
        a view of the file read whole, else a copy of the decoder's."""
        whole = self.whole
        if whole is None:
            return self.dec.copy_received(start, end, pad)
        if end + pad <= len(whole):
            return whole[start:end + pad]
        return b"".join((whole[start:end], bytes(end + pad - len(whole))))

    def _chunk(self, end: int) -> PutChunk:
        """The wanted records so far (all of them end before file offset `end`; in a
        sealed file, a check record of at least 8 bytes ends the last batch before it, so
        no padding is needed there)."""
        offsets, self.offsets = self.offsets, []
        count, self.count = self.count, 0
        flags, self.flags = self.flags, {}
        headers, self.headers = self.headers, {}
        first = offsets[0] if isinstance(offsets[0], int) else offsets[0][0]
        return PutChunk(self._held(first, end, 0 if self.sealed else len(_PAD)), first,
                        offsets, flags, headers, count)

    def _read_whole(self, f: BinaryIO) -> bytes | None:
        """Read a file of up to `whole_max` bytes (or map one of any size, with `mapped`)
        whole into the decoder (its first bytes returned), else None."""
        size = os.fstat(f.fileno()).st_size
        whole: bytes
        if self.mapped and size:
            # An mmap reads like bytes (an index gives an int, a slice bytes); its pages are
            # mapped at once (MAP_POPULATE) rather than a fault at a time. It stays mapped
            # while a chunk's view of it is alive.
            whole = cast(bytes, mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ))
        elif size > self.whole_max:
            return None
        else:
            whole = f.read()  # (one call, no zero-filled buffer first; may be cut meanwhile)
        self.dec.receive_all(whole)
        self.whole = memoryview(whole)
        return whole[:jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE]

    def run(self, f: BinaryIO, chunk_size: int) -> Iterator[PutChunk]:
        read = f.read
        head = self._read_whole(f)
        if head is None:
            head = read(jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE)
            self.dec.receive_data(head)
            if len(head) < jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE:
                self.dec.receive_data(b"")
        if jf.sealed_start(head):
            self.sealed = True
            yield from self._sealed(read, chunk_size)
        else:
            yield from self._plain(read, chunk_size)
        if self.offsets:
            yield self._chunk(self.dec.offset)

    def _sealed(self, read: Callable[[int], bytes], chunk_size: int) -> Iterator[PutChunk]:
        dec, ids, offsets = self.dec, self.ids, self.offsets
        filtered = not ids.is_all
        while True:
            mark = len(offsets)
            ev = dec.next_batch(offsets, self.flags, None, self.headers, ranges=True)
            if ev is jf.NEED_DATA:
                if offsets:
                    yield self._chunk(dec.batch_start)
                    offsets = self.offsets
                dec.receive_data(read(chunk_size))
                continue
            if not isinstance(ev, jf.Batch):
                return  # clean end, zero byte, or a torn tail (a write in flight)
            if filtered and ev.count:
                if 0 < ids.upto < ev.first_id:  # ids ascend: none further on is wanted
                    del offsets[mark:]
                    return
                self.count += self._filter(ev, mark)
            elif ev.count:
                self.count += ev.count
            if self.count >= self.rows:
                yield self._chunk(dec.batch_start)
                offsets = self.offsets

    def _filter(self, batch: jf.Batch, mark: int) -> int:
        """Keep only the wanted ones of the PUT offsets the decoder added from `mark` on;
        how many they are."""
        ids, offsets = self.ids, self.offsets
        if not ids.wants_range(batch.first_id, batch.last_id):
            del offsets[mark:]
            return 0
        k = bisect.bisect_left(self.skip, batch.first_id)
        skips = k < len(self.skip) and self.skip[k] <= batch.last_id
        if batch.first_id > ids.after and (ids.upto <= 0 or batch.last_id <= ids.upto) \
                and not skips:
            return batch.count  # the whole batch is wanted
        buf, base = self._held(batch.offset, batch.end), batch.offset
        lo, hi, skip = ids.after, ids.upto, ids.skip
        unpack = _ID.unpack_from
        offsets[mark:] = kept = [
            off for off in _expand(offsets[mark:])
            if lo < (xid := unpack(buf, off - base + jf.PUT_ID_AT)[0])
            and (hi <= 0 or xid <= hi) and xid not in skip]
        return len(kept)

    def _plain(self, read: Callable[[int], bytes], chunk_size: int) -> Iterator[PutChunk]:
        """A file without check records (another implementation): every valid record."""
        dec, ids = self.dec, self.ids
        lo, hi, skip = ids.after, ids.upto, ids.skip
        while True:
            ev = dec.next_event()
            if ev is jf.NEED_DATA:
                if self.offsets:
                    yield self._chunk(dec.offset)
                dec.receive_data(read(chunk_size))
                continue
            if not isinstance(ev, jf.Decoded):
                return
            rec = ev.record
            if not isinstance(rec, jf.Put):
                continue
            if rec.id <= lo or (hi > 0 and rec.id > hi) or rec.id in skip:
                continue
            # The PUT record ends the event (HEADERS, FLAGS and DELAY records before it are
            # decoded with it).
            at = ev.end - len(rec.data) - (jf.PUT_HEADER_SIZE if rec.expire_time_ms is None
                                           else jf.PUT_EXPIRE_HEADER_SIZE)
            if rec.flags:
                self.flags[at] = rec.flags
            if rec.headers:
                self.headers[at] = rec.headers
            self.offsets.append(at)
            self.count += 1
            if self.count >= self.rows:
                yield self._chunk(ev.end)
