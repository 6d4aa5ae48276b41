"""The data directory against real files: recovery of a whole directory, the writer
rounds it runs (group commit across queues, fsync counts), retiring segments (delete
or archive), deleting queues and closing; deletes and closes racing a round, failed
periodic fsyncs, compaction read-back races, drop_oldest and the archive (each test's
comment says the bug it guards against)."""

from __future__ import annotations

import errno
import io
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from journal_util import T0, all_puts, cfg, data_for, fill, queue_files, segments
from wait_util import wait_until

from queued.cli import check
from queued.config import CorruptionPolicy, DataDirConfig, FsyncPolicy, FullPolicy, JournalConfig
from queued.errors import (
    CorruptJournalError,
    JournalClosedError,
    JournalFullError,
    JournalWriteError,
)
from queued.journal import format as jf
from queued.storage import fileio, writer
from queued.storage.datadir import DataDir
from queued.storage.files import Checkpoint, SegmentInfo
from queued.storage.journal import wait_durable
from queued.storage.opening import open_data_dir

# -- recovery of a directory --------------------------------------------------------


async def test_recovery_of_several_queues_and_their_readers(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=1000)) as dd:
        a, b = dd.queue("a"), dd.queue("b")
        for i in range(1, 31):
            await a.append([data_for(i)], T0)
        await b.append([data_for(i) for i in range(1, 4)], T0)
        await a.write_checkpoint("", 10, [12, 15])
        await a.write_checkpoint("audit", 3)
        await b.write_checkpoint("", 3)
        sizes = {name: sum(s.size for s in j.segments) for name, j in dd.queues.items()}
        counts = {name: len(j.segments) for name, j in dd.queues.items()}
    (tmp_path / "notes.txt").write_text("not a journal file")
    (tmp_path / "sub").mkdir()

    dd2 = DataDir.open(tmp_path)
    assert sorted(dd2.queues) == ["a", "b"]
    rep = dd2.report
    assert [(q.queue, q.segments, q.records, q.bytes) for q in rep.queues.values()] == [
        ("a", counts["a"], 30, sizes["a"]), ("b", counts["b"], 3, sizes["b"])
    ]
    assert rep.records == 33 and rep.truncated_bytes == 0
    assert rep.summary().startswith("recovered 2 queues, 33 records")
    a2, b2 = dd2.queues["a"], dd2.queues["b"]
    assert counts["a"] > 1  # rotation happened: several segments recovered in order
    assert a2.readers == {"": Checkpoint(10, (12, 15)), "audit": Checkpoint(3)}
    assert [p.id for p in a2.iter_unconsumed("")] == [11, 13, 14, *range(16, 31)]
    assert b2.readers == {"": Checkpoint(3)} and list(b2.iter_unconsumed("")) == []
    assert (a2.last_id, b2.last_id) == (30, 3)
    assert (tmp_path / "notes.txt").exists()  # not ours: left alone
    assert dd2.statistics().queues == 2 and dd2.statistics().recovery_seconds > 0


async def test_ids_continue_after_recovery_even_past_a_checkpoint(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"a", b"b"], T0)
        await q.write_checkpoint("", 5)  # a reader's head may run past the last segment id
    async with open_data_dir(tmp_path) as dd:
        assert (await dd.queue("q").append([b"c"], T0))[0].id == 6


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


# -- writer rounds ---------------------------------------------------------------------


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


@pytest.mark.parametrize("policy", ["never", "50"])
async def test_fsync_policies_store_everything(tmp_path: Path, policy: str) -> None:
    async with open_data_dir(
        tmp_path, queue_config=lambda _: cfg(fsync=FsyncPolicy.parse(policy))
    ) as dd:
        q = dd.queue("q")
        for i in range(20):
            await q.append([data_for(i)], T0)
        if policy != "never":  # a periodic fsync comes due (time.monotonic: 50 ms)
            await wait_until(lambda: dd.statistics().fsync.count >= 1)
        stats = dd.statistics()
    if policy == "never":
        assert stats.fsync.count == 0
    else:
        assert 1 <= stats.fsync.count < 20
    assert len(all_puts(tmp_path)) == 20


