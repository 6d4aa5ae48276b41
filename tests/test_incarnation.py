"""Queue incarnations: every segment of a queue names the life of the queue it belongs to
(an INCARNATION record, command 12, in its head), kept across rotation, restarts and
compaction, new after a delete; seed readers skip it; old segments without one stay 0."""

from __future__ import annotations

from pathlib import Path

from journal_util import seed_reader

from queued.config import JournalConfig
from queued.journal import format as jf
from queued.storage import journal_scan as js
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

T0 = 1_700_000_000_000
SMALL = JournalConfig(journal_size=620)


def incarnations(path: Path, queue: str) -> list[int]:
    return [js.summarize_segment(s.path).incarnation for s in js.list_segments(path, {queue})]


async def test_segments_carry_the_incarnation_and_a_new_queue_gets_a_new_one(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        q = dd.queue("q")
        for i in range(20):
            await q.append([b"x%03d" % i * 10], T0 + i)
        first = q.file.incarnation
    assert first > 0
    assert len(js.list_segments(data, {"q"})) >= 3
    assert set(incarnations(data, "q")) == {first}
    # Seed readers read every PUT and skip the record (an extension record, command 13,
    # as the check records are).
    seg = js.list_segments(data, {"q"})[0]
    puts, skipped = seed_reader(Path(seg.path).read_bytes())
    assert puts and set(skipped) == {13}
    assert [d.record for d in jf.decode_all(Path(seg.path).read_bytes())
            if isinstance(d.record, jf.Incarnation | jf.Unknown)] == [jf.Incarnation(first)]

    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:  # a restart
        q = dd.queue("q")
        assert q.file.incarnation == first
        await q.write_checkpoint("", 15)
        assert (await q.compact()).removed > 0
        for i in range(20, 30):
            await q.append([b"y%03d" % i * 10], T0 + i)
        assert {s.incarnation for s in q.segments} == {first}
        await dd.delete_queue("q")
        q = dd.queue("q")  # created again: ids restart, a new life
        await q.append([b"again"], T0)
        second = q.file.incarnation
    assert second > first
    assert incarnations(data, "q") == [second]
    assert DataDir.open(data).queues["q"].file.incarnation == second


async def test_compaction_output_keeps_the_incarnation(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        q = dd.queue("q")
        for i in range(1, 41):
            await q.append([b"z%03d" % i * 10], T0 + i)
        inc = q.file.incarnation
        # Consumed up to 5, then all but 7 up to 30: the stragglers get rewritten.
        await q.write_checkpoint("", 5, [i for i in range(6, 31) if i != 7])
        result = await q.compact()
        assert result.rewritten > 0
        outputs = [s for s in q.segments if s.compacted_from is not None]
        assert outputs and all(s.incarnation == inc for s in outputs)
    summaries = [js.summarize_segment(s.path) for s in js.list_segments(data, {"q"})]
    assert any(s.compacted for s in summaries)
    assert {s.incarnation for s in summaries} == {inc}
    recovered = DataDir.open(data).queues["q"]
    assert any(s.compacted_from is not None for s in recovered.segments)
    assert recovered.file.incarnation == inc


async def test_segments_without_a_record_stay_incarnation_zero(tmp_path: Path) -> None:
    # A segment as another implementation of the seed (or queued before incarnations)
    # writes it: no record. The queue keeps incarnation 0 and writes none either.
    data = tmp_path / "data"
    data.mkdir()
    body = b"".join(jf.encode_put(jf.Put(i, b"old", T0)) for i in range(1, 4))
    (data / jf.segment_name("q", 1000)).write_bytes(
        jf.WRITER_MAGIC + jf.EMPTY_CHECK + jf.seal(body, jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE))
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        q = dd.queue("q")
        assert q.file.incarnation == 0
        for i in range(10):
            await q.append([b"n%03d" % i * 10], T0 + i)
    assert set(incarnations(data, "q")) == {0}
    newest = js.list_segments(data, {"q"})[-1]
    assert not [d for d in jf.decode_all(Path(newest.path).read_bytes())
                if isinstance(d.record, jf.Incarnation)]
    assert jf.head_incarnation(jf.segment_head(0)) == 0
    assert jf.head_incarnation(jf.segment_head(5, jf.Compacted(1, 2))) == 5
    damaged = bytearray(jf.segment_head(5))
    damaged[20] ^= 1
    assert jf.head_incarnation(bytes(damaged)) == 0


async def test_a_header_recovery_rewrote_does_not_start_a_new_life(tmp_path: Path) -> None:
    # A crash right after a segment was created leaves a torn header; recovery rewrites it
    # as magic + empty check, naming no incarnation. The queue keeps its life.
    data = tmp_path / "data"
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        q = dd.queue("q")
        await q.append([b"one"], T0)
        inc = q.file.incarnation
        newest = q.segments[-1].number
    (data / jf.segment_name("q", newest + 1)).write_bytes(jf.WRITER_MAGIC[:3])  # torn
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        q = dd.queue("q")
        assert q.segments[-1].incarnation == 0 and q.file.incarnation == inc
        await q.append([b"two"], T0)
    assert incarnations(data, "q")[-1] == inc
