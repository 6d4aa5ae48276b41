"""The intent log (queued.storage.intent_log): one fsync for a pass that wrote many segment
files under fsync "always", its records written back after a simulated power cut, and the
settle that must come before any segment is removed or replaced (else a record would
bring back a file that is gone, or write old bytes into the file that replaced it)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from power_util import PowerLossFS
from segment_util import T0, chunk, puts_in

from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.errors import NotSavedError
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage import writer as writer_module
from queued.storage.datadir import DataDir
from queued.storage.files import SegmentInfo
from queued.storage.intent_log import (
    _HEAD,
    FLUSH_BYTES,
    GROW_BYTES,
    INTENT_FILE,
    PASS_BYTES,
    RECORD_OVERHEAD,
    SETTLE_BYTES,
    ZERO_CHUNK,
    IntentLog,
    read_intents,
    replay,
)
from queued.storage.opening import open_data_dir
from queued.storage.synced_files import SegmentFile
from queued.storage.writer import Writer, WriteResult

N_FILES = writer_module.SYNC_TOGETHER + 1  # enough for a pass to use the log


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[PowerLossFS]:
    with installed(PowerLossFS(tmp_path)) as fs:
        yield fs


FS = TypeVar("FS", bound=PowerLossFS)


@contextlib.contextmanager
def installed(fs: FS) -> Iterator[FS]:
    """`fs` is what queued.storage.fileio calls while the block runs."""
    previous = fileio.use(fs)
    try:
        yield fs
    finally:
        fileio.use(previous)


def new_files(writer: Writer, n: int = N_FILES) -> list[SegmentFile]:
    return [writer.segment_file(f"q{i}", FsyncPolicy(), 0) for i in range(n)]


def a_pass(writer: Writer, files: list[SegmentFile], first_id: int,
           tag: bytes) -> list[WriteResult]:
    """One round of one item per file, as the reactor's pass commits it."""
    results = writer.write_round_now([(f, [chunk(first_id, [tag + b"%d" % i])])
                                      for i, f in enumerate(files)])
    assert all(r.error is None and r.written for r in results)
    return results


def paths_of(tmp_path: Path, results: list[WriteResult]) -> list[Path]:
    return [tmp_path / jf.segment_name(f"q{i}", r.written[0].number)
            for i, r in enumerate(results)]


def power_cut(fs: PowerLossFS, writer: Writer, files: list[SegmentFile]) -> None:
    """The power goes out: the directory becomes what the disk holds."""
    cut = fs.cut()
    for f in files:
        f.close()
    writer.close()
    fs.restore(cut)


def a_retirable_segment(tmp_path: Path) -> tuple[
        DataDir, list[SegmentFile], list[Path], list[SegmentInfo]]:
    """A data dir whose writer made one logged pass, the first file's segment closed: the
    dir, the files, their paths, and that segment to retire."""
    dd = DataDir.open(tmp_path)
    files = new_files(dd.writer)
    paths = paths_of(tmp_path, a_pass(dd.writer, files, 1, b"a"))
    files[0].close()
    return dd, files, paths, [SegmentInfo(1, paths[0], size=paths[0].stat().st_size)]


# Many files, and one or two whose pass is small (LOG_SMALL_PASS): the log stands for them.
@pytest.mark.parametrize("n_files", [1, 2, N_FILES])
def test_passes_come_back_from_the_log_alone(fs: PowerLossFS, tmp_path: Path,
                                             n_files: int) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer, n_files)
    paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
    a_pass(writer, files, 2, b"b")
    assert writer.intents.appends == 2
    assert all(fs.names[str(p)].durable == b"" for p in paths)  # no segment fsynced
    power_cut(fs, writer, files)
    # The files' entries are there (a pass that makes a file fsyncs the directory), their
    # bytes are not: all of them are in the log.
    assert [p.stat().st_size for p in paths] == [0] * n_files
    records, nbytes = replay(tmp_path)
    assert records == 2 * n_files
    assert nbytes == sum(p.stat().st_size for p in paths) > 0
    assert not (tmp_path / INTENT_FILE).exists()
    for i, p in enumerate(paths):
        assert puts_in(p) == [(1, b"a%d" % i), (2, b"b%d" % i)]
    assert replay(tmp_path) == (0, 0)  # nothing left to do


