"""Readers' checkpoint files as the writer keeps them (queued.storage.writer.ReaderFile,
QueueJournal.note_read / write_checkpoint / remove_reader) against real files: confirms
and abort error counts appended between checkpoints, synced by the queue's fsync policy,
rewrites that cover the appends planned before them, and recovery of a torn append.

The server-level crash tests for durable confirms are in test_confirm_durability.py.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from journal_util import T0, cfg, data_for
from wait_util import wait_until

from queued.config import FsyncPolicy
from queued.errors import JournalWriteError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage.datadir import DataDir
from queued.storage.files import Checkpoint, decode_checkpoint
from queued.storage.journal import QueueJournal, wait_durable
from queued.storage.opening import open_data_dir


class Tracker(fileio.FileIO):
    """The storage layer's file calls, recording which files hold bytes not yet fsynced."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.unsynced: set[str] = set()
        self.fsynced: list[str] = []
        self.fail_writes_to: str | None = None

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.names[fd] = Path(path).name
        return fd

    def writev(self, fd: int, buffers: object) -> int:
        name = self.names.get(fd, "")
        if name == self.fail_writes_to:
            raise OSError(errno.EIO, "Input/output error")
        n = super().writev(fd, buffers)  # type: ignore[arg-type]
        self.unsynced.add(name)
        return n

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self.unsynced.discard(self.names.get(fd, ""))
        self.fsynced.append(self.names.get(fd, ""))

    def close(self, fd: int) -> None:
        super().close(fd)
        self.names.pop(fd, None)


@pytest.fixture
def tracker(monkeypatch: pytest.MonkeyPatch) -> Tracker:
    """A Tracker in place of the storage layer's file calls for the test."""
    tracker = Tracker()
    monkeypatch.setattr(fileio, "_current", tracker)
    return tracker


@asynccontextmanager
async def checkpointed(path: Path, n: int, head: int, fsync: str | None = None
                       ) -> AsyncIterator[QueueJournal]:
    """Queue q of a data directory open in `path`: items 1 to n, its reader's checkpoint
    written at `head` (under fsync policy `fsync`, if given)."""
    policy = None if fsync is None else FsyncPolicy.parse(fsync)
    queue_config = None if policy is None else (lambda _: cfg(fsync=policy))
    async with open_data_dir(path, queue_config=queue_config) as dd:
        q = dd.queue("q")
        await q.append([data_for(i) for i in range(1, n + 1)], T0)
        await q.write_checkpoint("", head)
        yield q


def records(path: Path) -> list[jf.Record]:
    return [d.record for d in jf.decode_all(path.read_bytes(), jf.FileKind.READER)
            if not isinstance(d.record, jf.Check)]


async def two_appends_after(path: Path, head: int) -> Path:
    """Queue q in `path`: items 1 to 5, its reader's checkpoint written at `head`, then two
    appends (3 done, 4 done), each durable; the reader's file."""
    async with checkpointed(path, 5, head) as q:
        await wait_durable(q.note_read("", done=[3]))
        await wait_durable(q.note_read("", done=[4]))
    return path / "q.read."


async def test_confirms_and_error_counts_are_appended_and_recovered(tmp_path: Path) -> None:
    async with checkpointed(tmp_path, 8, 1) as q:
        await wait_durable(q.note_read("", done=[5, 3]))
        await wait_durable(q.note_read("", errors=[(2, 1), (4, 2)]))
        await wait_durable(q.note_read("", errors=[(2, 3)], done=[4]))
    assert records(tmp_path / "q.read.") == [
        jf.ReadHead(1), jf.ReadDone(()),  # the checkpoint, written whole
        jf.ReadDone((3, 5)),
        jf.ReadErrors(((2, 1), (4, 2))),
        jf.ReadDone((4,)), jf.ReadErrors(((2, 3),)),
    ]
    dd2 = DataDir.open(tmp_path)
    assert dd2.queues["q"].readers[""] == Checkpoint(1, (3, 4, 5), ((2, 3),))
    assert [p.id for p in dd2.queues["q"].iter_unconsumed("")] == [2, 6, 7, 8]


async def test_appends_planned_before_a_round_share_one_batch_and_one_fsync(
    tmp_path: Path, tracker: Tracker
) -> None:
    async with checkpointed(tmp_path, 4, 0, fsync="always") as q:
        fsyncs = tracker.fsynced.count("q.read.")
        tickets = [q.note_read("", done=[i]) for i in (4, 2, 3)]
        for ticket in tickets:
            await wait_durable(ticket)
            assert "q.read." not in tracker.unsynced, "a confirm acknowledged before its fsync"
        assert tickets[0] is tickets[2], "appends of one round share a ticket"
        assert tracker.fsynced.count("q.read.") == fsyncs + 1
    assert records(tmp_path / "q.read.")[2:] == [jf.ReadDone((2, 3, 4))]


