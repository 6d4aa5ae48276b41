"""`queued dump` and `queued check`: a journal file's records, and a data directory's health.

Owns reading journal files for people: one line per record, one verdict per file. Every
decision about bytes is made by the journal format and recovery (queued.journal,
queued.storage.recovery); neither command ever modifies the files it reads.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

from queued.errors import CorruptRecordError
from queued.journal import format as jf
from queued.journal.headers import headers_text
from queued.storage.files import read_checkpoint, read_dedup, read_producers
from queued.storage.recovery import Inspection, TailState, inspect_segment

PREVIEW = 40


def _ms(ms: int) -> str:
    try:
        return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ms}ms"


def preview(data: bytes) -> str:
    """`data`'s first PREVIEW bytes, as Python shows bytes."""
    text = repr(data[:PREVIEW])
    return text + ("..." if len(data) > PREVIEW else "")


def describe(rec: jf.Record) -> str:
    """One human-readable line for one record."""
    if isinstance(rec, jf.Put):
        exp = f" expires={_ms(rec.expire_time_ms)}" if rec.expire_time_ms is not None else ""
        flags = f" flags={rec.flags}" if rec.flags else ""  # a FLAGS record led the PUT
        if isinstance(rec, jf.DelayedPut):  # a DELAY record led the PUT
            flags += f" due={_ms(rec.due_ms)}"
        if rec.headers:  # a HEADERS record led the PUT
            flags += f" headers=[{headers_text(rec.headers)}]"
        return (
            f"PUT id={rec.id} size={len(rec.data)} errors={rec.error_count} "
            f"added={_ms(rec.add_time_ms)}{exp}{flags} data={preview(rec.data)}"
        )
    if isinstance(rec, jf.ReadHead):
        return f"READ_HEAD id={rec.id}"
    if isinstance(rec, jf.ReadDone):
        shown = ",".join(str(i) for i in rec.ids[:20])
        more = f",... ({len(rec.ids)} ids)" if len(rec.ids) > 20 else ""
        return f"READ_DONE ids=[{shown}{more}]"
    if isinstance(rec, jf.Check):
        return f"CHECK covers={rec.length} crc32={rec.crc:08x}"
    if isinstance(rec, jf.Compacted):
        return f"COMPACTED replaces segments {rec.first_number}..{rec.last_number}"
    if isinstance(rec, jf.ReadErrors):
        shown = ",".join(f"{i}:{n}" for i, n in rec.entries[:20])
        more = f",... ({len(rec.entries)} ids)" if len(rec.entries) > 20 else ""
        return f"READ_ERRORS id:count=[{shown}{more}]"
    if isinstance(rec, jf.ReadDelays):
        shown = ",".join(f"{i}:{_ms(d)}" for i, d in rec.entries[:20])
        more = f",... ({len(rec.entries)} ids)" if len(rec.entries) > 20 else ""
        return f"READ_DELAYS id:due=[{shown}{more}]"
    if isinstance(rec, jf.Incarnation):
        return f"INCARNATION {rec.incarnation}"
    if isinstance(rec, jf.ProducerMark):
        return (f"PRODUCER id={preview(rec.producer)} sequence={rec.sequence} "
                f"first_id={rec.first_id} count={rec.count} at={_ms(rec.time_ms)}")
    if isinstance(rec, jf.DedupMark):
        return (f"DEDUP key={preview(rec.key)} first_id={rec.first_id} count={rec.count} "
                f"at={_ms(rec.time_ms)}")
    kind = f" kind={rec.kind}" if rec.kind else ""  # an extension record of a later release
    return (f"UNKNOWN command={rec.command}{kind} header_words={rec.header_words} "
            f"data={rec.data_size}")


def dump(path: Path, out: TextIO) -> int:
    """Print every record of a journal file; 0 when it ends cleanly, 1 otherwise."""
    dec = jf.RecordDecoder(kind=None)
    with path.open("rb") as f:
        while True:
            try:
                ev = dec.next_event()
            except CorruptRecordError as exc:
                print(f"{exc.offset:>10}  CORRUPT: {exc.reason}", file=out)
                return 1
            if ev is jf.NEED_DATA:
                dec.receive_data(f.read(1 << 20))
                continue
            if isinstance(ev, jf.Decoded):
                print(f"{ev.offset:>10}  {describe(ev.record)}", file=out)
                continue
            if isinstance(ev, jf.TornTail):
                print(f"{ev.offset:>10}  TORN: {ev.available} bytes of an unfinished record",
                      file=out)
                return 1
            assert isinstance(ev, jf.EndOfData)
            kind = dec.detected_kind.value if dec.detected_kind else "?"
            sealed = "with check records" if dec.sealed else "without check records (seed)"
            end = "a zero byte" if ev.zero_byte else "end of file"
            print(f"{ev.offset:>10}  END ({kind} file {sealed}; valid data ends at {end})",
                  file=out)
            return 0


#: `check` looks again at a segment whose tail is unfinished: a running server's batch is
#: written in milliseconds, so a tail that stays the same for CHECK_STABLE_LOOKS looks
#: CHECK_PAUSE seconds apart is damage, and one still changing after CHECK_MAX_LOOKS is
#: a segment being written.
CHECK_PAUSE = 0.1
CHECK_STABLE_LOOKS = 2
CHECK_MAX_LOOKS = 20
#: The verdicts that an append in progress can produce (a prefix of a valid batch).
UNFINISHED = (TailState.TORN_TAIL, TailState.GARBAGE_TAIL, TailState.ZERO_TAIL,
              TailState.SHORT_FILE)
