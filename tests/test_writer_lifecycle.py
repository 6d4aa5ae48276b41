"""Regression tests from a review of the writer task, delete_queue, aclose, periodic
fsync, compaction read-back races, drop_oldest and archive semantics. The comment in
each test describes the bug it guards against (all fixed; these pass)."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import pytest
import trio
import trio.testing
from journal_util import queue_files

from queued.config import DataDirConfig, FsyncPolicy, FullPolicy, JournalConfig
from queued.errors import JournalClosedError, JournalFullError, JournalWriteError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage import writer as writer_module
from queued.storage.datadir import DataDir, open_data_dir

T0 = 1_700_000_000_000
ITEM = b"x" * 100  # PUT record 125 bytes; with journal_size=620 a segment holds 4 items


async def test_delete_queue_during_a_round_leaves_no_segment_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # delete_queue snapshots j.segments BEFORE waiting for the round lock; a segment the
    # in-flight round creates is added by finish_round afterwards and is never unlinked.
    # The deleted queue comes back (with its items) at the next start.
    entered, release = threading.Event(), threading.Event()
    real_round = writer_module.run_round

    def slow_round(work, periodic, *pool):  # type: ignore[no-untyped-def]
        if work:
            entered.set()
            release.wait(5)
        return real_round(work, periodic, *pool)

    monkeypatch.setattr(writer_module, "run_round", slow_round)
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")

        async def put() -> None:
            await q.append([b"hello"], T0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(put)
            await trio.to_thread.run_sync(entered.wait, 5)
            nursery.start_soon(dd.delete_queue, "q")
            await trio.sleep(0.05)  # delete_queue is now waiting for the round lock
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
    # A read-back right after compaction retires the replaced originals (as a
    # consumer's read-behind in another worker thread could) finds every record:
    # the new segment list is published before the originals go.
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
        real_retire = dd.retire_segments

        def retire_then_read(segs):  # type: ignore[no-untyped-def]
            real_retire(segs)
            try:
                seen.append([p.id for p in q.iter_puts(1)])
            except Exception as exc:
                seen.append(exc)

        monkeypatch.setattr(dd, "retire_segments", retire_then_read)
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
            with trio.fail_after(10):
                while not fake.held.is_set():
                    await trio.sleep(0.01)
            nursery.start_soon(put, q, b"c")  # appended before the failure is known
            await trio.testing.wait_all_tasks_blocked(0.05)
            fake.release.set()
    assert outcome == {"b": "refused", "c": "refused"}