class ShortLogWrites(PowerLossFS):
    """Each write of the intent log's records takes at most 7 bytes (a short write)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.short = 0

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if any(bytes(data)) and os.readlink(f"/proc/self/fd/{fd}").endswith(INTENT_FILE):
            self.short += 1
            return super().pwrite(fd, bytes(data)[:7], offset)
        return super().pwrite(fd, data, offset)


def test_short_writes_of_the_log_are_finished(tmp_path: Path) -> None:
    with installed(ShortLogWrites(tmp_path)) as fs:
        writer = Writer(tmp_path)
        files = new_files(writer)
        paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
        assert fs.short > 10  # the records took many writes
        power_cut(fs, writer, files)
        assert replay(tmp_path)[0] == N_FILES
        assert [puts_in(p) for p in paths] == [[(1, b"a%d" % i)] for i in range(N_FILES)]


def test_a_file_the_cut_took_is_made_again_from_its_first_record(
        fs: PowerLossFS, tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer)
    paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
    power_cut(fs, writer, files)
    for p in paths[:2]:
        p.unlink()  # as if the directory entries were lost too
    assert replay(tmp_path)[0] == N_FILES
    assert [puts_in(p) for p in paths] == [[(1, b"a%d" % i)] for i in range(N_FILES)]


def test_a_record_for_a_file_removed_behind_its_back_is_skipped(
        fs: PowerLossFS, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer)
    paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
    writer.settle_intents()  # the files' first records are gone from the log
    a_pass(writer, files, 2, b"b")
    a_pass(writer, files, 3, b"c")
    power_cut(fs, writer, files)
    paths[0].unlink()  # (an operator, while the server was down)
    with caplog.at_level(logging.WARNING, "queued.journal"):
        records, _ = replay(tmp_path)
    assert records == 2 * (N_FILES - 1)
    assert not paths[0].exists()  # not made again as a hole with batches at its end
    assert caplog.text.count(f"{paths[0].name} is missing") == 1  # (once, not per record)
    assert [puts_in(p) for p in paths[1:]] == [
        [(1, b"a%d" % i), (2, b"b%d" % i), (3, b"c%d" % i)] for i in range(1, N_FILES)]


def test_records_read_back_up_to_a_torn_one(tmp_path: Path) -> None:
    log = IntentLog(tmp_path)
    name = jf.segment_name("q", 5)
    log.append([(name.encode(), 0, [b"head", b"er"]), (name.encode(), 6, [b"x" * 100])])
    log.append([(name.encode(), 106, [b"y" * 50])])
    data = (tmp_path / INTENT_FILE).read_bytes()
    end = log.size
    assert len(data) >= end and data[end:] == bytes(len(data) - end)  # zeros ahead
    records = read_intents(data)
    assert [(n, o, bytes(d)) for n, o, d in records] == [
        (name, 0, b"header"), (name, 6, b"x" * 100), (name, 106, b"y" * 50)]
    last = RECORD_OVERHEAD + len(name) + 50
    for cut in range(end - last, end):  # the last record torn anywhere (zeros after)
        assert len(read_intents(data[:cut] + bytes(len(data) - cut))) == 2, cut
    flipped = bytearray(data)
    flipped[end - 1] ^= 1
    assert len(read_intents(bytes(flipped))) == 2
    log.release()


def test_a_record_of_an_earlier_epoch_never_checks(tmp_path: Path) -> None:
    log = IntentLog(tmp_path)
    name = jf.segment_name("q", 5)
    log.append([(name.encode(), 0, [b"old bytes"]), (name.encode(), 9, [b"more"])])
    end = log.size
    old = (tmp_path / INTENT_FILE).read_bytes()
    log.settle()
    new = (tmp_path / INTENT_FILE).read_bytes()
    # A new head over the old one; the old records are still there behind it.
    assert new[: _HEAD.size] != old[: _HEAD.size] and new[_HEAD.size :] == old[_HEAD.size :]
    assert read_intents(old) != [] and read_intents(new) == []
    assert log.settles == 1 and log.size == _HEAD.size
    # The next record goes over the first old one; the second old one, after it, is
    # of the old epoch: it ends the read (its crc would not check either).
    log.append([(name.encode(), 0, [b"new bytes"])])
    assert log.size == end - len(b"more") - RECORD_OVERHEAD - len(name)
    assert [bytes(d) for _, _, d in read_intents((tmp_path / INTENT_FILE).read_bytes())] == [
        b"new bytes"]
    log.release()


def test_a_record_naming_anything_but_a_segment_stops_the_read(tmp_path: Path) -> None:
    log = IntentLog(tmp_path)
    log.append([(b"q.5", 0, [b"a"]), (b"q.read.r", 0, [b"b"]), (b"q.5", 1, [b"c"])])
    assert [n for n, _, _ in read_intents((tmp_path / INTENT_FILE).read_bytes())] == [
        jf.segment_name("q", 5)]
    log.release()


def test_a_settle_makes_every_file_durable_and_empties_the_log(
        fs: PowerLossFS, tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer)
    paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
    writer.settle_intents()
    assert writer.intents.settles == 1
    power_cut(fs, writer, files)
    assert read_intents((tmp_path / INTENT_FILE).read_bytes()) == []
    assert [puts_in(p) for p in paths] == [[(1, b"a%d" % i)] for i in range(N_FILES)]


def test_a_clean_close_settles_and_removes_the_log(fs: PowerLossFS, tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer)
    paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
    writer.intents.close()
    assert not (tmp_path / INTENT_FILE).exists()
    power_cut(fs, writer, files)  # (after the close: all of it durable)
    assert [puts_in(p) for p in paths] == [[(1, b"a%d" % i)] for i in range(N_FILES)]


def test_a_big_pass_syncs_its_files_instead(fs: PowerLossFS, tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    files = new_files(writer)
    calls = fs.sync_files_calls
    big = PASS_BYTES // (N_FILES - 1)  # (the pass: N_FILES of them, over PASS_BYTES)
    a_pass(writer, files, 1, b"a" * big)
    assert calls == [N_FILES] and writer.intents.appends == 0
    writer.close()
    for f in files:
        f.close()


@pytest.mark.parametrize("n_files", [1, N_FILES - 2])
def test_a_pass_of_few_files_over_the_small_bytes_fsyncs_each(
        fs: PowerLossFS, tmp_path: Path, n_files: int) -> None:
    # Fewer files than SYNC_TOGETHER and more than LOG_SMALL_PASS bytes: each file's own
    # fsync (on the pool when several), no log; then a small pass of them uses the log.
    writer = Writer(tmp_path)
    files = new_files(writer, n_files)
    before = fs.fsyncs
    a_pass(writer, files, 1, b"a" * (writer_module.LOG_SMALL_PASS // n_files + 1))
    assert writer.intents.appends == 0 and fs.sync_files_calls == []
    assert all(f.fsyncs == 1 for f in files) and fs.fsyncs - before == n_files
    a_pass(writer, files, 2, b"b")
    assert writer.intents.appends == 1 and all(f.fsyncs == 2 for f in files)
    writer.close()
    for f in files:
        f.close()


def test_a_pass_under_another_policy_never_uses_the_log(fs: PowerLossFS,
                                                         tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    for policy in ("never", "100"):
        file = writer.segment_file(f"q{policy}", FsyncPolicy.parse(policy), 0)
        assert writer.write_round_now([(file, [chunk(1, [b"a"])])])[0].written
        file.close()
    assert writer.intents.appends == 0 and not (tmp_path / INTENT_FILE).exists()
    writer.close()


def test_retiring_a_segment_settles_the_log_first(fs: PowerLossFS, tmp_path: Path) -> None:
    """Without the settle, the log's record at offset 0 would bring the retired segment
    back after a power cut (its records are in the log, its removal on disk)."""
    dd, files, paths, retired = a_retirable_segment(tmp_path)
    dd.retire_segments(retired)
    assert dd.writer.intents.settles == 1
    power_cut(fs, dd.writer, files[1:])
    replay(tmp_path)
    assert not paths[0].exists()
    assert [puts_in(p) for p in paths[1:]] == [[(1, b"a%d" % i)] for i in range(1, N_FILES)]


def test_deleting_a_queue_settles_the_log_first(fs: PowerLossFS, tmp_path: Path) -> None:
    dd = DataDir.open(tmp_path)
    names = [f"q{i}" for i in range(N_FILES)]
    for name in names:
        dd.queue(name)
    journals = [dd.queues[n] for n in names]
    dd.deferring = True
    for j in journals:
        j.append_nowait([b"x-" + j.name.encode()], T0)
    assert dd.commit_now()
    assert dd.writer.intents.appends == 1
    trio.run(dd.delete_queue, "q0")
    assert dd.writer.intents.settles == 1
    cut = fs.cut()
    fs.restore(cut)
    DataDir.open(tmp_path)  # replays what the log holds: none of q0
    assert not [n for n in (p.name for p in tmp_path.iterdir()) if n.startswith("q0.")]


class CutAtReplace(PowerLossFS):
    """Takes the power cut's snapshot once the first rename over a segment is durable
    (at the directory fsync after it)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.at_replace: dict[str, dict[str, bytes]] | None = None

        self.replaced: Path | None = None

    def replace(self, src: fileio.StrPath, dst: fileio.StrPath) -> None:
        super().replace(src, dst)
        parsed = jf.parse_file_name(Path(dst).name)
        if self.replaced is None and parsed and parsed.role is jf.FileRole.SEGMENT:
            self.replaced = Path(dst)

    def fsync_dir(self, path: fileio.StrPath) -> None:
        super().fsync_dir(path)
        if self.replaced is not None and self.at_replace is None:
            self.at_replace = self.cut()


