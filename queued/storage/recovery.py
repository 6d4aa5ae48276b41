"""Scanning journal files at startup: verify, cut torn tails, salvage or refuse corruption.

Owns the decision "torn tail or corruption in the middle" for one file and the
crash-safe file surgery that follows (truncate, quarantine + salvage).
Synchronous file I/O only; callers run it in a worker thread. Never skips a
damaged region silently: every cut is returned in the report and logged.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from queued.config.policies import CorruptionPolicy
from queued.errors import BadMagicError, CorruptJournalError, CorruptRecordError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage.files import SegmentInfo, fsync_dir, write_file_atomic

# The broker imports SegmentInfo from here (kept working for it).
__all__ = ["Damage", "Inspection", "ScanResult", "SegmentInfo", "TailState", "inspect_segment",
           "scan_segment"]

log = logging.getLogger("queued.recovery")

READ_CHUNK = 4 << 20


@dataclass(frozen=True, slots=True)
class Damage:
    path: str
    offset: int
    length: int
    reason: str


@dataclass(slots=True)
class ScanResult:
    segment: SegmentInfo
    truncated_bytes: int = 0
    damage: list[Damage] = field(default_factory=list)
    quarantined_to: Path | None = None




class _Prefix:
    """An open file read no further than `size`, its length when it was opened: a
    consistent view of a segment that a running server may still be appending to."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size

    def read(self, n: int = -1) -> bytes:
        left = self.size - self.f.tell()
        if left <= 0:
            return b""
        return self.f.read(left if n < 0 else min(n, left))

    def seek(self, offset: int) -> None:
        self.f.seek(offset)


def _feed(f: _Prefix, dec: jf.RecordDecoder) -> bool:
    chunk = f.read(READ_CHUNK)
    dec.receive_data(chunk)
    return bool(chunk)


class TailState(enum.Enum):
    CLEAN = "clean"
    ZERO_TAIL = "zero bytes after the last record"
    TORN_TAIL = "torn tail"
    GARBAGE_TAIL = "garbage tail"
    SHORT_FILE = "segment header torn"
    MIDDLE_CORRUPTION = "corruption in the middle"


@dataclass(slots=True)
class Inspection:
    """A read-only verdict on one segment file."""

    segment: SegmentInfo
    file_size: int
    state: TailState
    good_end: int  # valid data ends here
    reason: str = ""

    @property
    def problem_bytes(self) -> int:
        return self.file_size - self.good_end


def inspect_segment(path: Path, number: int = 0) -> Inspection:
    """Verify one writer segment without changing it.

    The file is opened once and read no further than its size at that moment, so the
    verdict is about one consistent prefix even while a server appends to it (or
    renames a compacted file over it): `good_end` never passes `file_size`.
    """
    with path.open("rb") as raw:
        st = os.fstat(raw.fileno())
        return _inspect(_Prefix(raw, st.st_size), number, path, st.st_ino)


def _inspect(f: _Prefix, number: int, path: Path, inode: int) -> Inspection:
    info = SegmentInfo(number, path, size=0, inode=inode)
    file_size = f.size
    old_head = jf.WRITER_MAGIC + jf.OLD_EMPTY_CHECK  # an earlier release's (shorter) seal
    if file_size < jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE and f.read(len(old_head)) != old_head:
        f.seek(0)
        data = f.read()
        if data and not jf.WRITER_MAGIC.startswith(data[:4]):
            return Inspection(info, file_size, TailState.MIDDLE_CORRUPTION, 0,
                              f"not a journal segment (bad magic {data[:4].hex()})")
        if data == jf.WRITER_MAGIC:  # an empty segment written by a seed implementation
            info.size = file_size
            info.sealed = False
            return Inspection(info, file_size, TailState.CLEAN, file_size)
        return Inspection(info, file_size, TailState.SHORT_FILE, 0, "segment header torn")
    dec = jf.RecordDecoder(jf.FileKind.WRITER)
    f.seek(0)
    seg_head = jf.read_segment_head(f.read(jf.SEGMENT_HEAD_MAX))
    f.seek(0)
    info.sealed = bool(seg_head.start)
    info.incarnation = seg_head.incarnation
    if seg_head.compacted is not None:  # (a damaged head names none: the scan reports it)
        info.compacted_from = seg_head.compacted.first_number
    end_event: jf.EndOfData | jf.TornTail | CorruptRecordError
    try:
        end_event = _scan_sealed(f, dec, info) if info.sealed else _scan_plain(f, dec, info)
    except BadMagicError as exc:
        return Inspection(info, file_size, TailState.MIDDLE_CORRUPTION, 0,
                          f"not a journal segment: {exc.reason}")
    except CorruptRecordError as exc:
        end_event = exc
    if isinstance(end_event, jf.EndOfData):
        if end_event.offset == file_size:
            info.size = end_event.offset
            return Inspection(info, file_size, TailState.CLEAN, file_size)
        state, reason = TailState.ZERO_TAIL, TailState.ZERO_TAIL.value
        good_end = end_event.offset
    else:
        if isinstance(end_event, jf.TornTail):
            state = TailState.TORN_TAIL
            reason = f"torn tail: an unfinished batch at offset {end_event.offset}"
        else:
            state = TailState.GARBAGE_TAIL
            reason = f"garbage tail: {end_event}"
        # Sealed: the end of the last verified batch. Seed files have no check
        # codes, so every structurally valid record is trusted, as Kestrel does.
        good_end = max(info.size, jf.MAGIC_SIZE)
    info.size = good_end
    # Is anything verified after the damage? Then it is not a tail. (For an
    # unsealed file this also catches one of ours whose leading check is damaged.)
    f.seek(good_end)
    tail = f.read()
    later = jf.find_valid_check_after(tail, 0, good_end)
    if later is not None:
        why = "could not be ruled out" if later < 0 else "found"
        return Inspection(info, file_size, TailState.MIDDLE_CORRUPTION, good_end,
                          f"{reason}; verified batches after it {why}")
    return Inspection(info, file_size, state, good_end, reason)


