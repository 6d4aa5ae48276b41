"""queued.storage.journal_scan (no Spark needed): segment listing, chunked scans of journals
written by the real journal code, id filters, torn tails of a live writer, summaries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from queued.config import JournalConfig
from queued.journal import format as jf
from queued.storage import journal_scan as js
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

T0 = 1_700_000_000_000


def data_for(i: int) -> bytes:
    return b"item-%d-" % i + bytes([i % 251]) * (i % 97)


async def fill(path: Path, queue: str, n: int, per_append: int = 7) -> None:
    async with open_data_dir(path, queue_config=lambda _: JournalConfig(journal_size=4096)) as dd:
        q = dd.queue(queue)
        i = 1
        while i <= n:
            batch = [data_for(j) for j in range(i, min(n, i + per_append - 1) + 1)]
            flags = i if i % 2 else 0  # memcache flags on every other append (FLAGS records)
            if i % 3 == 0:
                await q.append(batch, T0 + i, expire_time_ms=T0 + 10 * i, error_count=i % 5,
                               flags=flags)
            else:
                await q.append(batch, T0 + i, flags=flags)
            i += per_append


ALL = js.IdFilter()


def scan_all(path: Path, queue: str, ids: js.IdFilter = ALL, **kw: int) -> list[jf.Put]:
    out = []
    for seg in js.list_segments(path, {queue}):
        for chunk in js.scan_segment(seg.path, ids, **kw):
            cols = chunk.columns()
            out += [jf.Put(i, d, a, e, c, f) for i, a, e, c, d, f in zip(
                cols.ids, cols.add_times, cols.expire_times, cols.error_counts, cols.data,
                cols.flags, strict=True)]
    return out


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    trio.run(fill, tmp_path, "q", 300)
    trio.run(fill, tmp_path, "other", 20)
    (tmp_path / "q.1~~").write_bytes(b"junk")  # a temp file
    (tmp_path / "notes.txt").write_text("not a journal file")
    return tmp_path


def test_scan_matches_the_journal_in_any_chunking(journal: Path) -> None:
    expected = list(DataDir.open(journal).queues["q"].iter_puts(1))
    assert len(expected) == 300
    segs = js.list_segments(journal)
    assert {s.queue for s in segs} == {"q", "other"}
    assert all(jf.parse_file_name(Path(s.path).name).role is jf.FileRole.SEGMENT  # type: ignore[union-attr]
               for s in segs)
    assert len(js.list_segments(journal, {"q"})) > 5  # several segments
    assert scan_all(journal, "q") == expected
    assert scan_all(journal, "q", chunk_size=7, rows_per_chunk=3) == expected
    assert scan_all(journal, "q", chunk_size=7, rows_per_chunk=3, whole_max=0) == expected
    # Mapped into memory rather than read (a segment no writer changes any more): the same.
    assert scan_all(journal, "q", mapped=True) == expected
    assert scan_all(journal, "q", rows_per_chunk=3, whole_max=0, mapped=True) == expected
    assert {p.flags for p in expected} >= {0, 1, 15, 295}  # flags survive the scans too


def test_filters(journal: Path) -> None:
    all_ids = [p.id for p in scan_all(journal, "q")]
    f = js.IdFilter(after=50, upto=200, skip=frozenset({60, 61, 199}))
    assert [p.id for p in scan_all(journal, "q", f)] == [
        i for i in all_ids if 50 < i <= 200 and i not in (60, 61, 199)]
    cp = js.reader_checkpoint(journal, "q")  # none written: head 0
    assert cp.head == 0 and cp.done == ()


def test_torn_tail_ends_the_scan_quietly(journal: Path) -> None:
    last = js.list_segments(journal, {"q"})[-1]
    before = scan_all(journal, "q")
    with open(last.path, "ab") as f:  # half of a new batch, as a write in flight leaves it
        f.write(jf.encode_put(jf.Put(10_000, b"x" * 50, T0))[:30])
    assert scan_all(journal, "q") == before
    assert scan_all(journal, "q", mapped=True) == before


def test_corruption_is_an_error(journal: Path) -> None:
    first = js.list_segments(journal, {"q"})[0]
    with open(first.path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff")
    with pytest.raises(js.ScanError, match="queued check"):
        scan_all(journal, "q")
    with pytest.raises(js.ScanError, match="queued check"):
        scan_all(journal, "q", mapped=True)


def test_a_file_that_is_not_a_segment_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "q.1").write_bytes(b"not a journal at all")
    for mapped in (False, True):
        with pytest.raises(js.ScanError, match="magic"):
            list(js.scan_segment(tmp_path / "q.1", mapped=mapped))


def test_an_empty_segment_has_nothing_in_it(tmp_path: Path) -> None:
    # The newest segment of a running server is empty between its creation and its
    # first write: a reader that lists it then (a Spark stream's next offset) sees no
    # items, not corruption.
    (tmp_path / "q.1").write_bytes(b"")
    for mapped in (False, True):  # (an empty file cannot be mapped: it is not read at all)
        assert list(js.scan_segment(tmp_path / "q.1", mapped=mapped)) == []
    summary = js.summarize_segment(tmp_path / "q.1")
    assert (summary.count, summary.batches) == (0, [])


def test_summary_and_nth_id(journal: Path) -> None:
    segs = js.list_segments(journal, {"q"})
    summaries = [js.summarize_segment(s.path) for s in segs]
    assert sum(s.count for s in summaries) == 300
    assert [js.first_id(s.path) for s in segs] == [x.first_id for x in summaries]
    assert js.first_id(Path(segs[0].path).with_name("q.999")) is None  # no such file
    assert summaries[0].first_id == 1 and summaries[-1].last_id == 300
    s0 = summaries[0]
    assert js.nth_id_after(segs[0].path, s0, 0, 3) == (3, 3)
    assert js.nth_id_after(segs[0].path, s0, 2, s0.count + 10) == (s0.last_id, s0.count - 2)
    assert js.nth_id_after(segs[0].path, s0, s0.last_id, 5) == (0, 0)
    # Across segments' worth of a summary: a batch boundary and the middle of a batch.
    b0 = s0.batches[0]
    assert js.nth_id_after(segs[0].path, s0, 0, b0[2] + 1) == (b0[1] + 1, b0[2] + 1)


def test_reader_checkpoint(tmp_path: Path) -> None:
    (tmp_path / jf.checkpoint_name("q", "r")).write_bytes(jf.encode_checkpoint(5, [7, 9]))
    assert js.IdFilter.pending(js.reader_checkpoint(tmp_path, "q", "r")) == js.IdFilter(
        5, 0, frozenset({7, 9}))
    (tmp_path / jf.checkpoint_name("q", "bad")).write_bytes(b"garbage")
    with pytest.raises(js.ScanError, match="replay"):
        js.reader_checkpoint(tmp_path, "q", "bad")


def test_journal_scan_imports_no_spark() -> None:
    code = "import sys, queued.storage.journal_scan; assert 'pyspark' not in sys.modules; " \
           "assert 'pyarrow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
