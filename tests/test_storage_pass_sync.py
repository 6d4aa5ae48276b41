"""A pass's sync off the loop (queued.storage.pass_sync): jobs run in order, one at a
time, those submitted while one runs share the next sync, a failure is the job's (and
those sharing it), and a job is never abandoned. Real files in a temp dir; the file
calls go through a recording layer (queued.storage.fileio)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from queued.storage import fileio
from queued.storage.pass_sync import SYNC_TOGETHER, PassSyncThread, SyncJob


class Recorder(fileio.FileIO):
    """Records each sync call; the next waits for `release` once `hold` is set; an fsync
    of a file in `fail` fails with EIO (once)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.hold = False
        self.held = threading.Event()
        self.release = threading.Event()
        self.fail: set[int] = set()

    def _wait(self) -> None:
        if self.hold:
            self.hold = False
            self.held.set()
            assert self.release.wait(10), "never released"

    def fsync(self, fd: int) -> None:
        self.calls.append(("fsync", (fd,)))
        self._wait()
        if fd in self.fail:
            self.fail.discard(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fsync(fd)

    def sync_files(self, fds: object, directory: fileio.StrPath) -> None:
        self.calls.append(("sync_files", tuple(fds)))  # type: ignore[arg-type]
        self._wait()
        super().sync_files(fds, directory)  # type: ignore[arg-type]

    def fsync_dir(self, path: fileio.StrPath) -> None:
        self.calls.append(("fsync_dir", ()))
        super().fsync_dir(path)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    previous = fileio.use(rec)
    try:
        yield rec
    finally:
        fileio.use(previous)


@pytest.fixture
def fds(tmp_path: Path) -> Iterator[list[int]]:
    opened = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644) for i in range(6)]
    for fd in opened:
        os.write(fd, b"x")
    try:
        yield opened
    finally:
        for fd in opened:
            os.close(fd)


def run_thread() -> tuple[PassSyncThread, threading.Semaphore]:
    notices = threading.Semaphore(0)
    thread = PassSyncThread()
    thread.notify = notices.release
    return thread, notices


def test_jobs_run_in_order_and_tell_the_loop(tmp_path: Path, recorder: Recorder,
                                            fds: list[int]) -> None:
    thread, notices = run_thread()
    try:
        first = SyncJob([fds[0]], tmp_path, sync_dir=False)
        thread.submit(first)
        thread.wait(first)
        assert first.done and first.error is None and first.seconds > 0
        assert notices.acquire(timeout=5)  # told once it was done
        assert thread.in_flight == 1  # until collected
        thread.collected(first)
        assert thread.in_flight == 0
        created = SyncJob([fds[1]], tmp_path, sync_dir=True)  # a file was created: its dir too
        thread.submit(created)
        thread.wait(created)
        assert recorder.calls == [("fsync", (fds[0],)), ("fsync", (fds[1],)), ("fsync_dir", ())]
    finally:
        thread.close()


def test_jobs_submitted_while_one_syncs_share_the_next_sync(
        tmp_path: Path, recorder: Recorder, fds: list[int]) -> None:
    thread, _ = run_thread()
    try:
        recorder.hold = True
        first = SyncJob([fds[0]], tmp_path, sync_dir=False)
        thread.submit(first)
        assert recorder.held.wait(5)
        later = [SyncJob([fds[1]], tmp_path, sync_dir=False),
                 SyncJob([fds[1], fds[2]], tmp_path, sync_dir=True)]
        for job in later:
            thread.submit(job)
        assert not any(job.done for job in (first, *later))
        recorder.release.set()
        thread.wait(later[-1])
        assert all(job.done and job.error is None for job in (first, *later))
        # one sync for both later jobs: their files once each, then the directory
        assert recorder.calls == [("fsync", (fds[0],)), ("fsync", (fds[1],)),
                                  ("fsync", (fds[2],)), ("fsync_dir", ())]
        assert later[0].seconds > 0 and later[1].seconds == 0  # (its time counted once)
    finally:
        thread.close()


def test_many_files_are_synced_with_one_call(tmp_path: Path, recorder: Recorder,
                                             fds: list[int]) -> None:
    thread, _ = run_thread()
    try:
        job = SyncJob(fds[:SYNC_TOGETHER], tmp_path, sync_dir=True)
        thread.submit(job)
        thread.wait(job)
        assert job.error is None
        assert recorder.calls == [("sync_files", tuple(fds[:SYNC_TOGETHER]))]
    finally:
        thread.close()


def test_a_failed_sync_is_the_jobs_that_shared_it_and_no_others(
        tmp_path: Path, recorder: Recorder, fds: list[int]) -> None:
    thread, _ = run_thread()
    try:
        recorder.fail = {fds[0]}
        failed = SyncJob([fds[0]], tmp_path, sync_dir=False)
        thread.submit(failed)
        thread.wait(failed)
        assert isinstance(failed.error, OSError) and failed.error.errno == errno.EIO
        ok = SyncJob([fds[0]], tmp_path, sync_dir=False)
        thread.submit(ok)
        thread.wait(ok)
        assert ok.error is None  # (the data dir, not the thread, keeps the file failed)
        recorder.hold = True
        head = SyncJob([fds[1]], tmp_path, sync_dir=False)
        thread.submit(head)
        assert recorder.held.wait(5)
        tail = [SyncJob([fds[2]], tmp_path, sync_dir=False),
                SyncJob([fds[3]], tmp_path, sync_dir=False)]
        for job in tail:
            thread.submit(job)
        recorder.fail = {fds[2]}  # the sync the tail shares fails at its first file
        recorder.release.set()
        thread.wait(tail[-1])
        assert head.error is None
        assert all(isinstance(job.error, OSError) for job in tail)
    finally:
        thread.close()


def test_close_runs_the_jobs_queued_first(tmp_path: Path, recorder: Recorder,
                                          fds: list[int]) -> None:
    thread, _ = run_thread()
    jobs = [SyncJob([fd], tmp_path, sync_dir=False) for fd in fds[:3]]
    for job in jobs:
        thread.submit(job)
    thread.close()
    assert all(job.done for job in jobs)