def scan_segment(
    path: Path,
    number: int,
    policy: CorruptionPolicy,
    quarantine_dir: Path,
    *,
    tail_may_tear: bool = True,
) -> ScanResult:
    """Verify one writer segment and repair what recovery may repair (see module doc).

    `tail_may_tear` is False for a segment the writer fsynced before rotating
    away from it (every segment but the newest, unless fsync is "never"): a
    damaged end there is corruption, not a torn write.
    """
    found = inspect_segment(path, number)
    info = found.segment
    result = ScanResult(info)
    if found.state is TailState.CLEAN:
        return result
    tails = (TailState.TORN_TAIL, TailState.GARBAGE_TAIL, TailState.ZERO_TAIL)
    if not tail_may_tear and info.sealed and found.state in tails:
        found.state = TailState.MIDDLE_CORRUPTION
        found.reason += " (in an older segment, which was fsynced before the next one began)"
    if found.state is TailState.SHORT_FILE:
        # A crash while creating the segment: nothing was ever acknowledged in it.
        return _cut_short_file(path, found.file_size, result)
    if found.state is TailState.MIDDLE_CORRUPTION:
        if found.good_end < jf.MAGIC_SIZE:  # not a segment at all
            raise CorruptJournalError(f"{path}: {found.reason}")
        with path.open("rb") as f:
            f.seek(found.good_end)
            tail = f.read()
        return _middle_corruption(path, info, found.good_end, tail, found.reason, policy,
                                  quarantine_dir, result)
    _truncate(path, found.good_end, found.file_size, result, found.reason)
    info.size = found.good_end
    return result


def _scan_sealed(
    f: _Prefix, dec: jf.RecordDecoder, info: SegmentInfo
) -> jf.EndOfData | jf.TornTail:
    eof = False
    prev_last = 0
    while True:
        ev = dec.next_batch()
        if ev is jf.NEED_DATA:
            if eof:
                raise AssertionError("decoder wants data after end of file")
            eof = not _feed(f, dec)
            continue
        if isinstance(ev, jf.Batch):
            if ev.count and ev.first_id <= prev_last:
                raise CorruptRecordError(ev.offset, f"id {ev.first_id} after id {prev_last}")
            if ev.count:
                prev_last = ev.last_id
            info.note_batch(ev.offset, ev.end, ev.count, ev.first_id, ev.last_id, ev.data_bytes,
                            ev.delayed, ev.marks)
            continue
        assert isinstance(ev, jf.EndOfData | jf.TornTail)
        return ev


def _scan_plain(
    f: _Prefix, dec: jf.RecordDecoder, info: SegmentInfo
) -> jf.EndOfData | jf.TornTail | CorruptRecordError:
    """A file from another implementation of the seed: trust structurally valid records.
    `info.size` ends up at the end of the last good PUT, where a cut would go."""
    try:
        while True:
            ev = dec.next_event()
            if ev is jf.NEED_DATA:
                _feed(f, dec)
                continue
            if isinstance(ev, jf.Decoded):
                rec = ev.record
                if isinstance(rec, jf.Put):
                    if rec.id <= info.last_id:
                        raise CorruptRecordError(ev.offset, f"id {rec.id} after {info.last_id}")
                    info.note_batch(ev.offset, ev.end, 1, rec.id, rec.id, len(rec.data),
                                    1 if type(rec) is jf.DelayedPut else 0)
                continue
            assert isinstance(ev, jf.EndOfData | jf.TornTail)
            return ev
    except BadMagicError:
        raise
    except CorruptRecordError as exc:
        return exc