EXIT_HEALTHY, EXIT_DAMAGE, EXIT_CANNOT_CHECK = 0, 1, 2


T = TypeVar("T")


def _check_small_file(name: str, out: TextIO, read: Callable[[], T], ok: Callable[[T], str],
                      bad: str) -> int:
    """`queued check` of a file read whole (a checkpoint, a producer snapshot): 1 when it
    is unreadable (FileNotFoundError goes up: removed while checking)."""
    try:
        value = read()
    except FileNotFoundError:
        raise
    except (CorruptRecordError, OSError) as exc:
        print(f"BAD   {name}: " + bad.format(exc), file=out)
        return 1
    print(f"ok    {name}: {ok(value)}", file=out)
    return 0


def _look(path: Path, number: int, pause: Callable[[float], object]) -> tuple[Inspection, bool]:
    """inspect_segment, again while the tail is unfinished: (the last verdict, whether
    the file kept changing between looks, i.e. a server is appending to it)."""
    found = inspect_segment(path, number)
    changed = False
    stable = 0
    for _ in range(CHECK_MAX_LOOKS):
        if found.state not in UNFINISHED or stable >= CHECK_STABLE_LOOKS:
            break
        pause(CHECK_PAUSE)
        again = inspect_segment(path, number)
        if (again.file_size, again.segment.inode) == (found.file_size, found.segment.inode):
            stable += 1
        else:
            changed, stable = True, 0
        found = again
    return found, changed and stable < CHECK_STABLE_LOOKS


def check(directory: Path, out: TextIO, *,
          pause: Callable[[float], object] = time.sleep) -> int:
    """Verify every journal file of a data directory: 0 when all are sound, 1 when
    something is damaged (OSError, e.g. an unreadable directory, is the caller's 2).

    Safe next to a running server: each segment is judged on one consistent prefix
    (inspect_segment reads no further than the file's size when opened); an unfinished
    batch at the end of a segment that keeps growing is being written, not damage; a
    file removed while we check (retired, compacted, its queue deleted) is skipped.
    """
    problems = busy = gone = 0
    names = sorted(os.listdir(directory))
    for name in names:
        parsed = jf.parse_file_name(name)
        path = directory / name
        if parsed is None or not path.is_file():
            continue
        if parsed.role is jf.FileRole.TEMP:
            print(f"WARN  {name}: temporary file (a checkpoint or compaction being written, "
                  f"or left by a crash: recovery removes it)", file=out)
            continue
        try:
            if parsed.role is jf.FileRole.CHECKPOINT:
                problems += _check_small_file(
                    name, out, functools.partial(read_checkpoint, path),
                    lambda cp: f"head={cp.head} done={len(cp.done)} ids",
                    "unreadable checkpoint ({}); recovery replays this reader from the "
                    "oldest segment")
                continue
            if parsed.role is jf.FileRole.DEDUP:
                problems += _check_small_file(
                    name, out, functools.partial(read_dedup, path),
                    lambda marks: f"{len(marks)} deduplication keys",
                    "unreadable key snapshot ({}); its keys fall back to at-least-once")
                continue
            if parsed.role is jf.FileRole.PRODUCERS:
                problems += _check_small_file(
                    name, out, functools.partial(read_producers, path),
                    lambda marks: f"{len(marks)} producers",
                    "unreadable producer snapshot ({}); its producers fall back to "
                    "at-least-once")
                continue
            found, growing = _look(path, parsed.number, pause)
        except FileNotFoundError:
            gone += 1
            print(f"gone  {name}: removed while checking (retired, compacted or deleted by "
                  f"the server)", file=out)
            continue
        seg = found.segment
        summary = f"{seg.count} items, ids {seg.first_id}..{seg.last_id}, {found.good_end} bytes"
        if found.state is TailState.CLEAN:
            sealed = "" if seg.sealed else " (seed format, no check records)"
            print(f"ok    {name}: {summary}{sealed}", file=out)
            continue
        if growing and found.state in UNFINISHED:
            busy += 1
            print(f"busy  {name}: a batch is being written at offset {found.good_end} (the "
                  f"file grew while checked); verified so far: {summary}", file=out)
            continue
        problems += 1
        if found.state is TailState.MIDDLE_CORRUPTION:
            print(f"BAD   {name}: CORRUPT at offset {found.good_end}: {found.reason}; "
                  f"recovery refuses to start (or quarantines, by config)", file=out)
        else:
            print(f"BAD   {name}: {found.reason}; recovery cuts {found.problem_bytes} bytes "
                  f"at offset {found.good_end} ({summary})", file=out)
    print(f"{len(names)} entries checked, {problems} with problems", file=out)
    if busy or gone:
        print(f"note: the directory changed while it was checked (a running server is using "
              f"it): {busy} segments were being written, {gone} files were removed; each "
              f"file was checked as far as it was complete", file=out)
    return EXIT_DAMAGE if problems else EXIT_HEALTHY
