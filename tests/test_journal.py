"""The journal engine against real files in a temp dir: appends, recovery, checkpoints,
compaction, size limits, and the `queued dump` / `queued check` tools."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest
import trio

from queued.cli import check, dump
from queued.config import CorruptionPolicy, DataDirConfig, FsyncPolicy, FullPolicy, JournalConfig
from queued.core import journal_format as jf
from queued.core.errors import CorruptJournalError, JournalFullError
from queued.storage.compaction import live_upper_bound, plan_compaction
from queued.storage.datadir import DataDir, open_data_dir
from queued.storage.files import Checkpoint, SegmentInfo

T0 = 1_700_000_000_000


def data_for(i: int) -> bytes:
    return b"item-%d-" % i + bytes([i % 251]) * (i % 37)


def cfg(**kw: object) -> JournalConfig:
    return JournalConfig(**kw)  # type: ignore[arg-type]


def segments(path: Path, queue: str = "q") -> list[Path]:
    found = [p for p in path.iterdir() if (n := jf.parse_file_name(p.name)) and n.queue == queue
             and n.role is jf.FileRole.SEGMENT]
    return sorted(found, key=lambda p: int(p.name.split(".")[1]))


async def fill(path: Path, n: int, *, per_append: int = 1, **kw: object) -> None:
    async with open_data_dir(path, queue_config=lambda _: cfg(**kw)) as dd:
        q = dd.queue("q")
        i = 1
        while i <= n:
            await q.append([data_for(j) for j in range(i, min(n, i + per_append - 1) + 1)], T0)
            i += per_append


def all_puts(path: Path, **kw: object) -> list[jf.Put]:
    dd = DataDir.open(path, **kw)  # type: ignore[arg-type]
    return list(dd.queues["q"].iter_puts(1))


# -- appends and read-back ---------------------------------------------------------


async def test_append_assigns_increasing_ids_and_survives_restart(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        first = await q.append([b"a", b"b"], T0)
        second = await q.append([b"c"], T0 + 1, expire_time_ms=T0 + 5000, error_count=2)
    assert [p.id for p in first + second] == [1, 2, 3]
    puts = all_puts(tmp_path)
    assert puts == [
        jf.Put(1, b"a", T0), jf.Put(2, b"b", T0), jf.Put(3, b"c", T0 + 1, T0 + 5000, 2)
    ]


async def test_concurrent_appends_share_rounds_and_fsyncs(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        results: list[int] = []

        async def one(i: int) -> None:
            puts = await q.append([data_for(i)], T0)
            results.append(puts[0].id)

        async with trio.open_nursery() as nursery:
            for i in range(256):
                nursery.start_soon(one, i)
        stats = dd.statistics()
    assert sorted(results) == list(range(1, 257))
    # Group commit: far fewer fsyncs than appends.
    assert stats.fsync.count < 256 / 4
    assert len(all_puts(tmp_path)) == 256


async def test_rotation_and_big_item_gets_own_segment(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=1000)) as dd:
        q = dd.queue("q")
        for _ in range(40):
            await q.append([b"x" * 90], T0)
        await q.append([b"B" * 5000], T0)
        await q.append([b"after"], T0)
    segs = segments(tmp_path)
    assert len(segs) >= 5
    sizes = [p.stat().st_size for p in segs]
    big = [s for s in sizes if s > 1000]
    assert len(big) == 1  # only the big item's segment passes journal_size
    dd = DataDir.open(tmp_path)
    infos = dd.queues["q"].segments
    big_seg = next(s for s in infos if s.size > 1000)
    assert big_seg.count == 1 and big_seg.first_id == 41
    assert [p.id for p in dd.queues["q"].iter_puts(1)] == list(range(1, 43))


async def test_iter_puts_from_the_middle_uses_the_sparse_index(tmp_path: Path) -> None:
    await fill(tmp_path, 3000, per_append=7, journal_size=200_000)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    got = list(q.iter_puts(1234, 1300))
    assert [p.id for p in got] == list(range(1234, 1301))
    assert all(p.data == data_for(p.id) for p in got)


@pytest.mark.parametrize("policy", ["never", "50"])
async def test_fsync_policies_store_everything(tmp_path: Path, policy: str) -> None:
    async with open_data_dir(
        tmp_path, queue_config=lambda _: cfg(fsync=FsyncPolicy.parse(policy))
    ) as dd:
        q = dd.queue("q")
        for i in range(20):
            await q.append([data_for(i)], T0)
        await trio.sleep(0.12)  # let a periodic fsync come due
        stats = dd.statistics()
    if policy == "never":
        assert stats.fsync.count == 0
    else:
        assert 1 <= stats.fsync.count < 20
    assert len(all_puts(tmp_path)) == 20


def test_fsync_policy_parse() -> None:
    assert str(FsyncPolicy.parse("always")) == "always"
    assert str(FsyncPolicy.parse("never")) == "never"
    assert FsyncPolicy.parse("200ms").interval_ms == 200
    assert FsyncPolicy.parse(15).interval_ms == 15
    with pytest.raises(ValueError):
        FsyncPolicy.parse("sometimes")


# -- recovery of damaged files -----------------------------------------------------


async def test_torn_tail_cut_at_every_offset_of_the_last_batch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    await fill(src, 6, per_append=3)
    seg = segments(src)[0]
    whole = seg.read_bytes()
    records = jf.decode_all(whole)
    checks = [d for d in records if isinstance(d.record, jf.Check)]
    last_batch_start = checks[-2].end
    for cut in range(last_batch_start, len(whole)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(whole[:cut])
        dd = DataDir.open(d)
        assert [p.id for p in dd.queues["q"].iter_puts(1)] == [1, 2, 3]
        assert dd.report.truncated_bytes == cut - last_batch_start
        assert (d / seg.name).stat().st_size == last_batch_start


async def test_garbage_appended_is_cut(tmp_path: Path) -> None:
    await fill(tmp_path, 5)
    seg = segments(tmp_path)[0]
    size = seg.stat().st_size
    with seg.open("ab") as f:
        f.write(os.urandom(300))
    dd = DataDir.open(tmp_path)
    assert [p.id for p in dd.queues["q"].iter_puts(1)] == [1, 2, 3, 4, 5]
    assert dd.report.truncated_bytes == 300
    assert seg.stat().st_size == size


async def test_bit_flip_in_the_middle_is_refused(tmp_path: Path) -> None:
    await fill(tmp_path, 9, per_append=3)
    seg = segments(tmp_path)[0]
    raw = bytearray(seg.read_bytes())
    second_batch = [d for d in jf.decode_all(bytes(raw)) if isinstance(d.record, jf.Put)][4]
    raw[second_batch.end - 1] ^= 0x10  # inside item 5's data
    seg.write_bytes(bytes(raw))
    out = io.StringIO()
    assert check(tmp_path, out) == 1
    assert "CORRUPT" in out.getvalue()
    with pytest.raises(CorruptJournalError, match="refusing to start"):
        DataDir.open(tmp_path)
    assert seg.read_bytes() == bytes(raw)  # refusing changes nothing


async def test_bit_flip_quarantined_keeps_every_verified_batch(tmp_path: Path) -> None:
    await fill(tmp_path, 9, per_append=3)
    seg = segments(tmp_path)[0]
    raw = bytearray(seg.read_bytes())
    fifth = [d for d in jf.decode_all(bytes(raw)) if isinstance(d.record, jf.Put)][4]
    raw[fifth.end - 1] ^= 0x10
    seg.write_bytes(bytes(raw))
    dd = DataDir.open(tmp_path, DataDirConfig(corruption=CorruptionPolicy.QUARANTINE))
    assert [p.id for p in dd.queues["q"].iter_puts(1)] == [1, 2, 3, 7, 8, 9]
    rep = dd.report.queues["q"]
    assert len(rep.quarantined) == 1
    kept = Path(rep.quarantined[0])
    assert kept.read_bytes() == bytes(raw)  # the original is kept as it was
    assert sum(d.length for d in rep.damage) > 0
    assert check(tmp_path, io.StringIO()) == 0


def test_seed_file_from_another_implementation_loads(tmp_path: Path) -> None:
    # Hand-built per seed 002: no check records, an expiry, a torn last record.
    def put(i: int, data: bytes, expire: int | None = None) -> bytes:
        if expire is None:
            return struct.pack("<BiiqQ", 0x86, len(data), 0, i, T0) + data
        return struct.pack("<BiiqQQ", 0x88, len(data), 1, i, T0, expire) + data

    body = jf.WRITER_MAGIC + put(5, b"five") + put(6, b"six", T0 + 9) + put(7, b"seven")[:-2]
    (tmp_path / "q.1321401903634").write_bytes(body)
    reader = jf.READER_MAGIC + struct.pack("<Bq", 0x02, 4) + struct.pack("<Bi", 0x91, 8) + \
        struct.pack("<q", 6)
    (tmp_path / "q.read.").write_bytes(reader)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    assert [(p.id, p.data, p.expire_time_ms) for p in q.iter_puts(1)] == [
        (5, b"five", None), (6, b"six", T0 + 9)
    ]
    assert q.readers[""] == Checkpoint(4, (6,))
    assert [p.id for p in q.iter_unconsumed("")] == [5]
    assert dd.report.truncated_bytes == len(put(7, b"seven")) - 2
    assert q.last_id == 6


async def test_torn_segment_header_is_rewritten(tmp_path: Path) -> None:
    await fill(tmp_path, 3)
    (tmp_path / "q.99999999999999").write_bytes(jf.WRITER_MAGIC[:3])
    dd = DataDir.open(tmp_path)
    assert [p.id for p in dd.queues["q"].iter_puts(1)] == [1, 2, 3]
    assert (tmp_path / "q.99999999999999").read_bytes() == jf.WRITER_MAGIC + jf.EMPTY_CHECK


async def test_leftover_temp_files_are_removed(tmp_path: Path) -> None:
    await fill(tmp_path, 2)
    (tmp_path / "q.read.~~").write_bytes(b"half")
    (tmp_path / "q.123~~").write_bytes(b"half")
    (tmp_path / "other.read.~~").write_bytes(b"half")
    dd = DataDir.open(tmp_path)
    assert not (tmp_path / "q.read.~~").exists()
    assert not (tmp_path / "q.123~~").exists()
    assert not (tmp_path / "other.read.~~").exists()
    assert dd.report.queues["q"].temps_removed == 2


# -- checkpoints --------------------------------------------------------------------


async def test_checkpoint_round_trip_and_read_done_not_redelivered(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([data_for(i) for i in range(1, 11)], T0)
        await q.write_checkpoint("", 3, [5, 8, 2])
        await q.write_checkpoint("audit", 0, [])
    assert (tmp_path / "q.read.").exists() and (tmp_path / "q.read.audit").exists()
    dd2 = DataDir.open(tmp_path)
    q2 = dd2.queues["q"]
    assert q2.readers[""] == Checkpoint(3, (5, 8))
    assert [p.id for p in q2.iter_unconsumed("")] == [4, 6, 7, 9, 10]
    assert [p.id for p in q2.iter_unconsumed("audit")] == list(range(1, 11))


@pytest.mark.parametrize("damage", ["corrupt", "empty", "torn", "bad_magic"])
async def test_unreadable_checkpoint_replays_from_oldest_segment(
    tmp_path: Path, damage: str
) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([data_for(i) for i in range(1, 6)], T0)
        await q.write_checkpoint("", 4, [])
    cp = tmp_path / "q.read."
    raw = bytearray(cp.read_bytes())
    if damage == "corrupt":
        raw[14] ^= 0xFF  # inside READ_HEAD's id: the check record disagrees
    elif damage == "empty":
        raw = bytearray()
    elif damage == "torn":
        raw = raw[:-5]
    else:
        raw[0] = 0x99
    cp.write_bytes(bytes(raw))
    dd2 = DataDir.open(tmp_path)
    assert dd2.report.queues["q"].unreadable_checkpoints == ["q.read."]
    assert [p.id for p in dd2.queues["q"].iter_unconsumed("")] == [1, 2, 3, 4, 5]
    assert dd2.queues["q"].last_id == 5  # ids never go back


async def test_missing_checkpoint_means_default_reader_from_start(tmp_path: Path) -> None:
    await fill(tmp_path, 4)
    assert not (tmp_path / "q.read.").exists()
    q = DataDir.open(tmp_path).queues["q"]
    assert list(q.readers) == [""]
    assert [p.id for p in q.iter_unconsumed("")] == [1, 2, 3, 4]


# -- compaction ----------------------------------------------------------------------


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


async def test_max_journal_size_refuse(tmp_path: Path) -> None:
    conf = cfg(journal_size=1000, max_journal_size=3000)
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        stored = 0
        with pytest.raises(JournalFullError, match="max_journal_size"):
            for i in range(1, 1000):
                await q.append([b"y" * 100], T0)
                stored = i
        assert 10 < stored < 40
        # Consuming frees space: compaction runs before refusing.
        await q.write_checkpoint("", stored)
        await q.append([b"fits again"], T0)
    assert all_puts(tmp_path)[-1].data == b"fits again"


async def test_max_journal_size_drop_oldest(tmp_path: Path) -> None:
    conf = cfg(journal_size=1000, max_journal_size=3000, full_policy=FullPolicy.DROP_OLDEST)
    dropped: list[int] = []
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")

        async def note(seg: SegmentInfo) -> None:
            dropped.append(seg.last_id)

        q.before_drop = note
        for _ in range(100):
            await q.append([b"z" * 100], T0)
        assert q.total_bytes <= 3000
        head = q.readers[""].head
    assert dropped and head == dropped[-1]
    dd2 = DataDir.open(tmp_path)
    ids = [p.id for p in dd2.queues["q"].iter_unconsumed("")]
    assert ids[-1] == 100 and ids[0] == head + 1


# -- tools ------------------------------------------------------------------------------


async def test_dump_prints_every_record(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"hello"], T0, expire_time_ms=T0 + 1)
        await q.write_checkpoint("", 0, [1])
    out = io.StringIO()
    assert dump(segments(tmp_path)[0], out) == 0
    text = out.getvalue()
    assert "PUT id=1 size=5" in text and "b'hello'" in text and "expires=" in text
    assert "CHECK covers=" in text and "END (writer file with check records" in text
    out = io.StringIO()
    assert dump(tmp_path / "q.read.", out) == 0
    assert "READ_HEAD id=0" in out.getvalue() and "READ_DONE ids=[1]" in out.getvalue()
    seg = segments(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:-3])
    out = io.StringIO()
    assert dump(seg, out) == 1
    assert "CORRUPT" in out.getvalue() or "TORN" in out.getvalue()


async def test_check_reports_torn_tail_and_bad_checkpoint(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)
        await q.append([b"b"], T0)
        await q.write_checkpoint("", 1)
    out = io.StringIO()
    assert check(tmp_path, out) == 0
    seg = segments(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:-4])
    (tmp_path / "q.read.").write_bytes(b"\x26\x3c\x26")
    out = io.StringIO()
    assert check(tmp_path, out) == 1
    text = out.getvalue()
    assert "torn tail" in text and "recovery cuts" in text
    assert "unreadable checkpoint" in text


def test_cli_main_exit_codes(tmp_path: Path) -> None:
    from queued.cli import main

    assert main(["check", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert main(["dump", str(tmp_path / "missing")]) == 2


def test_readme_check_record_example_is_true() -> None:
    """The bytes the README shows for a first batch are what we write."""
    put = jf.encode_put(jf.Put(1, b"hello", 1_700_000_000_000))
    assert put.hex() == "86" "05000000" "00000000" "0100000000000000" "0068e5cf8b010000" + \
        b"hello".hex()
    assert jf.encode_check(put, 13).hex() == "72" "1e000000" "ed70c2c3"
    assert jf.EMPTY_CHECK.hex() == "72" "00000000" "93d168e1"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "72 1e000000 ed70c2c3" in readme and "72 00000000 93d168e1" in readme


async def test_bad_item_in_a_batch_changes_nothing(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"ok"], T0)
        with pytest.raises(ValueError, match="out of range"):
            await q.append([b"a", b"b"], T0, error_count=1 << 40)
        assert q.last_id == 1 and q.statistics().pending_bytes == 0
        assert (await q.append([b"next"], T0))[0].id == 2
    assert [p.data for p in all_puts(tmp_path)] == [b"ok", b"next"]