def _truncate(path: Path, good_end: int, file_size: int, result: ScanResult, why: str) -> None:
    cut = file_size - good_end
    if cut <= 0:
        return
    log.warning("recovery: %s: cut %d bytes at offset %d (%s)", path.name, cut, good_end, why,
                extra={"event": "recovery_truncate", "segment": path.name, "offset": good_end,
                       "cut_bytes": cut, "reason": why})
    fd = fileio.open_fd(path, os.O_WRONLY)
    try:
        fileio.ftruncate(fd, good_end)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    result.truncated_bytes += cut
    result.damage.append(Damage(path.name, good_end, cut, why))


def _cut_short_file(path: Path, file_size: int, result: ScanResult) -> ScanResult:
    # Rewrite as an empty sealed segment so it scans cleanly next time.
    result.segment.size = jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE
    result.truncated_bytes = file_size
    if file_size:
        result.damage.append(Damage(path.name, 0, file_size, "segment header torn"))
    log.warning("recovery: %s: rewrote a torn segment header (%d bytes)", path.name, file_size,
                extra={"event": "recovery_torn_header", "segment": path.name,
                       "cut_bytes": file_size})
    write_file_atomic(path, jf.WRITER_MAGIC + jf.EMPTY_CHECK)
    return result




def _middle_corruption(
    path: Path,
    info: SegmentInfo,
    good_end: int,
    tail: bytes,
    reason: str,
    policy: CorruptionPolicy,
    quarantine_dir: Path,
    result: ScanResult,
) -> ScanResult:
    if policy is CorruptionPolicy.REFUSE:
        raise CorruptJournalError(
            f"{path}: corruption at offset {good_end} ({reason}) with verified data after it; "
            f"refusing to start. Inspect with `queued check`, or set corruption = \"quarantine\" "
            f"to keep a copy aside and salvage every verified batch."
        )
    # Salvage: keep verified batches before the damage and every verified run
    # after it. Their records are re-sealed, since check codes depend on offsets.
    runs: list[bytes] = []  # record bytes of verified batches, checks stripped
    damage: list[Damage] = []
    pos = 0
    prev_last = info.last_id
    while pos < len(tail):
        found = jf.find_valid_check_after(tail, pos, good_end)
        if found is None or found < 0:
            damage.append(Damage(path.name, good_end + pos, len(tail) - pos, reason))
            break
        check = jf.check_at(tail, found)
        assert check is not None
        length, _, check_size = check
        start = found - length
        if start > pos:
            damage.append(Damage(path.name, good_end + pos, start - pos, reason))
        dec = jf.RecordDecoder(jf.FileKind.WRITER, start_offset=good_end + start,
                               expect_magic=False)
        dec.receive_data(tail[start:])
        dec.receive_data(b"")
        end = start
        try:
            while True:
                ev = dec.next_batch()
                if not isinstance(ev, jf.Batch):
                    break
                if ev.count and ev.first_id <= prev_last:
                    damage.append(Damage(path.name, ev.offset, ev.end - ev.offset,
                                         "verified batch with ids going backwards"))
                    break
                if ev.count:
                    prev_last = ev.last_id
                runs.append(tail[end : ev.end - good_end - ev.check_size])
                end = ev.end - good_end
        except CorruptRecordError:
            pass
        pos = max(end, found + check_size)
        reason = "damaged region between verified batches"
    with path.open("rb") as f:
        head = f.read(good_end)
    # Verified batches before the damage keep their offsets; a damaged seal is renewed.
    if head[: jf.MAGIC_SIZE] != jf.WRITER_MAGIC or not jf.sealed_start(head):
        head = jf.WRITER_MAGIC + jf.EMPTY_CHECK
    salvaged = bytearray(head)
    for records in runs:
        salvaged += jf.seal(records, len(salvaged))
    fileio.mkdir(quarantine_dir)
    kept = quarantine_dir / f"{path.name}.{int(time.time() * 1000)}"
    fileio.link(path, kept)  # the original stays in place until the salvage is renamed over it
    fsync_dir(quarantine_dir)
    write_file_atomic(path, bytes(salvaged))
    for d in damage:
        log.error(
            "recovery: %s: lost %d bytes at offset %d (%s); original kept at %s",
            d.path, d.length, d.offset, d.reason, kept,
            extra={"event": "recovery_quarantine", "segment": d.path, "offset": d.offset,
                   "lost_bytes": d.length, "reason": d.reason, "kept_at": str(kept)},
        )
    result.damage.extend(damage)
    result.quarantined_to = kept
    # Rescan the salvaged file for its index; it is fully verified now.
    again = scan_segment(path, info.number, CorruptionPolicy.REFUSE, quarantine_dir)
    result.segment = again.segment
    result.segment.inode = path.stat().st_ino
    result.truncated_bytes = max(0, good_end + len(tail) - len(salvaged))
    return result
