"""queued.spark.arrow (numpy and pyarrow, no SparkSession): the vectorised decoding of
scanned chunks equals the pure-Python decoding and the records that were written, for
random journals in any chunking, with id filters and the expiry cut-off."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queued.journal import format as jf
from queued.storage import journal_scan as js

try:
    from queued.spark import arrow
    from queued.spark.arrow import ARROW_SCHEMA, chunk_to_arrow
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"numpy/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)

T0 = 1_700_000_000_000

puts_strategy = st.lists(
    st.tuples(st.binary(max_size=300), st.integers(0, 10**6),
              st.one_of(st.none(), st.integers(0, 10**6)), st.integers(0, 2**31 - 1),
              st.just(0) | st.integers(0, jf.MAX_FLAGS)),  # memcache flags: 0 most often
    max_size=60)


def write_segment(path: Path, puts: list[jf.Put], batch_sizes: list[int],
                  sealed: bool = True) -> None:
    """A segment as the journal writes it (sealed batches), or as another implementation
    does (records only, no check records)."""
    out = bytearray(jf.WRITER_MAGIC)
    if sealed:
        out += jf.EMPTY_CHECK
    i, k = 0, 0
    while i < len(puts):
        n = max(1, batch_sizes[k % len(batch_sizes)]) if batch_sizes else 1
        body = b"".join(jf.encode_put(p) for p in puts[i:i + n])
        if sealed:
            out += jf.seal(body, len(out))
        else:
            out += body
        i, k = i + n, k + 1
    path.write_bytes(bytes(out))


def arrow_rows(queue: str, path: Path, ids: js.IdFilter, live_at: int = 0,
               flags: bool = False, **kw: int) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for chunk in js.scan_segment(path, ids, **kw):
        batch = chunk_to_arrow(queue, chunk, live_at, flags)
        assert batch.schema == (arrow.ARROW_SCHEMA_FLAGS if flags else ARROW_SCHEMA)
        out += [(r["queue"], r["id"], r["add_time"], r["expire_time"], r["error_count"],
                 r["data"], *([r["flags"]] if flags else [])) for r in batch.to_pylist()]
    return out


def python_rows(queue: str, path: Path, ids: js.IdFilter, **kw: int) -> list[jf.Put]:
    out: list[jf.Put] = []
    for chunk in js.scan_segment(path, ids, **kw):
        c = chunk.columns()
        out += [jf.Put(i, bytes(d), a, e, n, f) for i, a, e, n, d, f in zip(
            c.ids, c.add_times, c.expire_times, c.error_counts, c.data, c.flags, strict=True)]
    return out


def as_row(queue: str, p: jf.Put, flags: bool = False) -> tuple[object, ...]:
    import datetime as dt

    def ts(ms: int | None) -> dt.datetime | None:
        if ms is None:
            return None
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=ms)

    return (queue, p.id, ts(p.add_time_ms), ts(p.expire_time_ms), p.error_count, p.data,
            *([p.flags] if flags else []))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=puts_strategy, batch_sizes=st.lists(st.integers(1, 9), max_size=4),
       sealed=st.booleans(), chunk_size=st.sampled_from([1, 7, 64, 1 << 20]),
       whole=st.booleans(),
       rows=st.sampled_from([1, 3, 1000]), after=st.integers(0, 70), upto=st.integers(0, 70),
       skip=st.frozensets(st.integers(1, 70), max_size=8), live_at=st.integers(0, 10**6))
def test_arrow_equals_python_and_the_records(
        tmp_path: Path, raw: list[tuple[bytes, int, int | None, int, int]],
        batch_sizes: list[int],
        sealed: bool, chunk_size: int, whole: bool, rows: int, after: int, upto: int,
        skip: frozenset[int], live_at: int) -> None:
    puts = [jf.Put(i + 1, data, T0 + added, None if exp is None else T0 + exp, errors, flags)
            for i, (data, added, exp, errors, flags) in enumerate(raw)]
    path = tmp_path / "q.1"
    write_segment(path, puts, batch_sizes, sealed)
    ids = js.IdFilter(after, upto, skip)
    wanted = [p for p in puts
              if p.id > after and (upto <= 0 or p.id <= upto) and p.id not in skip]
    # (whole: the file read in one call and its chunks views of it; else in chunk_size reads)
    kw = {"chunk_size": chunk_size, "rows_per_chunk": rows,
          "whole_max": js.WHOLE_FILE_MAX if whole else 0}
    assert python_rows("q", path, ids, **kw) == wanted
    assert arrow_rows("q", path, ids, **kw) == [as_row("q", p) for p in wanted]
    cut = T0 + live_at
    assert arrow_rows("q", path, ids, cut, **kw) == [
        as_row("q", p) for p in wanted if p.expire_time_ms is None or p.expire_time_ms > cut]
    # With the flags column (include_flags): each item's flags, expired ones left out alike.
    assert arrow_rows("q", path, ids, cut, True, **kw) == [
        as_row("q", p, True) for p in wanted
        if p.expire_time_ms is None or p.expire_time_ms > cut]


def test_a_torn_tail_and_an_empty_chunk(tmp_path: Path) -> None:
    puts = [jf.Put(i, b"x" * i, T0, T0 + i if i % 2 else None, 0) for i in range(1, 30)]
    path = tmp_path / "q.1"
    write_segment(path, puts, [4])
    with path.open("ab") as f:  # half of a batch: a write in flight
        f.write(jf.encode_put(jf.Put(30, b"y" * 40, T0))[:20])
    assert arrow_rows("q", path, js.IdFilter()) == [as_row("q", p) for p in puts]
    # Everything expired: no rows, and the right schema.
    chunk = next(js.scan_segment(path, js.IdFilter(after=0, upto=1)))
    assert chunk_to_arrow("q", chunk, T0 + 10).num_rows == 0
    assert chunk_to_arrow("q", js.PutChunk(b"", 0, []), 0).schema == ARROW_SCHEMA
    assert chunk_to_arrow("q", js.PutChunk(b"", 0, []), 0, True).schema == (
        arrow.ARROW_SCHEMA_FLAGS)
    assert chunk_to_arrow("q", chunk, T0 + 10, True).num_rows == 0


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 30), st.booleans()),
                     min_size=1, max_size=5),
       batch=st.integers(50, 400), whole=st.booleans(), after=st.integers(0, 40))
def test_arrow_copies_runs_of_same_sized_items_right(
        tmp_path: Path, runs: list[tuple[int, int, bool]], batch: int, whole: bool,
        after: int) -> None:
    # Items in runs of one size (a writer's batches), some with an expiry (a longer
    # header): copied run by run (arrow._data_by_runs), they equal the records.
    puts: list[jf.Put] = []
    for count, size, expiring in runs:
        for _ in range(count):
            i = len(puts) + 1
            puts.append(jf.Put(i, bytes([i % 256]) * size, T0 + i,
                               T0 + 10**9 if expiring else None, i % 3, 0))
    path = tmp_path / "q.1"
    write_segment(path, puts, [batch])
    ids = js.IdFilter(after)
    kw = {"whole_max": js.WHOLE_FILE_MAX if whole else 0, "chunk_size": 4096}
    assert arrow_rows("q", path, ids, **kw) == [as_row("q", p) for p in puts if p.id > after]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.integers(1, 1500), st.integers(0, 40),
                               st.sampled_from(["plain", "expiring", "flagged", "mixed"])),
                     min_size=1, max_size=4),
       batch=st.integers(300, 2500), how=st.sampled_from(["read", "whole", "mapped"]),
       rows=st.sampled_from([100, 65536]),
       after=st.integers(0, 40), skip=st.frozensets(st.integers(1, 900), max_size=3),
       live_at=st.integers(0, 2000))
def test_runs_copied_column_by_column_equal_the_records(
        tmp_path: Path, runs: list[tuple[int, int, str]], batch: int, how: str,
        rows: int, after: int, skip: frozenset[int], live_at: int) -> None:
    # Runs of same-sized items (the scan hands each over as one range: arrow._by_runs),
    # some expiring at times around the cut, some led by a FLAGS record, some runs broken
    # by an item of another size or with an expiry: every column equals the records, with
    # and without the flags column, the id filter and the expiry cut.
    puts: list[jf.Put] = []
    for count, size, kind in runs:
        for k in range(count):
            i = len(puts) + 1
            odd = kind == "mixed" and k % 397 == 5
            expires = kind == "expiring" or (odd and k % 2 == 1)
            puts.append(jf.Put(i, bytes([i % 256]) * (size + (3 if odd else 0)), T0 + i,
                               T0 + (i * 7) % 2000 if expires else None, i % 5,
                               i if kind == "flagged" and i % 300 == 0 else 0))
    path = tmp_path / "q.1"
    write_segment(path, puts, [batch])
    ids = js.IdFilter(after, 0, skip)
    wanted = [p for p in puts if p.id > after and p.id not in skip]
    # (read in pieces, read whole, or mapped into memory)
    kw = {"whole_max": 0 if how == "read" else js.WHOLE_FILE_MAX, "chunk_size": 1 << 16,
          "rows_per_chunk": rows, "mapped": how == "mapped"}
    assert python_rows("q", path, ids, **kw) == wanted
    cut = T0 + live_at
    live = [p for p in wanted if p.expire_time_ms is None or p.expire_time_ms > cut]
    assert arrow_rows("q", path, ids, **kw) == [as_row("q", p) for p in wanted]
    assert arrow_rows("q", path, ids, cut, **kw) == [as_row("q", p) for p in live]
    assert arrow_rows("q", path, ids, cut, True, **kw) == [as_row("q", p, True) for p in live]


def test_runs_are_handed_over_as_ranges(tmp_path: Path) -> None:
    # The case the runs path is for: a writer's batches of same-sized items come as a few
    # ranges (not one offset per record), and the rows equal the records.
    puts = [jf.Put(i, b"%05d" % i * 40, T0 + i, None, 0) for i in range(1, 5001)]
    path = tmp_path / "q.1"
    write_segment(path, puts, [2000])
    chunks = list(js.scan_segment(path))
    assert sum(len(c) for c in chunks) == 5000
    assert sum(len(c.spans) for c in chunks) < 20
    assert any(isinstance(s, range) for c in chunks for s in c.spans)
    assert arrow_rows("q", path, js.IdFilter()) == [as_row("q", p) for p in puts]


async def _real_journal(path: Path) -> None:
    """Appends as the server makes them, each of many same-sized items (runs) but for the
    records between: FLAGS, DELAY, HEADERS (kind 7) before some PUTs, PRODUCER and DEDUP
    (kind 8) marks after them, expiring items, segments rotated at 256 KiB; then most of
    the first ids consumed and the journal compacted."""
    from queued.config import JournalConfig
    from queued.journal.headers import encode_headers
    from queued.storage.journal import wait_durable
    from queued.storage.opening import open_data_dir

    async with open_data_dir(path, queue_config=lambda _: JournalConfig(
            journal_size=1 << 18)) as dd:
        q = dd.queue("q")
        for k in range(40):
            n = 3 if k in (27, 31) else 600 + 97 * (k % 5)  # (led items are not in runs)
            datas = [b"%07d" % (k * 1000 + j) + b"." * (k % 7 * 9) for j in range(n)]
            headers = ([encode_headers({"h": str(j)}) if j % 301 == 3 else b"" for j in range(n)]
                       if k % 4 == 1 else None)
            _, ticket = q.append_nowait(
                datas, T0 + k, T0 + 10 * k if k % 3 == 0 else None, k % 4,
                flags=k if k == 27 else 0, due_ms=T0 + 5 if k == 31 else None,
                producer=(b"p%d" % k, 1) if k % 7 == 4 else None, headers=headers,
                dedup=[(0, n, b"key%d" % k)] if k % 8 == 6 else ())
            await wait_durable(ticket)
        # Consumed up to 5000, then all but some stragglers up to 15000: compaction removes
        # segments and rewrites others (a COMPACTED record first, the stragglers after).
        await q.write_checkpoint("", 5000, [i for i in range(5001, 15001) if i % 997])
        result = await q.compact()
        assert result.removed and result.rewritten


@pytest.mark.parametrize("mapped", [False, True])
def test_rows_of_a_real_journal_equal_the_pure_python_decoding(tmp_path: Path,
                                                                mapped: bool) -> None:
    # The columns chunk_to_arrow builds (runs copied column by column) against the
    # record-by-record decoding of the same chunks (PutChunk.columns), with flags and
    # headers, every record kind a journal holds around the PUTs; and the ids the
    # server's own recovery reads.
    import trio

    from queued.journal.headers import header_pairs
    from queued.storage.datadir import DataDir

    trio.run(_real_journal, tmp_path)
    segs = js.list_segments(tmp_path)
    assert len(segs) > 1
    got: list[tuple[object, ...]] = []
    want: list[tuple[object, ...]] = []
    runs = 0
    for seg in segs:
        for chunk in js.scan_segment(seg.path, mapped=mapped):
            runs += sum(isinstance(s, range) for s in chunk.spans)
            batch = chunk_to_arrow("q", chunk, 0, True, True)
            got += [(r["id"], r["add_time"], r["expire_time"], r["error_count"], r["data"],
                     r["flags"], [(h["key"], h["value"]) for h in r["headers"]]
                     if r["headers"] is not None else None) for r in batch.to_pylist()]
            c = chunk.columns()
            for xid, added, expire, errors, data, flags, block in zip(
                    c.ids, c.add_times, c.expire_times, c.error_counts, c.data, c.flags,
                    c.headers, strict=True):
                row = as_row("q", jf.Put(xid, data, added, expire, errors, flags), True)
                want.append((*row[1:], header_pairs(block) if block else None))
    assert runs > 0
    assert got == want
    assert [g[0] for g in got] == [p.id for p in DataDir.open(tmp_path).queues["q"]
                                   .iter_puts(1)]
    assert any(g[5] for g in got) and any(g[6] for g in got) and any(g[2] for g in got)