def test_compaction_settles_the_log_before_it_renames_over_a_segment(tmp_path: Path) -> None:
    """The power goes out right after compaction renamed its output over a segment whose
    appends the log holds: had the log not been settled first, recovery would write
    those old bytes into the new file."""
    with installed(CutAtReplace(tmp_path)) as fs:
        def small(_name: str) -> JournalConfig:
            return JournalConfig(journal_size=1024, fsync=FsyncPolicy.parse("always"))

        async def fill_and_compact() -> tuple[list[int], list[bytes]]:
            async with open_data_dir(tmp_path, DataDirConfig(), small) as dd:
                journals = [dd.queue(f"q{i}") for i in range(N_FILES)]
                dd.deferring = True
                for n in range(30):  # passes of 10 items in every queue: logged
                    for j in journals:
                        j.append_nowait([b"%s-%03d-%d" % (j.name.encode(), n, k)
                                         for k in range(10)], T0)
                    assert dd.commit_now()
                dd.deferring = False
                q = journals[0]
                assert len(q.segments) > 4 and dd.writer.intents.appends == 30
                # A straggler: every 5th item still needed, so no segment is dead.
                done = [i for i in range(1, q.last_id + 1) if i % 5]
                await q.write_checkpoint("", 0, done)
                settles = dd.writer.intents.settles
                result = await q.compact()
                assert result.rewritten and not result.removed, result
                assert dd.writer.intents.settles > settles
                needed = [p.id for p in q.iter_unconsumed("")]
                return needed, [p.data for p in q.iter_unconsumed("")]

        needed, datas = trio.run(fill_and_compact)
        assert fs.at_replace is not None and fs.replaced is not None
        output = fs.at_replace[str(tmp_path)][fs.replaced.name]  # (its temp was fsynced)
        fs.restore(fs.at_replace)
        dd = DataDir.open(tmp_path, DataDirConfig(), small)
        assert fs.replaced.read_bytes() == output  # recovery wrote nothing into it
        q = dd.queues["q0"]
        assert [p.id for p in q.iter_unconsumed("")] == needed
        assert [p.data for p in q.iter_unconsumed("")] == datas