async def test_one_round_writes_several_queues_with_one_fsync_each(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        queues = [dd.queue(name) for name in ("a", "b", "c")]
        for q in queues:
            await q.append([b"first"], T0)  # each queue has its segment open now
        before = dd.statistics()
        # Planned without yielding to the writer: all of them land in its next round.
        tickets = [q.append_nowait([data_for(i) for i in range(1, 6)], T0)[1]
                   for q in queues for _ in range(4)]
        for ticket in tickets:
            await wait_durable(ticket)
        after = dd.statistics()
        assert after.rounds - before.rounds == 1
        assert after.fsync.count - before.fsync.count == 3  # one per queue (group commit)
        for q in queues:
            stats = q.statistics()
            assert (stats.fsyncs, stats.batches_written) == (2, 2)  # first append + the round
            assert stats.appends == 5 and stats.items_appended == 21
            assert stats.pending_bytes == 0
    for name in ("a", "b", "c"):
        assert [p.id for p in DataDir.open(tmp_path).queues[name].iter_puts(1)] == list(
            range(1, 22)
        )


async def test_a_round_that_rotates_fsyncs_the_segment_it_leaves(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=620)) as dd:
        q = dd.queue("q")
        await q.append([b"x" * 100], T0)
        fsyncs = q.statistics().fsyncs
        _, t1 = q.append_nowait([b"x" * 100], T0)  # still fits the open segment
        _, t2 = q.append_nowait([b"y" * 1000], T0)  # does not: a new segment, same round
        await wait_durable(t1)
        await wait_durable(t2)
        assert len(q.segments) == 2
        assert q.statistics().fsyncs - fsyncs == 2  # the old one before leaving it, the new


async def test_fsync_never_writes_without_any_fsync(tmp_path: Path) -> None:
    conf = cfg(fsync=FsyncPolicy.parse("never"))
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for i in range(1, 11):
            await q.append([data_for(i)], T0)
        assert dd.statistics().rounds == 10
        assert dd.statistics().fsync.count == 0 and q.statistics().fsyncs == 0
    assert [p.id for p in all_puts(tmp_path)] == list(range(1, 11))


async def test_an_append_that_needs_no_fsync_is_written_at_once_and_in_order(
        tmp_path: Path) -> None:
    """fsync never: append_nowait itself writes when the writer is idle (the ticket is
    durable before anything yields); while a round is under way (the first write opens
    the segment, so it goes to the writer's thread, held here until released) later
    appends wait for the next round instead, so the file keeps id order."""
    release = threading.Event()

    def held_round(*args: Any) -> Any:
        release.wait(10)
        return writer.run_round(*args)

    conf = cfg(fsync=FsyncPolicy.parse("never"), journal_size=1000)
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        dd.writer.run_round = held_round
        q = dd.queue("q")
        _, first = q.append_nowait([data_for(1)], T0)  # opens a file: the writer's round
        assert not first.done
        await trio.testing.wait_all_tasks_blocked()  # the round waits in its thread
        _, during = q.append_nowait([data_for(2)], T0)
        assert not during.done  # not ahead of the round
        release.set()
        await wait_durable(first)
        await wait_durable(during)
        rounds = dd.statistics().rounds
        _, now = q.append_nowait([data_for(3), data_for(4)], T0)
        assert now.done and now.error is None  # written already, no round
        assert dd.statistics().rounds == rounds + 1 and q.statistics().pending_bytes == 0
        for i in range(5, 40):  # fills the segment: a rotation goes to the writer again
            await wait_durable(q.append_nowait([data_for(i)], T0)[1])
        assert len(q.segments) > 1
    assert [p.id for p in all_puts(tmp_path)] == list(range(1, 40))


