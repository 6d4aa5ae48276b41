"""Compaction: the pure plan on hand-made segments and checkpoints, and its execution on
real files (rewrite, retire, archive), including what recovery finds after a crash at
each step of the rewrite protocol."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from journal_util import T0, cfg, data_for, segments

from queued.config import DataDirConfig
from queued.journal import format as jf
from queued.storage import compaction
from queued.storage.compaction import CompactionResult, live_upper_bound, plan_compaction
from queued.storage.datadir import DataDir
from queued.storage.files import Checkpoint, SegmentInfo, read_segment
from queued.storage.opening import open_data_dir

# -- the plan (pure) --------------------------------------------------------------------


def seg_info(number: int, first: int, last: int) -> SegmentInfo:
    return SegmentInfo(number, Path(f"q.{number}"), size=1000, count=last - first + 1,
                       first_id=first, last_id=last)


def test_plan_compaction_dead_and_straggler_runs() -> None:
    segs = [seg_info(1, 1, 100), seg_info(2, 101, 200), seg_info(3, 201, 300),
            seg_info(4, 301, 400), seg_info(5, 401, 500)]
    # Reader a: consumed through 150 except the open read 120 ... but head stuck at 119,
    # and everything up to 300 confirmed out of order.
    done = tuple(i for i in range(120, 301) if i != 120 and i != 250)
    readers = {"a": Checkpoint(119, done), "b": Checkpoint(400, ())}
    plan = plan_compaction(segs, readers, 0.25)
    assert [s.number for s in plan.dead] == [1]
    assert [[s.number for s in run] for run in plan.runs] == [[2, 3]]
    assert live_upper_bound(segs[3], readers) == 100  # reader a needs all of 301..400
    # The newest segment is never touched, whatever the checkpoints say.
    assert all(s.number != 5 for s in plan.dead)
    assert plan_compaction(segs, {"a": Checkpoint(10_000)}, 0.25).dead == tuple(segs[:-1])


def test_the_newest_segment_is_never_planned() -> None:
    only = [seg_info(1, 1, 100)]
    assert plan_compaction(only, {"": Checkpoint(10_000)}, 1.0) == compaction.CompactionPlan(
        (), ()
    )
    segs = [seg_info(1, 1, 100), seg_info(2, 101, 200)]
    plan = plan_compaction(segs, {"": Checkpoint(10_000)}, 1.0)
    assert plan.dead == (segs[0],) and plan.runs == ()


def test_a_segment_is_dead_only_when_every_reader_is_past_it() -> None:
    segs = [seg_info(1, 1, 100), seg_info(2, 101, 200), seg_info(3, 201, 300)]
    ahead, behind = Checkpoint(250), Checkpoint(50)
    assert plan_compaction(segs, {"a": ahead, "b": behind}, 0.0).dead == ()
    # b confirmed 51..100 out of order: with dense ids nothing of segment 1 is needed.
    done = Checkpoint(50, tuple(range(51, 101)))
    assert plan_compaction(segs, {"a": ahead, "b": done}, 0.0).dead == (segs[0],)
    assert live_upper_bound(segs[1], {"a": ahead, "b": done}) == 100


def test_live_ratio_is_the_rewrite_threshold() -> None:
    segs = [seg_info(1, 1, 100), seg_info(2, 101, 200)]
    quarter = {"": Checkpoint(75)}  # ids 76..100 still needed: 25 of 100
    assert live_upper_bound(segs[0], quarter) == 25
    assert plan_compaction(segs, quarter, 0.25).runs == ((segs[0],),)
    assert plan_compaction(segs, quarter, 0.24).runs == ()
    # A segment every record of which is needed is never rewritten, whatever the ratio.
    assert plan_compaction(segs, {"": Checkpoint(0)}, 1.0).runs == ()


def test_runs_are_split_by_a_segment_worth_keeping_not_by_a_dead_one() -> None:
    segs = [seg_info(n, 100 * n - 99, 100 * n) for n in range(1, 7)]
    # 1: straggler, 2: dead, 3: straggler, 4: fully needed, 5: straggler, 6: newest.
    done = tuple(
        i for i in range(1, 601)
        if not (i in (10, 210, 410) or 301 <= i <= 400 or i > 500)
    )
    plan = plan_compaction(segs, {"": Checkpoint(0, done)}, 0.25)
    assert plan.dead == (segs[1],)
    assert [[s.number for s in run] for run in plan.runs] == [[1, 3], [5]]


def test_ids_confirmed_in_a_segment_with_gaps_are_not_subtracted() -> None:
    # A compaction output holds only ids 4 and 8: a done id between them (6) may not
    # be one of its records, so both of its records count as possibly needed.
    gappy = SegmentInfo(1, Path("q.1"), size=100, count=2, first_id=4, last_id=8,
                        compacted_from=0)
    assert live_upper_bound(gappy, {"": Checkpoint(0, (5, 6, 7))}) == 2
    dense = seg_info(1, 4, 8)
    assert live_upper_bound(dense, {"": Checkpoint(0, (5, 6, 7))}) == 2
    assert live_upper_bound(dense, {"": Checkpoint(0, (4, 5, 6, 7))}) == 1


# -- execution on real files ------------------------------------------------------------


async def _straggler_queue(path: Path, archive: Path | None = None) -> list[int]:
    """Queue "q" with 4 items per segment, ids 1..13 (segments 1-4, 5-8, 9-12, 13) and a
    checkpoint that confirmed 1, 2, 3, 5, 6, 7 out of order; returns the ids still needed."""
    async with open_data_dir(path, DataDirConfig(archive_dir=archive),
                             lambda _: cfg(journal_size=620)) as dd:
        q = dd.queue("q")
        for _ in range(13):
            await q.append([b"x" * 100], T0)
        assert [(s.first_id, s.last_id) for s in q.segments] == [
            (1, 4), (5, 8), (9, 12), (13, 13)
        ]
        await q.write_checkpoint("", 0, [1, 2, 3, 5, 6, 7])
        return [p.id for p in q.iter_unconsumed("")]


async def test_rewrite_run_keeps_only_needed_records_under_the_last_name(
    tmp_path: Path,
) -> None:
    needed = await _straggler_queue(tmp_path)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    run = (q.segments[0], q.segments[1])
    originals = {s.path.name: s.path.read_bytes() for s in run}
    new = compaction.rewrite_run(run, dict(q.readers), read_segment, dd)
    assert new is not None and new.path == run[1].path and new.compacted_from == run[0].number
    assert [p.id for p in read_segment(new, 1, None)] == [4, 8]
    records = [d.record for d in jf.decode_all(new.path.read_bytes())]
    assert records[1] == jf.Compacted(run[0].number, run[1].number)  # after the seal
    # The earlier original is the caller's to retire once the new list is published.
    assert run[0].path.read_bytes() == originals[run[0].path.name]
    assert not any("~~" in p.name for p in tmp_path.iterdir())
    assert needed == [4, 8, 9, 10, 11, 12, 13]


async def test_rewrite_run_reads_from_past_the_lowest_readers_head(tmp_path: Path) -> None:
    """Ids at or below every reader's head are needed by none: the rewrite does not
    read (decode) them, and keeps what any reader still needs."""
    await _straggler_queue(tmp_path)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    run = (q.segments[0], q.segments[1])
    seen: list[int] = []

    def read(seg: SegmentInfo, from_id: int, to_id: int | None) -> Iterator[jf.Put]:
        for put in read_segment(seg, from_id, to_id):
            seen.append(put.id)
            yield put

    readers = {"": Checkpoint(4, (5, 6, 7)), "b": Checkpoint(6)}
    new = compaction.rewrite_run(run, readers, read, dd)
    assert new is not None
    assert [p.id for p in read_segment(new, 1, None)] == [7, 8]
    assert seen == [5, 6, 7, 8]


async def test_rewrite_run_with_nothing_needed_retires_the_run(tmp_path: Path) -> None:
    await _straggler_queue(tmp_path)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    run = (q.segments[0], q.segments[1])
    assert compaction.rewrite_run(run, {"": Checkpoint(8)}, read_segment, dd) is None
    assert [p.name for p in segments(tmp_path)] == [s.path.name for s in q.segments[2:]]


async def test_compact_updates_the_live_list_in_place(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    needed = await _straggler_queue(tmp_path / "data", archive)
    dd = DataDir.open(tmp_path / "data", DataDirConfig(archive_dir=archive))
    q = dd.queues["q"]
    live = q.segments
    before = [s.number for s in live]
    result = await compaction.compact(live, {"": Checkpoint(0, (1, 2, 3, 5, 6, 7))}, 0.5,
                                      read_segment, dd)
    assert (result.removed, result.archived, result.rewritten) == (0, 0, 2)
    assert result.bytes_freed > 0
    assert live is q.segments and [s.number for s in live] == before[1:]
    assert [p.id for p in q.iter_puts(1)] == needed
    # The originals' records are all kept in the archive (the renamed-over one copied first).
    archived = DataDir.open(archive).queues["q"]
    assert {p.id for p in archived.iter_puts(1)} >= set(range(1, 9))


async def test_no_readers_means_nothing_to_compact(tmp_path: Path) -> None:
    await _straggler_queue(tmp_path)
    dd = DataDir.open(tmp_path)
    live = list(dd.queues["q"].segments)
    assert await compaction.compact(live, {}, 1.0, read_segment, dd) == CompactionResult()
    assert len(live) == 4


async def test_compaction_deletes_dead_and_rewrites_stragglers(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=2000)) as dd:
        q = dd.queue("q")
        for i in range(1, 201):
            await q.append([data_for(i)], T0)
        n_before = len(q.segments)
        # Stragglers: item 30 is still open, 77 and 120 were aborted and wait;
        # everything else through 180 was confirmed.
        gaps = {77, 120}
        await q.write_checkpoint("", 29, [i for i in range(31, 181) if i not in gaps])
        result = await q.compact()
        assert result.rewritten >= 2 and result.bytes_freed > 0
        assert len(q.segments) < n_before
        expected = [30, 77, 120, *range(181, 201)]
        assert [p.id for p in q.iter_unconsumed("")] == expected
        await q.append([b"later"], T0)
    dd2 = DataDir.open(tmp_path)
    q2 = dd2.queues["q"]
    assert [p.id for p in q2.iter_unconsumed("")] == [*expected, 201]
    assert all(p.data == data_for(p.id) for p in q2.iter_unconsumed("") if p.id <= 200)
    assert any(s.compacted_from is not None for s in q2.segments)
    assert dd2.report.truncated_bytes == 0


async def test_compaction_keeps_memcache_flags_of_stragglers(tmp_path: Path) -> None:
    def flags_of(i: int) -> int:
        return [0, 1, 16, 2**32 - 1][i % 4]

    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=2000)) as dd:
        q = dd.queue("q")
        for i in range(1, 121):
            await q.append([data_for(i)], T0, flags=flags_of(i))
        stragglers = {30, 77, 78, 79}  # still needed; the rest through 100 is confirmed
        await q.write_checkpoint("", 29, [i for i in range(31, 101) if i not in stragglers])
        result = await q.compact()
        assert result.rewritten >= 2
        kept = [(p.id, p.flags, p.data) for p in q.iter_unconsumed("")]
    expected = [(i, flags_of(i), data_for(i)) for i in [*sorted(stragglers), *range(101, 121)]]
    assert kept == expected
    dd2 = DataDir.open(tmp_path)
    q2 = dd2.queues["q"]
    assert any(s.compacted_from is not None for s in q2.segments)
    assert [(p.id, p.flags, p.data) for p in q2.iter_unconsumed("")] == expected
    # The rewritten segment holds FLAGS records for exactly the flagged stragglers.
    out = next(s for s in q2.segments if s.compacted_from is not None)
    flagged = [d.record.id for d in jf.decode_all(out.path.read_bytes())
               if isinstance(d.record, jf.Put) and d.record.flags]
    assert flagged
    assert flagged == [i for i, _, _ in expected if flags_of(i) and i <= out.last_id]


async def test_dead_segments_move_to_archive_dir(tmp_path: Path) -> None:
    data, archive = tmp_path / "data", tmp_path / "archive"
    conf = DataDirConfig(archive_dir=archive)
    async with open_data_dir(data, conf, lambda _: cfg(journal_size=1500)) as dd:
        q = dd.queue("q")
        for i in range(1, 101):
            await q.append([data_for(i)], T0)
        await q.write_checkpoint("", 100)
        result = await q.compact()
    assert result.removed >= 3 and result.archived == result.removed
    archived = DataDir.open(archive)
    assert [p.id for p in archived.queues["q"].iter_puts(1)] == list(
        range(1, archived.queues["q"].segments[-1].last_id + 1)
    )
    assert len(segments(data)) == 1  # the newest stays for the writer


# -- crash safety ------------------------------------------------------------------------


async def test_crash_before_the_rename_keeps_every_original(tmp_path: Path) -> None:
    # The rewrite's output is complete in q.<last>~~ but not renamed yet: recovery must
    # remove the temp file and keep the originals, every record in them.
    data, saved = tmp_path / "data", tmp_path / "saved"
    needed = await _straggler_queue(data)
    shutil.copytree(data, saved)
    async with open_data_dir(data, queue_config=lambda _: cfg(journal_size=620)) as dd:
        q = dd.queue("q")
        assert (await q.compact()).rewritten == 2
        output = next(s for s in q.segments if s.compacted_from is not None)
        output_bytes = output.path.read_bytes()
    shutil.rmtree(data)
    shutil.copytree(saved, data)
    temp = data / jf.temp_name(output.path.name)
    temp.write_bytes(output_bytes)
    dd2 = DataDir.open(data)
    assert not temp.exists()
    assert dd2.report.queues["q"].temps_removed == 1
    q2 = dd2.queues["q"]
    assert [p.id for p in q2.iter_puts(1)] == list(range(1, 14))
    assert [p.id for p in q2.iter_unconsumed("")] == needed
    assert all(s.compacted_from is None for s in q2.segments)


async def test_interrupted_compaction_is_finished_by_recovery(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=1500)) as dd:
        q = dd.queue("q")
        for i in range(1, 101):
            await q.append([data_for(i)], T0)
        originals = {p.name: p.read_bytes() for p in segments(tmp_path)}
        await q.write_checkpoint("", 5, [i for i in range(7, 90) if i not in (30, 55)])
        result = await q.compact()
        assert result.rewritten >= 2
        ranges = [(s.compacted_from, s.number) for s in q.segments if s.compacted_from]
    # Put back the originals the compaction retired, as if it crashed after its rename.
    def replaced(name: str) -> bool:
        number = int(name.split(".")[1])
        return any(lo <= number < hi for lo, hi in ranges)

    restored = [n for n in originals if not (tmp_path / n).exists() and replaced(n)]
    assert restored
    for name in restored:
        (tmp_path / name).write_bytes(originals[name])
    dd2 = DataDir.open(tmp_path)
    ids = [p.id for p in dd2.queues["q"].iter_puts(1)]
    assert len(ids) == len(set(ids)) and ids == sorted(ids)
    assert [p.id for p in dd2.queues["q"].iter_unconsumed("")] == [6, 30, 55, *range(90, 101)]
    assert all(not (tmp_path / n).exists() for n in restored)