async def test_a_rewrite_covers_the_appends_planned_before_it(tmp_path: Path) -> None:
    async with checkpointed(tmp_path, 5, 0) as q:
        before = q.note_read("", done=[2])
        async with trio.open_nursery() as nursery:  # append, rewrite, append, in this order
            nursery.start_soon(q.write_checkpoint, "", 2, [], [(3, 1)])
            for _ in range(1000):  # until the rewrite is planned (or already written)
                if q.readers[""].head == 2 or any(
                        op.rewrite for _, ops in q.planned_readers for op in ops):
                    break
                await trio.sleep(0)
            after = q.note_read("", done=[4])
        await wait_durable(before)
        await wait_durable(after)
        assert q.readers[""] == Checkpoint(2, (), ((3, 1),))
    assert records(tmp_path / "q.read.") == [
        jf.ReadHead(2), jf.ReadDone(()), jf.ReadErrors(((3, 1),)), jf.ReadDone((4,))]
    assert DataDir.open(tmp_path).queues["q"].readers[""] == Checkpoint(2, (4,), ((3, 1),))


async def test_a_torn_append_is_cut_at_recovery_and_appends_go_on(tmp_path: Path) -> None:
    cp = await two_appends_after(tmp_path, head=1)
    whole = cp.read_bytes()
    cp.write_bytes(whole[:-4])  # the last append torn by a crash: never acknowledged
    dd2 = DataDir.open(tmp_path)
    rep = dd2.report.queues["q"]
    assert dd2.queues["q"].readers[""] == Checkpoint(1, (3,))
    assert rep.unreadable_checkpoints == []
    assert rep.truncated_bytes == len(whole) - 4 - decode_checkpoint(whole[:-4])[1]
    assert decode_checkpoint(cp.read_bytes())[1] == cp.stat().st_size  # written anew, clean
    async with open_data_dir(tmp_path) as dd3:
        await wait_durable(dd3.queues["q"].note_read("", done=[5]))
    assert DataDir.open(tmp_path).queues["q"].readers[""] == Checkpoint(1, (3, 5))


async def test_damage_before_a_verified_append_is_corruption(tmp_path: Path) -> None:
    cp = await two_appends_after(tmp_path, head=2)
    raw = bytearray(cp.read_bytes())
    first_append = len(jf.encode_checkpoint(2, ()))
    raw[first_append + 6] ^= 0xFF  # inside the first append's id; the second verifies
    cp.write_bytes(bytes(raw))
    dd2 = DataDir.open(tmp_path)
    assert dd2.report.queues["q"].unreadable_checkpoints == ["q.read."]
    assert dd2.queues["q"].readers[""] == Checkpoint()  # replayed from the oldest segment


async def test_an_append_to_a_reader_without_its_file_fails_unless_it_may_create_it(
    tmp_path: Path,
) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")  # a new queue: its default reader has no file yet, head 0
        await q.append([data_for(i) for i in range(1, 4)], T0)
        await wait_durable(q.note_read("", done=[2]))
        with pytest.raises(JournalWriteError, match="missing"):
            await wait_durable(q.note_read("x", done=[1]))  # never written durably
    assert not (tmp_path / "q.read.x").exists()
    assert DataDir.open(tmp_path).queues["q"].readers == {"": Checkpoint(0, (2,))}


async def test_a_failed_append_is_not_acknowledged_and_later_ones_work(
    tmp_path: Path, tracker: Tracker
) -> None:
    async with checkpointed(tmp_path, 3, 0) as q:
        await wait_durable(q.note_read("", done=[1]))
        tracker.fail_writes_to = "q.read."
        with pytest.raises(JournalWriteError):
            await wait_durable(q.note_read("", done=[2]))
        tracker.fail_writes_to = None
        with pytest.raises(JournalWriteError, match="refuses writes"):  # EIO: for good
            await wait_durable(q.note_read("", done=[3]))
        await q.write_checkpoint("", 3)  # checkpoints are still written
    assert DataDir.open(tmp_path).queues["q"].readers[""] == Checkpoint(3)


async def test_periodic_fsync_covers_reader_files(
    tmp_path: Path, tracker: Tracker
) -> None:
    """fsync = "<ms>": a confirm is acknowledged after its write and fsynced when the
    interval is over, by the writer waking itself (nothing else is written meanwhile)."""
    async with checkpointed(tmp_path, 3, 0, fsync="20") as q:
        await wait_durable(q.note_read("", done=[2]))
        await wait_until(lambda: "q.read." not in tracker.unsynced, timeout=10)
        assert tracker.fsynced.count("q.read.") >= 1


async def test_ids_named_by_error_counts_are_never_reused(tmp_path: Path) -> None:
    """Found by the power-loss test (fsync "<ms>"): an abort's error count was fsynced
    in the reader's file but the PUT records were not, and the power went out. Recovery
    must resume ids above every id the reader file names, or a new item would get the
    old one's id and its error count."""
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([data_for(1), data_for(2)], T0)
        await q.write_checkpoint("", 0)
        await wait_durable(q.note_read("", errors=[(2, 1)]))
    for seg in tmp_path.glob("q.1*"):
        seg.unlink()  # the segment's bytes never reached the disk
    async with open_data_dir(tmp_path) as dd:
        q = dd.queues["q"]
        assert q.last_id == 2
        [put] = await q.append([b"new"], T0)
        assert put.id == 3
