"""A full disk: a 2 MiB tmpfs fills up under the journal.

ENOSPC must refuse the batch that did not fit (nothing partial left behind,
recovery cuts 0 bytes), keep every append acknowledged before it, leave the
journal usable once space is freed (ENOSPC is not a fatal write error), and
still never acknowledge without fsync. Needs root (mount); skipped otherwise.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import crash_driver as drv
import pytest
import trio
from disk_util import fill, fill_completely

from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.errors import JournalWriteError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage import journal as journal_module
from queued.storage.datadir import DataDir
from queued.storage.journal import QueueJournal, wait_durable
from queued.storage.opening import open_data_dir

pytestmark = pytest.mark.slow

Q = "jobs"
KiB = 1024


def item(i: int, size: int = 0) -> bytes:
    base = drv.data_for(i)
    return (base * (size // len(base) + 1))[: max(size, len(base))] if size else base


def config(journal_size: int, fsync: str = "always"):  # type: ignore[no-untyped-def]
    cfg = JournalConfig(journal_size=journal_size, fsync=FsyncPolicy.parse(fsync))
    return lambda _name: cfg


def segment_files(datadir: Path) -> list[str]:
    return sorted(
        n for n in os.listdir(datadir)
        if (p := jf.parse_file_name(n)) is not None and p.role is jf.FileRole.SEGMENT
    )


def check_recovered(datadir: Path, expected: dict[int, bytes]) -> DataDir:
    """Clean scan (nothing cut), exactly the expected items with their bytes."""
    dd = DataDir.open(datadir)
    rep = dd.report.queues[Q]
    assert rep.truncated_bytes == 0, f"recovery cut {rep.damage}"
    assert rep.damage == []
    q = dd.queues[Q]
    got = {p.id: p.data for p in q.iter_puts(1)}
    assert sorted(got) == sorted(expected), (
        f"missing {sorted(set(expected) - set(got))[:10]}, "
        f"unexpected {sorted(set(got) - set(expected))[:10]}"
    )
    bad = [i for i in expected if got[i] != expected[i]]
    assert not bad, f"items with wrong data: {bad[:10]}"
    assert all(s.count for s in q.segments), "an empty segment was left behind"
    return dd


async def append_checked(q: QueueJournal, n: int, size: int) -> dict[int, bytes]:
    first = q.last_id + 1
    datas = [item(first + k, size) for k in range(n)]
    puts = await q.append(datas, 1)
    assert [p.id for p in puts] == list(range(first, first + n))
    return {p.id: p.data for p in puts}


async def test_enospc_refuses_the_batch_keeps_the_rest_and_recovers(tmpfs: Path) -> None:
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    fill(filler, leave=300 * KiB)
    acked: dict[int, bytes] = {}
    async with open_data_dir(datadir, DataDirConfig(), config(64 * KiB)) as dd:
        q = dd.queue(Q)
        error: JournalWriteError | None = None
        for _ in range(2000):
            try:
                acked |= await append_checked(q, 7, 1500)
            except JournalWriteError as exc:
                error = exc
                break
        assert error is not None, "the 2 MiB tmpfs never filled up"
        assert "no space" in str(error).lower() or "refuse" in str(error).lower(), error
        assert len(acked) > 100
        assert q.failed is None, "ENOSPC must not fail the journal for good"
        assert q.statistics().write_errors >= 1

        # Still full: refused again, still not fatal, still nothing partial.
        with pytest.raises(JournalWriteError):
            await append_checked(q, 7, 1500)
        assert q.failed is None

        # Free the space: appends work again, into the same journal.
        filler.unlink()
        after = await append_checked(q, 20, 1500)
        assert min(after) > max(acked)
        acked |= after
        acked |= await append_checked(q, 3, 10)
    check_recovered(datadir, acked)  # exactly the acknowledged items: no refused one


async def test_enospc_on_a_write_done_at_once_refuses_that_put_only(tmpfs: Path) -> None:
    """fsync never: most appends are written at once by the caller (no writer round);
    one that hits ENOSPC is refused the same way (trimmed, not acknowledged, not fatal)."""
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    fill(filler, leave=300 * KiB)
    acked: dict[int, bytes] = {}
    async with open_data_dir(datadir, DataDirConfig(), config(1024 * KiB, "never")) as dd:
        q = dd.queue(Q)
        acked |= await append_checked(q, 1, 10)  # opens the segment (a round)
        error: JournalWriteError | None = None
        for _ in range(2000):
            rounds = dd.statistics().rounds
            first = q.last_id + 1
            datas = [item(first + k, 1500) for k in range(7)]
            _, ticket = q.append_nowait(datas, 1)
            assert ticket.done, "a put that needs no fsync waits for a round"
            assert dd.statistics().rounds == rounds + 1
            try:
                await wait_durable(ticket)
            except JournalWriteError as exc:
                error = exc
                break
            acked |= {first + k: d for k, d in enumerate(datas)}
        assert error is not None, "the 2 MiB tmpfs never filled up"
        assert q.failed is None and q.statistics().write_errors >= 1
        filler.unlink()
        acked |= await append_checked(q, 5, 1500)
    check_recovered(datadir, acked)  # exactly the acknowledged items, nothing partial


async def test_enospc_in_the_middle_of_a_segment_is_trimmed(tmpfs: Path) -> None:
    """One big segment: the batch that does not fit is cut back, later ones work again."""
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    fill(filler, leave=64 * KiB)
    acked: dict[int, bytes] = {}
    async with open_data_dir(datadir, DataDirConfig(), config(4 << 20)) as dd:
        q = dd.queue(Q)
        error: JournalWriteError | None = None
        for size in [100] * 50 + [3000] * 100:
            try:
                acked |= await append_checked(q, 1, size)
            except JournalWriteError as exc:
                error = exc
                break
        assert error is not None and q.failed is None
        # Still the first segment: the partial batch was trimmed off it, to the byte.
        [seg] = q.segments
        assert seg.path.stat().st_size == seg.size
        assert segment_files(datadir) == [seg.path.name]
        filler.unlink()
        acked |= await append_checked(q, 5, 3000)
    check_recovered(datadir, acked)


async def test_disk_full_exactly_when_a_new_segment_is_created(tmpfs: Path) -> None:
    """The rotation's new segment cannot be written: refused, no stray file, then works."""
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    journal_size = 3000  # every segment fits in one tmpfs page: appends into it need no space
    acked: dict[int, bytes] = {}
    async with open_data_dir(datadir, DataDirConfig(), config(journal_size)) as dd:
        q = dd.queue(Q)
        acked |= await append_checked(q, 1, 100)
        fill_completely(filler)
        before = segment_files(datadir)
        assert len(before) == 1
        error: JournalWriteError | None = None
        for _ in range(100):
            try:
                acked |= await append_checked(q, 1, 100)
            except JournalWriteError as exc:
                error = exc
                break
            assert segment_files(datadir) == before, "rotated although the disk is full?"
        assert error is not None
        assert "no space" in str(error).lower(), error
        assert q.failed is None
        assert q.segments[-1].size + 100 + jf.PUT_HEADER_SIZE + jf.CHECK_RECORD_SIZE \
            > journal_size, "the failure must be the rotation, not an append into the segment"
        assert segment_files(datadir) == before, "the unwritable new segment was left behind"
        assert [s.path.name for s in q.segments] == before

        # Again while still full: the retry also creates and removes its segment.
        with pytest.raises(JournalWriteError):
            await append_checked(q, 2, 100)
        assert segment_files(datadir) == before

        filler.unlink()
        acked |= await append_checked(q, 30, 100)
        assert len(segment_files(datadir)) >= 2
        assert [s.path.name for s in q.segments] == segment_files(datadir)
    check_recovered(datadir, acked)