async def test_a_periodic_fsync_is_owed_after_a_write_done_at_once(tmp_path: Path) -> None:
    """fsync every 100 ms: an append written at once (no round) still gets its fsync
    within the interval, even when the writer was asleep with nothing owed."""
    conf = cfg(fsync=FsyncPolicy.parse("100"))
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        rounds = dd.statistics().rounds
        await q.append([data_for(1)], T0)  # opens the segment: a round
        # The periodic fsync of that round's write, in a round of its own that has
        # ended (the count moves in the round's thread, before the round ends).
        await wait_until(lambda: q.statistics().fsyncs >= 1
                         and dd.statistics().rounds >= rounds + 2, timeout=5)
        await trio.testing.wait_all_tasks_blocked()  # the writer sleeps, nothing owed
        rounds = dd.statistics().rounds
        _, ticket = q.append_nowait([data_for(2)], T0)
        assert ticket.done  # written at once: no fsync was due yet
        assert dd.statistics().rounds == rounds + 1
        # (time.monotonic's 100 ms: the writer's clock is the real one)
        await wait_until(lambda: q.statistics().fsyncs >= 2, timeout=5)
        await dd.wait_round()  # (the count moved in the round's thread: let it end)
        # ...and nothing more once nothing is owed (no empty rounds meanwhile)
        rounds = dd.statistics().rounds
        await trio.sleep(0.3)  # (a negative: three intervals pass with nothing owed)
        assert q.statistics().fsyncs == 2 and dd.statistics().rounds == rounds


async def test_a_config_change_reaches_the_writer(tmp_path: Path) -> None:
    conf = cfg(fsync=FsyncPolicy.parse("never"))
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)
        assert q.statistics().fsyncs == 0
        q.config = cfg(fsync=FsyncPolicy.parse("always"))  # as a reload does
        await q.append([b"b"], T0)
        assert q.statistics().fsyncs == 1


# -- retiring segments ------------------------------------------------------------------


async def _three_segments(path: Path, config: DataDirConfig | None = None) -> DataDir:
    async with open_data_dir(path, config, lambda _: cfg(journal_size=620)) as dd:
        q = dd.queue("q")
        for _ in range(9):
            await q.append([b"x" * 100], T0)
    return DataDir.open(path, config)


async def test_retire_without_archive_deletes(tmp_path: Path) -> None:
    dd = await _three_segments(tmp_path)
    q = dd.queues["q"]
    old = q.segments[0]
    dd.retire_segments([old])
    assert not old.path.exists()
    assert [p.name for p in segments(tmp_path)] == [s.path.name for s in q.segments[1:]]


async def test_retire_with_archive_moves_originals_and_deletes_compaction_outputs(
    tmp_path: Path,
) -> None:
    data, archive = tmp_path / "data", tmp_path / "archive"
    dd = await _three_segments(data, DataDirConfig(archive_dir=archive))
    original, other = dd.queues["q"].segments[:2]
    content = original.path.read_bytes()
    # A compaction output: its records are in archived originals already.
    output = SegmentInfo(other.number, other.path, other.size, compacted_from=original.number)
    dd.retire_segments([original, output])
    assert not original.path.exists() and not other.path.exists()
    assert sorted(p.name for p in archive.iterdir()) == [original.path.name]
    assert (archive / original.path.name).read_bytes() == content


async def test_copy_to_archive_keeps_the_original(tmp_path: Path) -> None:
    data, archive = tmp_path / "data", tmp_path / "archive"
    dd = await _three_segments(data, DataDirConfig(archive_dir=archive))
    seg = dd.queues["q"].segments[0]
    dd.copy_to_archive(seg.path)
    assert (archive / seg.path.name).read_bytes() == seg.path.read_bytes()


# -- deleting queues and closing ----------------------------------------------------------


