"""The writer on its own, against real files: one round's batches on disk, rotation,
fsync deadlines, and which rounds run inline on the event loop instead of in a thread."""

from __future__ import annotations

import os
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from segment_util import chunk, puts_in

from queued.config import FsyncPolicy
from queued.journal import format as jf
from queued.storage import fileio, synced_files
from queued.storage import writer as writer_module
from queued.storage.writer import RoundThread, Writer, WriteResult

PERIODIC = FsyncPolicy.parse("3600000")  # an hour: due only when a test says so


async def test_a_round_writes_one_checked_batch_per_chunk(tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    file = writer.segment_file("q", FsyncPolicy(), 0)
    big = b"B" * 5000  # written from its own buffer (writev), not copied
    [result] = await writer.write_round([(file, [chunk(1, [b"a", b"b"]), chunk(3, [big])])])
    assert result.error is None
    first, second = result.written
    assert first.created and not second.created and first.number == second.number
    assert first.offset == jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE and second.offset == first.end
    assert (first.first_id, first.last_id, second.first_id) == (1, 2, 3)
    path = tmp_path / jf.segment_name("q", first.number)
    assert path.stat().st_size == second.end and path.stat().st_ino == first.inode
    assert puts_in(path) == [(1, b"a"), (2, b"b"), (3, big)]
    checks = [d for d in jf.decode_all(path.read_bytes()) if isinstance(d.record, jf.Check)]
    assert [c.end for c in checks] == [jf.MAGIC_SIZE + jf.CHECK_RECORD_SIZE, first.end,
                                       second.end]
    assert file.fsyncs == 1 and writer.statistics().rounds == 1
    assert writer.statistics().fsync.count == 1


async def test_rotation_fsyncs_the_segment_it_leaves_and_numbers_go_up(tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    file = writer.segment_file("q", FsyncPolicy(), 10**13)  # newest existing segment
    [one] = await writer.write_round([(file, [chunk(1, [b"a"])])])
    [two] = await writer.write_round([(file, [chunk(2, [b"b"]), chunk(3, [b"c"], rotate=True)])])
    assert one.written[0].number == 10**13 + 1
    assert [w.created for w in two.written] == [False, True]
    assert two.written[1].number == one.written[0].number + 1
    assert file.fsyncs == 3  # round one; round two: the segment it left, then the new one
    paths = sorted(tmp_path.iterdir())
    assert [puts_in(p) for p in paths] == [[(1, b"a"), (2, b"b")], [(3, b"c")]]


async def test_periodic_fsync_deadline(tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    file = writer.segment_file("q", PERIODIC, 0)
    assert file.fsync_deadline() is None  # nothing unsynced
    await writer.write_round([(file, [chunk(1, [b"a"])])])
    assert file.fsync_deadline() is not None
    assert file.fsyncs == 0  # not due yet: acknowledged after the write alone
    file.set_failed("test")
    assert file.fsync_deadline() is None  # a failed file owes nothing any more
    assert file.failed is not None and "refuses writes: test" in str(file.failed)
    file.close()


async def test_only_a_small_round_without_fsync_or_new_file_runs_inline(
        tmp_path: Path) -> None:
    """A round off the event loop is held in its thread here until released, so one that
    ran on the loop instead is seen at once."""
    loop_thread = threading.current_thread()
    release = threading.Event()

    def held_round(*args: Any) -> Any:
        if threading.current_thread() is not loop_thread:
            release.wait(10)
        return writer_module.run_round(*args)

    writer = Writer(tmp_path)
    writer.run_round = held_round
    file = writer.segment_file("q", FsyncPolicy.parse("never"), 0)
    results: list[WriteResult] = []

    async def round_(n: int, *, rotate: bool = False) -> None:
        results.extend(await writer.write_round([(file, [chunk(n, [b"x"], rotate=rotate)])]))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(round_, 1)  # opens the segment: its thread
            await trio.testing.wait_all_tasks_blocked()
            assert results == [], "a round that opens a file ran on the event loop"
            release.set()
        release.clear()
        with trio.fail_after(5):  # a bound, not a timing: an inline round never waits
            await round_(2)
        assert len(results) == 2
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(round_, 3, rotate=True))
            await trio.testing.wait_all_tasks_blocked()
            assert len(results) == 2, "a round that rotates ran on the event loop"
            release.set()
    finally:
        release.set()
        writer.close()
    assert [[w.created for w in r.written] for r in results] == [[True], [False], [True]]
    assert writer.statistics().rounds == 3
    file.close()


async def test_the_round_thread_runs_jobs_off_the_loop_and_hands_back_errors() -> None:
    rt = RoundThread()
    try:
        worker = await rt.run(threading.current_thread)
        assert worker is not threading.current_thread() and worker.is_alive()
        assert await rt.run(lambda a, b: a + b, 2, 3) == 5

        def fail() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space"):
            await rt.run(fail)
        assert await rt.run(lambda: "still serving") == "still serving"
        with trio.CancelScope() as scope:  # a job is never abandoned: it ends shielded
            scope.cancel()
            assert await rt.run(lambda: 7) == 7
    finally:
        rt.close()
    assert not worker.is_alive()


def _many_files_round(writer: Writer, n: int) -> tuple[list[Any], list[WriteResult]]:
    files = [writer.segment_file(f"q{i}", FsyncPolicy(), 0) for i in range(n)]
    results = writer.write_round_now([(f, [chunk(1, [b"x%d" % i])])
                                      for i, f in enumerate(files)])
    return files, results


@pytest.mark.parametrize("log_fails", [False, True])
def test_a_round_on_the_callers_thread_has_one_durable_point_for_many_files(
        tmp_path: Path, log_fails: bool) -> None:
    # Power cut right after the round: every file's batches and every new file's name
    # must be durable (written back from the intent log by the next start), though the
    # round made one fsync (of the intent log), not one per file. When the log cannot
    # be written (a full disk), the round syncs the files at once (sync_files) instead,
    # and the log is used again once it can be.
    from power_util import PowerLossFS

    from queued.storage import fileio
    from queued.storage.intent_log import INTENT_FILE, replay

    class LogFails(PowerLossFS):  # (no room for the log's zeros)
        def pwrite(self, fd: int, data: Any, offset: int) -> int:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(INTENT_FILE):
                raise OSError(28, "No space left on device")
            return super().pwrite(fd, data, offset)

    fs = (LogFails if log_fails else PowerLossFS)(tmp_path)
    previous = fileio.use(fs)
    try:
        writer = Writer(tmp_path)
        calls = fs.sync_files_calls
        before = fs.fsyncs
        files, results = _many_files_round(writer, writer_module.SYNC_TOGETHER + 1)
        assert all(r.error is None and r.written for r in results)
        assert all(f.fsyncs == 1 for f in files)
        if log_fails:
            assert calls == [len(files)] and writer.intents.failed is None
            assert writer.intents.appends == 0
        else:
            # the log's head and its directory entry when it is made, then one fsync
            assert calls == [] and fs.fsyncs - before == 2 and writer.intents.appends == 1
            assert all(fs.names[str(tmp_path / jf.segment_name(f"q{i}", r.written[0].number))
                             ].durable == b"" for i, r in enumerate(results))
        cut = fs.cut()
        for f in files:
            f.close()
        writer.intents.release()
        writer.close()
        fs.restore(cut)
        replay(tmp_path)
        assert not (tmp_path / INTENT_FILE).exists()
        for i, r in enumerate(results):
            path = tmp_path / jf.segment_name(f"q{i}", r.written[0].number)
            assert puts_in(path) == [(1, b"x%d" % i)]
    finally:
        fileio.use(previous)


def test_a_failed_sync_of_many_files_fails_them_all(tmp_path: Path) -> None:
    # The intent log's fsync fails, and so does the sync of the files that follows it.
    from queued.storage import fileio

    class FailingSync(fileio.FileIO):
        def fsync(self, fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith("queued-intents"):
                raise OSError(5, "Input/output error")
            super().fsync(fd)

        def sync_files(self, fds: Any, directory: Any) -> None:
            raise OSError(5, "Input/output error")

    previous = fileio.use(FailingSync())
    try:
        writer = Writer(tmp_path)
        files, results = _many_files_round(writer, writer_module.SYNC_TOGETHER)
        assert all(not r.written and r.error is not None for r in results)
        assert all(f.failed is not None for f in files)  # they refuse writes for good
        for f in files:
            f.close()
        writer.close()
    finally:
        fileio.use(previous)


# Small items are copied into one piece; an item of 4 KiB or more is a piece of its own
# (and its header another): 600 of them are more pieces than one writev takes (IOV_MAX).
@pytest.mark.parametrize(("items", "size"), [(3, 10), (600, 4096)])
def test_a_short_writev_is_finished_with_the_rest_of_its_pieces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, items: int, size: int) -> None:
    """writev may write less than asked (a signal, a nearly full disk): the batch on disk
    is still every piece, in order, once, whether the chunk fits in one writev or not."""
    shorts: list[int] = []

    class Short(fileio.FileIO):
        def writev(self, fd: int, buffers: Any) -> int:
            total = sum(len(b) for b in buffers)
            if total < 20:
                return super().writev(fd, buffers)
            half = b"".join(buffers)[: total // 2 + 3]  # (stops inside a piece)
            shorts.append(total)
            return fileio.FileIO.write(self, fd, half)

    monkeypatch.setattr(fileio, "_current", Short())
    writer = Writer(tmp_path)
    file = writer.segment_file("q", FsyncPolicy.parse("never"), 0)
    datas = [b"%05d" % i + bytes(size - 5) for i in range(items)]
    [result] = writer.write_round_now([(file, [chunk(1, datas)])])
    assert result.error is None
    assert shorts and (len(shorts) > 1) == (items * 2 > synced_files.IOV_MAX)
    [w] = result.written
    path = tmp_path / jf.segment_name("q", w.number)
    assert path.stat().st_size == w.end
    assert puts_in(path) == list(enumerate(datas, 1))