async def test_batch_acked_in_a_round_whose_later_batch_hit_enospc_was_fsynced(
    tmpfs: Path,
) -> None:
    """Durability contract: an ack under fsync=always implies an fsync after the write.

    Two appends land in one writer round: the first fits into the active segment,
    the second must rotate into a new segment and hits ENOSPC. The first one is
    acknowledged, so its bytes must have been fsynced before the ack.
    """
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    journal_size = 3000
    async with open_data_dir(datadir, DataDirConfig(), config(journal_size)) as dd:
        q = dd.queue(Q)
        await append_checked(q, 1, 100)
        fill_completely(filler)
        fsyncs_before = q.statistics().fsyncs
        first = q.last_id + 1
        small = item(first, 100)
        puts1, ticket1 = q.append_nowait([small], 1)
        puts2, ticket2 = q.append_nowait([item(first + 1, journal_size)], 1)
        assert [p.id for p in puts1 + puts2] == [first, first + 1]
        await wait_durable(ticket1)  # fits into the page the segment already has
        with pytest.raises(JournalWriteError):
            await wait_durable(ticket2)
        assert q.failed is None
        # Acknowledged above: it must have been fsynced (it is what makes the ack durable).
        assert q.statistics().fsyncs > fsyncs_before, (
            "append acknowledged under fsync=always without an fsync after its write"
        )
        filler.unlink()
    with trio.fail_after(5):
        await trio.to_thread.run_sync(DataDir.open, datadir)