class LogWritesFail(PowerLossFS):
    """The intent log's next write of zeros (`grow`), of records (`write`) or fdatasync
    fails with the errno set, once."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_grow: int | None = None
        self.fail_write: int | None = None
        self.fail_fdatasync: int | None = None

    def _is_log(self, fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(INTENT_FILE)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self._is_log(fd):
            zeros = not any(bytes(data))
            if zeros and self.fail_grow is not None:
                err, self.fail_grow = self.fail_grow, None
                super().pwrite(fd, data, offset)  # some zeros made it, then the error
                raise OSError(err, os.strerror(err))
            if not zeros and self.fail_write is not None:
                err, self.fail_write = self.fail_write, None
                super().pwrite(fd, bytes(data)[:3], offset)  # a part, then the error
                raise OSError(err, os.strerror(err))
        return super().pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        if self.fail_fdatasync is not None and self._is_log(fd):
            err, self.fail_fdatasync = self.fail_fdatasync, None
            raise OSError(err, os.strerror(err))
        super().fdatasync(fd)


@pytest.mark.parametrize(("what", "err", "log_usable"), [
    ("grow", errno.ENOSPC, True),  # a full disk: the zeros trimmed off, used again
    ("write", errno.EIO, False),
    ("fdatasync", errno.EIO, False),  # the page cache may have dropped what it held
])
def test_a_failed_append_falls_back_to_syncing_the_files(
        tmp_path: Path, what: str, err: int, log_usable: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    with installed(LogWritesFail(tmp_path)) as fs:
        writer = Writer(tmp_path)
        files = new_files(writer)
        synced = fs.sync_files_calls
        if what == "grow":  # (the log grows when it is made: at the first pass)
            fs.fail_grow = err
            with caplog.at_level(logging.ERROR, "queued.journal"):
                paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
            assert synced == [N_FILES]
            assert (tmp_path / INTENT_FILE).stat().st_size == _HEAD.size  # zeros trimmed
            a_pass(writer, files, 2, b"b")
        else:
            paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
            setattr(fs, f"fail_{what}", err)
            with caplog.at_level(logging.ERROR, "queued.journal"):
                a_pass(writer, files, 2, b"b")  # answered all the same: the files synced
            assert synced == [N_FILES]
        assert (writer.intents.failed is None) == log_usable
        assert ("intent log" in caplog.text) == (not log_usable)  # logged when it ends
        a_pass(writer, files, 3, b"c")
        assert synced == [N_FILES] * (1 if log_usable else 2)
        assert writer.intents.appends == (2 if log_usable else 1)
        power_cut(fs, writer, files)
        replay(tmp_path)
        assert [puts_in(p) for p in paths] == [
            [(1, b"a%d" % i), (2, b"b%d" % i), (3, b"c%d" % i)] for i in range(N_FILES)]


def test_a_small_pass_whose_append_fails_syncs_its_file_then_fsyncs_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One file's small pass: its log append fails (fdatasync), so its file is synced
    instead and the pass answered; with the log ended, the next pass fsyncs its file as
    before the log took small passes. Every pass comes back after a cut."""
    with installed(LogWritesFail(tmp_path)) as fs:
        writer = Writer(tmp_path)
        files = new_files(writer, 1)
        paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
        assert writer.intents.appends == 1 and fs.sync_files_calls == []
        fs.fail_fdatasync = errno.EIO
        with caplog.at_level(logging.ERROR, "queued.journal"):
            a_pass(writer, files, 2, b"b")
        assert fs.sync_files_calls == [1] and writer.intents.failed is not None
        fsyncs = files[0].fsyncs
        a_pass(writer, files, 3, b"c")
        assert fs.sync_files_calls == [1] and files[0].fsyncs == fsyncs + 1
        assert writer.intents.appends == 1
        power_cut(fs, writer, files)
        replay(tmp_path)
        assert puts_in(paths[0]) == [(1, b"a0"), (2, b"b0"), (3, b"c0")]


