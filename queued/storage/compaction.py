"""Compaction of one queue's journal: retire dead segments, rewrite straggler-pinned ones.

Owns the plan (pure: segments + durable checkpoints in, what to do out) and
its crash-safe execution. Never removes a record that some reader's durable
checkpoint still needs, and never touches the newest segment (the writer's).
Rewrite protocol: needed records -> `q.<last>~~` (led by a COMPACTED record
naming the replaced range), fsync, rename over `q.<last>`, fsync the
directory, then retire the older originals; recovery finishes a crashed one.
Execution is given what it works on (the live segment list, a segment reader,
where retired segments go), so it imports no journal or data directory.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from queued.config.policies import DataDirConfig
from queued.errors import JournalError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage.files import Checkpoint, SegmentInfo, fsync_dir

#: Records per batch in a rewritten segment.
REWRITE_BATCH_BYTES = 1 << 20

#: Reads a segment's PUT records with from_id <= id (<= to_id): QueueJournal.iter_segment.
SegmentReader = Callable[[SegmentInfo, int, int | None], Iterator[jf.Put]]


class SegmentStore(Protocol):
    """Where retired segments go: the data directory (queued.storage.datadir.DataDir)."""

    @property
    def config(self) -> DataDirConfig: ...

    def retire_segments(self, segs: list[SegmentInfo], /) -> None:
        """Delete or archive `segs`, durably."""
        ...

    def copy_to_archive(self, path: Path, /) -> None:
        """A durable copy of `path` in the archive (the original stays)."""
        ...

    def settle_intents(self) -> None:
        """No intent log record stands for a segment from now on (before a replace)."""
        ...


@dataclass(frozen=True, slots=True)
class CompactionResult:
    removed: int = 0
    archived: int = 0
    rewritten: int = 0  # segments replaced by rewrites
    bytes_freed: int = 0


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    dead: tuple[SegmentInfo, ...]
    runs: tuple[tuple[SegmentInfo, ...], ...]  # consecutive segments to rewrite into one


def _done_between(done: tuple[int, ...], lo: int, hi: int) -> int:
    """How many ids of sorted `done` lie in [lo, hi]."""
    return bisect.bisect_right(done, hi) - bisect.bisect_left(done, lo)


def live_upper_bound(seg: SegmentInfo, readers: dict[str, Checkpoint]) -> int:
    """At most this many of `seg`'s records are still needed by some reader."""
    if not seg.count:
        return 0
    total = 0
    for cp in readers.values():
        if cp.head >= seg.last_id:
            continue
        above_head = seg.count if cp.head < seg.first_id else min(seg.count, seg.last_id - cp.head)
        if seg.count == seg.last_id - seg.first_id + 1:
            # Dense ids: every done id in range is one of this segment's records.
            # (A segment with gaps — a compaction output, ids burnt by a refused
            # write — may not hold them, so nothing is subtracted there.)
            lo = max(cp.head + 1, seg.first_id)
            above_head -= _done_between(cp.done, lo, seg.last_id)
        total += max(0, above_head)
    return min(seg.count, total)


def plan_compaction(
    segments: list[SegmentInfo], readers: dict[str, Checkpoint], live_ratio: float
) -> CompactionPlan:
    """Pure: which closed segments are dead, which runs are worth rewriting."""
    dead: list[SegmentInfo] = []
    runs: list[tuple[SegmentInfo, ...]] = []
    run: list[SegmentInfo] = []
    for seg in segments[:-1]:  # the newest segment belongs to the writer
        live = live_upper_bound(seg, readers)
        if live == 0:
            dead.append(seg)
            continue
        if live <= live_ratio * seg.count and live < seg.count:
            run.append(seg)
            continue
        if run:
            runs.append(tuple(run))
            run = []
    if run:
        runs.append(tuple(run))
    return CompactionPlan(tuple(dead), tuple(runs))


def needed(put_id: int, readers: list[tuple[int, frozenset[int]]]) -> bool:
    return any(put_id > head and put_id not in done for head, done in readers)