async def test_batch_acked_before_a_split_batch_hit_enospc_was_fsynced(
    tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same contract without a rotation: one segment, the round split in two batches.

    A round is split into several checked batches past MAX_BATCH_BYTES (lowered
    here so the 2 MiB tmpfs can hold it). The first batch is written, the second
    hits ENOSPC: the first one's append is acknowledged, so it must be fsynced.
    """
    monkeypatch.setattr(journal_module, "MAX_BATCH_BYTES", 2048)
    datadir = tmpfs / "data"
    datadir.mkdir()
    filler = tmpfs / "filler"
    async with open_data_dir(datadir, DataDirConfig(), config(4 << 20)) as dd:
        q = dd.queue(Q)
        await append_checked(q, 1, 100)
        fill_completely(filler)  # the segment's one page still has ~3.8 KiB of room
        fsyncs_before = q.statistics().fsyncs
        first = q.last_id + 1
        _puts1, ticket1 = q.append_nowait([item(first, 1000)], 1)
        _puts2, ticket2 = q.append_nowait([item(first + 1, 3000)], 1)
        outcome1: BaseException | None = None
        try:
            await wait_durable(ticket1)
        except JournalWriteError as exc:
            outcome1 = exc
        with pytest.raises(JournalWriteError):
            await wait_durable(ticket2)
        assert len(q.segments) == 1
        if outcome1 is None:  # acknowledged: then it must have been fsynced
            assert q.statistics().fsyncs > fsyncs_before, (
                "append acknowledged under fsync=always without an fsync after its write "
                "(the round stopped at the failed batch and skipped the fsync)"
            )
        filler.unlink()
        acked = await append_checked(q, 2, 100)
    expected = {1: item(1, 100), **acked}
    if outcome1 is None:
        expected[first] = item(first, 1000)
    check_recovered(datadir, expected)


class FailingFsync(fileio.FileIO):
    """The storage layer's file calls (queued.storage.fileio); `fail` makes the next
    fsync of a file raise it.

    On a delayed-allocation filesystem (ext4, XFS, NFS) a full disk can surface
    at fsync time as ENOSPC, after write() succeeded.
    """

    def __init__(self) -> None:
        self.fail: int | None = None

    def fsync(self, fd: int) -> None:
        if self.fail is not None:
            code, self.fail = self.fail, None
            raise OSError(code, os.strerror(code))
        os.fsync(fd)


async def test_enospc_from_fsync_at_rotation_is_not_an_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsync that fails (even with ENOSPC) must not acknowledge what it covered.

    One round: the first append fits into segment A, the second rotates to a new
    segment, and fsyncing A before leaving it fails with ENOSPC. The first
    append's bytes were never made durable: it must not be acknowledged, and
    per the durability contract a failed fsync is fatal to writes.
    """
    fake = FailingFsync()
    monkeypatch.setattr(fileio, "_current", fake)
    datadir = tmp_path / "data"
    async with open_data_dir(datadir, DataDirConfig(), config(2048)) as dd:
        q = dd.queue(Q)
        await append_checked(q, 1, 100)
        first = q.last_id + 1
        _, ticket1 = q.append_nowait([item(first, 100)], 1)
        _, ticket2 = q.append_nowait([item(first + 1, 3000)], 1)
        fake.fail = errno.ENOSPC
        acked1 = True
        try:
            await wait_durable(ticket1)
        except JournalWriteError:
            acked1 = False
        with pytest.raises(JournalWriteError):
            await wait_durable(ticket2)
        assert fake.fail is None, "the rotation fsynced the old segment"
        assert not acked1, "append acknowledged although the fsync covering it failed"
        assert q.failed is not None, "a failed fsync must make the journal refuse writes"