def test_the_log_grows_by_zeros_and_reads_back_across_the_step(tmp_path: Path) -> None:
    log = IntentLog(tmp_path)
    name = jf.segment_name("q", 5).encode()
    chunk_ = bytes(range(256)) * 4096  # 1 MiB
    for i in range(6):
        log.append([(name, i * len(chunk_), [chunk_])])
    log.wait_flushed()
    data = (tmp_path / INTENT_FILE).read_bytes()
    # (a step ahead once fewer than GROW_AHEAD of zeros were left: after the 2nd and 6th)
    assert len(data) == 3 * GROW_BYTES and data[log.size :] == bytes(len(data) - log.size)
    assert [(o, bytes(d) == chunk_) for _, o, d in read_intents(data)] == [
        (i * len(chunk_), True) for i in range(6)]
    log.release()


class ZerosWatched(LogWritesFail):
    """LogWritesFail that notes the thread of each write of zeros to the log."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.zeros_on: list[str] = []

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self._is_log(fd) and not any(bytes(data)):
            self.zeros_on.append(threading.current_thread().name)
        return super().pwrite(fd, data, offset)


def test_the_log_grows_ahead_on_its_own_thread(tmp_path: Path) -> None:
    """Past its first step the log's zeros are written (and fsynced) on a thread of its
    own, ahead of the records, never by a pass; up to the size a settle leaves it at.
    Every pass comes back after a cut, one logged across each step's boundary too."""
    with installed(ZerosWatched(tmp_path)) as fs:
        log = IntentLog(tmp_path)
        name = jf.segment_name("q", 5).encode()
        piece = b"y" * (256 * 1024 - RECORD_OVERHEAD - len(name))
        offset = 0
        while log.size < SETTLE_BYTES:
            log.append([(name, offset, [piece])])
            offset += len(piece)
        begun = fs.zeros_on[: GROW_BYTES // ZERO_CHUNK]  # (the log's making, in the pass)
        assert begun == [threading.current_thread().name] * len(begun)
        ahead = fs.zeros_on[len(begun) :]
        assert ahead and set(ahead) == {"queued-intent-grow"}
        log.wait_flushed()
        size = (tmp_path / INTENT_FILE).stat().st_size
        assert SETTLE_BYTES < size <= SETTLE_BYTES + GROW_BYTES
        log.append([(name, offset, [piece])])  # (settles first: no growth past it)
        log.wait_flushed()
        assert (tmp_path / INTENT_FILE).stat().st_size == size
        log.release()


def test_a_failed_step_ahead_is_trimmed_and_the_pass_grows_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The thread's step of zeros fails (a full disk): logged, trimmed off, nothing else
    changes; the pass that then needs the room grows the file itself. A second failure
    there is the pass's (ENOSPC: its files synced instead, the log used again after)."""
    with installed(ZerosWatched(tmp_path)) as fs:
        writer = Writer(tmp_path)
        files = new_files(writer)
        paths = paths_of(tmp_path, a_pass(writer, files, 1, b"a"))
        log = writer.intents
        name = jf.segment_name("other", 1).encode()
        fs.fail_grow = errno.ENOSPC
        with caplog.at_level(logging.WARNING, "queued.journal"):
            while log._grower is None:
                log.append([(name, 0, [b"z" * 65536])])
            log.wait_flushed()
        assert "growing it ahead failed" in caplog.text and log.failed is None
        assert (tmp_path / INTENT_FILE).stat().st_size == GROW_BYTES  # trimmed off
        synced = list(fs.sync_files_calls)
        zeros = len(fs.zeros_on)
        fs.fail_grow = errno.ENOSPC  # (no thread tries again: the pass meets it)
        while log.size + 65536 <= GROW_BYTES:
            log.append([(name, 0, [b"z" * 65536])])
        assert len(fs.zeros_on) == zeros
        big = [(f, [chunk(2, [b"b" * (65536 - 200)])]) for f in files]
        assert all(r.written for r in writer.write_round_now(big))  # the log refused
        assert len(fs.sync_files_calls) == len(synced) + 1 and log.failed is None
        assert fs.zeros_on[zeros:] == [threading.current_thread().name]  # the pass's try
        a_pass(writer, files, 3, b"c")  # through the log again
        assert len(fs.sync_files_calls) == len(synced) + 1
        log.append([(name, 0, [b"z" * 65536])])  # past the room: this pass grows the log
        assert (tmp_path / INTENT_FILE).stat().st_size == 2 * GROW_BYTES
        assert set(fs.zeros_on[zeros + 1 :]) == {threading.current_thread().name}
        power_cut(fs, writer, files)
        replay(tmp_path)
        assert [[i for i, _ in puts_in(p)] for p in paths] == [[1, 2, 3]] * len(paths)


class TrimFails(ZerosWatched):
    """ZerosWatched whose ftruncate of the log fails (once set)."""

    fail_trim = False

    def ftruncate(self, fd: int, length: int) -> None:
        if self.fail_trim and self._is_log(fd):
            self.fail_trim = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().ftruncate(fd, length)


def test_a_failed_step_ahead_that_cannot_be_trimmed_is_written_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The thread's step fails and so does its trim: both logged, the log still used;
    the pass that needs the room writes its own step over the part-written one (from
    where the file's durable zeros end), and every record reads back."""
    with installed(TrimFails(tmp_path)) as fs:
        log = IntentLog(tmp_path)
        name = jf.segment_name("q", 1).encode()
        piece = b"z" * 65536
        log.append([(name, 0, [piece])])  # (made: its first step is the pass's own)
        appended = 1
        fs.fail_grow, fs.fail_trim = errno.ENOSPC, True
        with caplog.at_level(logging.WARNING, "queued.journal"):
            while log._grower is None:
                log.append([(name, appended * len(piece), [piece])])
                appended += 1
            log.wait_flushed()
        assert "growing it ahead failed" in caplog.text
        assert "trimming a step that failed" in caplog.text and log.failed is None
        assert (tmp_path / INTENT_FILE).stat().st_size > GROW_BYTES  # (left untrimmed)
        while log.size + len(piece) + RECORD_OVERHEAD <= 2 * GROW_BYTES:
            log.append([(name, appended * len(piece), [piece])])
            appended += 1
        log.wait_flushed()
        assert log.failed is None
        data = (tmp_path / INTENT_FILE).read_bytes()
        assert [o for _, o, _ in read_intents(data)] == [
            i * len(piece) for i in range(appended)]
        log.release()


class SyncAllFails(PowerLossFS):
    def sync_all(self, directory: fileio.StrPath) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("sync_fails", [False, True])
def test_the_file_system_is_synced_on_a_thread_every_flush_bytes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, sync_fails: bool) -> None:
    """Past FLUSH_BYTES appended, a thread syncs the file system (the segments the log
    stands for are then written back ahead of its settle); the log still stands for
    them. A failed sync there is logged and changes nothing: the log goes on, and what it
    holds comes back after a cut."""
    with installed((SyncAllFails if sync_fails else PowerLossFS)(tmp_path)) as fs:
        writer = Writer(tmp_path)
        file = writer.segment_file("q", FsyncPolicy(), 0)
        data = b"x" * (1024 - 64)
        last = 0
        while writer.intents.size < FLUSH_BYTES // 2:  # (passes of 8 items, each logged)
            last += 1
            result = writer.write_round_now([(file, [chunk(last, [data] * 8)])])[0]
            last += 7
            assert result.written and writer.intents.appends
        assert writer.intents.settles == 0 and fs.names[str(file_path(tmp_path, result))
                                                        ].durable == b""
        while writer.intents.size <= FLUSH_BYTES:
            last += 1
            result = writer.write_round_now([(file, [chunk(last, [data] * 8)])])[0]
            last += 7
        writer.intents.wait_flushed()
        path = file_path(tmp_path, result)
        durable = fs.names[str(path)].durable
        if sync_fails:
            assert durable == b"" and "syncing the file system ahead of a settle failed" in (
                caplog.text)
        else:  # (the file's bytes when the sync began: the log's less its records' heads)
            assert len(durable) > FLUSH_BYTES // 2 and not caplog.records
            assert path.read_bytes().startswith(durable)
        assert writer.intents.settles == 0 and writer.intents.failed is None
        last += 1
        assert writer.write_round_now([(file, [chunk(last, [b"end"])])])[0].written
        power_cut(fs, writer, [file])
        assert replay(tmp_path)[0] > 0
        assert [i for i, _ in puts_in(path)] == list(range(1, last + 1))


def file_path(tmp_path: Path, result: WriteResult) -> Path:
    return tmp_path / jf.segment_name("q", result.written[0].number)


def test_a_settle_that_fails_removes_no_segment(tmp_path: Path) -> None:
    """No syncfs, no settle: retiring refuses (the segment stays, what the log names
    still replays into it), and the log takes no more passes."""
    with installed(SyncAllFails(tmp_path)) as fs:
        dd, files, paths, retired = a_retirable_segment(tmp_path)
        with pytest.raises(OSError):
            dd.retire_segments(retired)
        assert paths[0].exists() and dd.writer.intents.failed is not None
        with pytest.raises(OSError):  # an ended log's settle needs the syncfs too
            dd.retire_segments(retired)
        assert paths[0].exists() and (tmp_path / INTENT_FILE).exists()
        power_cut(fs, dd.writer, files[1:])
        replay(tmp_path)
        assert [puts_in(p) for p in paths] == [[(1, b"a%d" % i)] for i in range(N_FILES)]


def test_a_failed_log_is_removed_by_its_next_settle(tmp_path: Path) -> None:
    """A settle whose own fdatasync fails ends the log and refuses (the segment stays);
    the next settle syncs the file system and removes the log's file, rather than
    writing it a head again, which might fail for good and keep every segment from
    being retired. What was appended is in its segment files after a power cut."""
    with installed(LogWritesFail(tmp_path)) as fs:
        dd, files, paths, retired = a_retirable_segment(tmp_path)
        fs.fail_fdatasync = errno.EIO
        with pytest.raises(OSError):
            dd.retire_segments(retired)
        assert paths[0].exists() and dd.writer.intents.failed is not None
        assert (tmp_path / INTENT_FILE).exists()
        a_pass(dd.writer, files[1:], 2, b"b")  # (synced with syncfs: the log is done)
        dd.retire_segments(retired)
        assert not paths[0].exists() and not (tmp_path / INTENT_FILE).exists()
        power_cut(fs, dd.writer, files[1:])
        assert replay(tmp_path) == (0, 0)
        assert [puts_in(p) for p in paths[1:]] == [[(1, b"a%d" % i), (2, b"b%d" % (i - 1))]
                                                  for i in range(1, N_FILES)]
        dd.writer.intents.close()  # nothing left to do


def test_a_stop_that_cannot_settle_the_log_says_so_and_keeps_it(tmp_path: Path) -> None:
    with installed(SyncAllFails(tmp_path)):
        async def run() -> None:
            async with open_data_dir(tmp_path, DataDirConfig()) as dd:
                journals = [dd.queue(f"q{i}") for i in range(N_FILES)]
                dd.deferring = True
                for j in journals:
                    j.append_nowait([b"x-" + j.name.encode()], T0)
                assert dd.commit_now() and dd.writer.intents.appends == 1

        with pytest.raises(NotSavedError, match="intent log: not settled"):
            trio.run(run)
        assert (tmp_path / INTENT_FILE).exists()  # for the next start to write back
        assert replay(tmp_path)[0] == N_FILES