async def test_delete_queue_removes_its_files_and_fails_what_is_planned(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q, other = dd.queue("q"), dd.queue("other")
        await q.append([b"a"], T0)
        await q.write_checkpoint("audit", 0)
        await other.append([b"keep"], T0)
        _, planned = q.append_nowait([b"never written"], T0)
        await dd.delete_queue("q")
        with pytest.raises(JournalClosedError, match="was deleted"):
            await wait_durable(planned)
        with pytest.raises(JournalClosedError):
            q.append_nowait([b"late"], T0)
        assert "q" not in dd.queues and queue_files(tmp_path) == []
        fresh = dd.queue("q")  # the same name again is a new queue
        assert (await fresh.append([b"new"], T0))[0].id == 1
        await dd.delete_queue("nothing")  # unknown: nothing to do
    dd2 = DataDir.open(tmp_path)
    assert [p.data for p in dd2.queues["q"].iter_puts(1)] == [b"new"]
    assert [p.data for p in dd2.queues["other"].iter_puts(1)] == [b"keep"]


async def test_aclose_writes_what_was_planned_before_it(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)
        _, ticket = q.append_nowait([b"planned"], T0)
    await wait_durable(ticket)  # written by the writer's last round, not failed
    with pytest.raises(JournalClosedError):
        q.append_nowait([b"after"], T0)
    assert [p.data for p in all_puts(tmp_path)] == [b"a", b"planned"]


# -- the writer's lifecycle: deletes and closes racing rounds, failed fsyncs, drop_oldest ------


ITEM = b"x" * 100  # PUT record 125 bytes; with journal_size=620 a segment holds 4 items


async def test_delete_queue_during_a_round_leaves_no_segment_behind(tmp_path: Path) -> None:
    # delete_queue snapshots j.segments BEFORE waiting for the round lock; a segment the
    # in-flight round creates is added by finish_round afterwards and is never unlinked.
    # The deleted queue comes back (with its items) at the next start.
    entered, release = threading.Event(), threading.Event()

    def slow_round(work, periodic, *pool):  # type: ignore[no-untyped-def]
        if work:
            entered.set()
            release.wait(5)
        return writer.run_round(work, periodic, *pool)

    async with open_data_dir(tmp_path) as dd:
        dd.writer.run_round = slow_round
        q = dd.queue("q")

        async def put() -> None:
            await q.append([b"hello"], T0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(put)
            await trio.to_thread.run_sync(entered.wait, 5)
            nursery.start_soon(dd.delete_queue, "q")
            # delete_queue waits for the round lock, the put for the round in its thread
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert queue_files(tmp_path) == [], "deleted queue left files behind"
    assert "q" not in DataDir.open(tmp_path).queues, "deleted queue resurrected at restart"


async def test_append_after_aclose_fails_instead_of_hanging(tmp_path: Path) -> None:
    # aclose() stops the writer but never marks the journals closed: append_nowait still
    # queues the items and the ticket is never woken.
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)
    with trio.move_on_after(2) as scope, pytest.raises(JournalClosedError):
        await q.append([b"b"], T0)
    assert not scope.cancelled_caught, "append after aclose hung forever"


class FsyncFails(fileio.FileIO):
    """The storage layer's file calls (queued.storage.fileio): every fsync of a file fails."""

    def fsync(self, fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")


async def test_failed_periodic_fsync_does_not_spin_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a periodic fsync fails, the file stays unsynced and its last fsync stays old,
    # so fsync_deadline() is always in the past: DataDir.run loops with move_on_after(0),
    # retrying fsync and logging an error on every iteration (100% CPU).
    conf = JournalConfig(fsync=FsyncPolicy.parse("20"))
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        monkeypatch.setattr(fileio, "_current", FsyncFails())
        # the spin logs one error per iteration; keep the test output readable
        monkeypatch.setattr(logging.getLogger("queued.journal"), "disabled", True)
        await q.append([b"a"], T0)  # acknowledged after the write (periodic policy)
        before = dd.statistics().rounds
        await trio.sleep(0.5)
        rounds = dd.statistics().rounds - before
        monkeypatch.undo()
    assert q.failed is not None
    assert rounds < 20, f"writer ran {rounds} rounds in 0.5 s while idle"


async def test_read_back_during_compaction_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read-back right after compaction retires a replaced original (as a consumer's
    # read-behind in another worker thread could) finds every record: the new segment
    # list is published before the originals go. (The read runs in the file system seam,
    # right after the unlink: a compiled DataDir's methods cannot be replaced.)
    conf = JournalConfig(journal_size=620)
    seen: list[object] = []

    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for _ in range(13):
            await q.append([ITEM], T0)
        assert [(s.first_id, s.last_id) for s in q.segments] == [
            (1, 4), (5, 8), (9, 12), (13, 13)
        ]
        await q.write_checkpoint("", 0, [1, 2, 3, 5, 6, 7])

        class UnlinkThenRead(fileio.FileIO):
            def unlink(self, path: fileio.StrPath) -> None:
                super().unlink(path)
                parsed = jf.parse_file_name(Path(path).name)
                if parsed is not None and parsed.role is jf.FileRole.SEGMENT:
                    try:
                        seen.append([p.id for p in q.iter_puts(1)])
                    except Exception as exc:
                        seen.append(exc)

        monkeypatch.setattr(fileio, "_current", UnlinkThenRead())
        result = await q.compact()
        assert result.rewritten == 2
    assert seen == [[4, 8, 9, 10, 11, 12, 13]], seen


async def test_drop_oldest_does_not_drop_everything_for_an_item_that_can_never_fit(
    tmp_path: Path,
) -> None:
    # make_room calls drop_oldest(limit - incoming) with a negative target when one
    # item is bigger than max_journal_size: every segment but the newest is dropped
    # (items lost, checkpoints moved) and the put is refused anyway.
    conf = JournalConfig(journal_size=620, max_journal_size=2000,
                         full_policy=FullPolicy.DROP_OLDEST)
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for _ in range(13):
            await q.append([ITEM], T0)
        with pytest.raises(JournalFullError):
            await q.append([b"y" * 5000], T0)
        assert [p.id for p in q.iter_puts(1)] == list(range(1, 14)), "items were dropped"


async def test_drop_oldest_of_a_compaction_output_does_not_overwrite_the_archived_original(
    tmp_path: Path,
) -> None:
    # With archive_dir, rewrite_run copies the original q.<last> into the archive and
    # renames the compaction output over it. When drop_oldest later retires that
    # output it must be deleted, not archived over the original (ids 5..8) with its
    # compacted subset (ids 4, 8).
    archive = tmp_path / "archive"
    conf = JournalConfig(journal_size=620)
    data = tmp_path / "data"
    async with open_data_dir(data, DataDirConfig(archive_dir=archive),
                             queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for _ in range(13):
            await q.append([ITEM], T0)
        await q.write_checkpoint("", 0, [1, 2, 3, 5, 6, 7])
        await q.compact()
        await q.drop_oldest(q.total_bytes - 1)

    archived: set[int] = set()
    for p in archive.iterdir():
        for d in jf.decode_all(p.read_bytes()):
            if isinstance(d.record, jf.Put):
                archived.add(d.record.id)
    assert set(range(1, 9)) <= archived, f"archive lost ids {set(range(1, 9)) - archived}"


class FirstFsyncHeldThenFails(fileio.FileIO):
    """The next fsync waits for `release`, then fails with EIO; later ones succeed, as on
    Linux, where a write-back error is reported to one fsync of the file and not again."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()
        self.failed_once = False

    def fsync(self, fd: int) -> None:
        if not self.failed_once:
            self.failed_once = True
            self.held.set()
            self.release.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        super().fsync(fd)


async def test_a_put_waiting_behind_a_failed_fsync_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put appended while the round before it was failing is refused, not written into
    the failed file and acknowledged by the next fsync (which reports no error: the EIO
    was already reported once)."""
    conf = JournalConfig(fsync=FsyncPolicy.parse("always"))
    fake = FirstFsyncHeldThenFails()
    outcome: dict[str, str] = {}

    async def put(q: object, data: bytes) -> None:
        try:
            await q.append([data], T0)  # type: ignore[attr-defined]
            outcome[data.decode()] = "acknowledged"
        except JournalWriteError:
            outcome[data.decode()] = "refused"

    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)  # opens the segment
        monkeypatch.setattr(fileio, "_current", fake)
        monkeypatch.setattr(logging.getLogger("queued.journal"), "disabled", True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put, q, b"b")
            await wait_until(lambda: bool(fake.held.is_set()), timeout=10)
            nursery.start_soon(put, q, b"c")  # appended before the failure is known
            await trio.testing.wait_all_tasks_blocked(0.05)
            fake.release.set()
    assert outcome == {"b": "refused", "c": "refused"}
