"""A pass's durable point off the event loop: one OS thread fsyncs what a reactor pass
wrote (fsync `always`) while the loop goes on with the next pass.

Owns the thread, the jobs in flight (in submission order) and the finished ones waiting
to be collected; knows nothing of chunks, tickets or replies. The loop writes a pass's
bytes itself (page cache), submits a `SyncJob` naming the fds to make durable, and
collects each job once it is `done`, in order; the thread tells the loop a job is done
through `notify` (the reactor's eventfd). A job is never abandoned: `wait` blocks until
a job has run (shutdown). The fds of a job in flight must stay open
until it is collected: the data dir opens, rotates and closes no file while one is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from queued.storage import fileio

#: From this many files on a job syncs them with one call (`fileio.sync_files`: syncfs,
#: one journal commit) rather than an fsync each in turn.
SYNC_TOGETHER = 4


class SyncJob:
    """The fds one pass wrote under fsync `always` (and whether it created a file, so the
    directory must be synced too); `error` once run, if the sync failed."""

    __slots__ = ("directory", "done", "error", "fds", "seconds", "sync_dir")

    def __init__(self, fds: Sequence[int], directory: Path, sync_dir: bool) -> None:
        self.fds = fds
        self.directory = directory
        self.sync_dir = sync_dir
        self.error: OSError | None = None
        self.seconds = 0.0  # the sync's duration (0: nothing to sync)
        self.done = False

    def run(self) -> None:
        if not self.fds and not self.sync_dir:
            return
        started = time.monotonic()
        try:
            if len(self.fds) >= SYNC_TOGETHER:
                fileio.sync_files(self.fds, self.directory)  # (covers the directory too)
            else:
                for fd in self.fds:
                    fileio.fsync(fd)
                if self.sync_dir:
                    fileio.fsync_dir(self.directory)
        except OSError as exc:
            self.error = exc
        self.seconds = time.monotonic() - started


class PassSyncThread:
    """See the module docstring. Started on first use; jobs run one at a time, in the
    order submitted (a later pass's sync never ends before an earlier one's)."""

    def __init__(self) -> None:
        #: called from the thread after each job (the reactor's wake-up); set by the loop
        self.notify: Callable[[], None] = lambda: None
        self._jobs: queue.SimpleQueue[SyncJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.in_flight = 0  # submitted and not yet collected

    def submit(self, job: SyncJob) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="queued-pass-sync",
                                            daemon=True)
            self._thread.start()
        self.in_flight += 1
        self._jobs.put(job)

    def collected(self, job: SyncJob) -> None:
        """The loop has taken `job`'s outcome (it is done)."""
        assert job.done
        self.in_flight -= 1

    def wait(self, job: SyncJob) -> None:
        """Block until `job` has run (shutdown: a job is never abandoned)."""
        with self._cond:
            while not job.done:
                self._cond.wait()

    def _work(self) -> None:
        stop = False
        while not stop and (job := self._jobs.get()) is not None:
            # Every job submitted meanwhile shares this sync (group commit: the passes
            # made while the last sync ran wait for one more, not one each).
            jobs = [job]
            while True:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
            if len(jobs) == 1:
                job.run()
            else:
                together = SyncJob(list(dict.fromkeys(fd for j in jobs for fd in j.fds)),
                                   job.directory, any(j.sync_dir for j in jobs))
                together.run()
                for j in jobs:  # (the sync's time is observed once)
                    j.error, j.seconds = together.error, together.seconds if j is job else 0.0
            with self._cond:  # (`wait` returns after the notice: the loop may close then)
                for j in jobs:
                    j.done = True
                self.notify()
                self._cond.notify_all()
            del job, jobs

    def close(self) -> None:
        """Stop the thread once the jobs queued have run."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