def rewrite_run(
    run: tuple[SegmentInfo, ...],
    readers: dict[str, Checkpoint],
    read: SegmentReader,
    store: SegmentStore,
) -> SegmentInfo | None:
    """Synchronous: write the run's needed records into one segment and rename it over
    the run's last segment. The caller publishes it, then retires run[:-1]. Returns
    None when nothing was needed (then the whole run is retired here)."""
    tmp = run[-1].path.with_name(jf.temp_name(run[-1].path.name))
    try:
        return _rewrite_run(run, readers, read, store, tmp)
    except OSError as exc:
        fileio.unlink(tmp, missing_ok=True)  # do not hold disk space when space is what we lack
        raise JournalError(f"compaction of {run[0].path.name}..{run[-1].path.name} "
                           f"failed: {exc}") from exc


def _rewrite_run(
    run: tuple[SegmentInfo, ...],
    readers: dict[str, Checkpoint],
    read: SegmentReader,
    store: SegmentStore,
    tmp: Path,
) -> SegmentInfo | None:
    snapshot = [(cp.head, frozenset(cp.done)) for cp in readers.values()]
    last = run[-1]
    out = SegmentInfo(last.number, last.path, size=0, compacted_from=run[0].number)
    out.incarnation = last.incarnation
    head = jf.segment_head(last.incarnation, jf.Compacted(run[0].number, last.number))
    fd = fileio.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fileio.write_all(fd, head)
        offset = len(head)
        batch = bytearray()
        count = first = last_id = 0

        def flush() -> None:
            nonlocal batch, offset, count, first
            if not batch:
                return
            sealed = jf.seal(batch, offset)
            fileio.write_all(fd, sealed)
            out.note_batch(offset, offset + len(sealed), count, first, last_id)
            offset += len(sealed)
            batch = bytearray()
            count = first = 0

        # No reader needs an id at or below every reader's head: the reads start past
        # the lowest head (from the segment's nearest indexed batch), rather than
        # decoding the consumed part of the run (most of it, as a rule) only to drop it.
        lowest = min((h for h, _ in snapshot), default=None)
        if lowest is not None:  # (no readers: nothing is needed)
            for seg in run:
                for put in read(seg, max(seg.first_id, lowest + 1), None):
                    if not needed(put.id, snapshot):
                        continue
                    batch += jf.encode_put(put)
                    if not count:
                        first = put.id
                    count += 1
                    last_id = put.id
                    if len(batch) >= REWRITE_BATCH_BYTES:
                        flush()
        flush()
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    out.size = offset
    if not out.count:
        fileio.unlink(tmp)
        store.retire_segments(list(run))
        return None
    if store.config.archive_dir is not None and last.compacted_from is None:
        # The rename below replaces the original: keep its records in the archive first.
        store.copy_to_archive(last.path)
    store.settle_intents()  # no intent log record may stand for the file replaced
    fileio.replace(tmp, last.path)
    fsync_dir(last.path.parent)
    out.inode = last.path.stat().st_ino
    return out


async def compact(
    segments: list[SegmentInfo],
    readers: dict[str, Checkpoint],
    live_ratio: float,
    read: SegmentReader,
    store: SegmentStore,
) -> CompactionResult:
    """Carry out plan_compaction on a journal's live `segments` list, which it updates
    in place (the new list is published before any original goes, so read-back in
    another thread finds every record). `readers`: the durable checkpoints to respect.
    The caller holds off other maintenance of the same journal while this runs."""
    if not readers:
        return CompactionResult()
    plan = plan_compaction(segments, readers, live_ratio)
    removed = rewritten = freed = 0
    if plan.dead:
        await trio.to_thread.run_sync(store.retire_segments, list(plan.dead))
        for seg in plan.dead:
            segments.remove(seg)
            freed += seg.size
        removed = len(plan.dead)
    for run in plan.runs:
        new = await trio.to_thread.run_sync(rewrite_run, run, readers, read, store)
        # Publish the new list before the originals go, so read-back finds its records.
        at = segments.index(run[0])
        del segments[at : at + len(run)]
        if new is not None:
            segments.insert(at, new)
            await trio.to_thread.run_sync(store.retire_segments, list(run[:-1]))
        freed += sum(s.size for s in run) - (new.size if new else 0)
        rewritten += len(run)
    archived = removed if store.config.archive_dir is not None else 0
    return CompactionResult(removed, archived, rewritten, freed)
