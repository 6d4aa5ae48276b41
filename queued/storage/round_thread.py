"""The writer's hand-off: one OS thread that runs a round off the event loop and wakes
the loop through an eventfd when it is done.

Owns the thread, its job queue and the eventfd; knows nothing of what a job does.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import trio

T = TypeVar("T")


class RoundThread:
    """One OS thread that runs the writer's rounds, started on first use.

    A hand-off costs about 25 us here (a queue there, an eventfd back) against 75-95 us
    for `trio.to_thread.run_sync` (measured on the benchmark machine), and a round under
    fsync always is mostly hand-off and fsync. One job at a time (the writer's lock);
    a job is never abandoned: the caller waits for it shielded, as a round must end.
    Where there is no eventfd (not Linux) it falls back to `trio.to_thread`.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._done_fd = -1
        self._result: tuple[Any, BaseException | None] = (None, None)
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not hasattr(os, "eventfd"):  # pragma: no cover (Linux has it)
            return await trio.to_thread.run_sync(fn, *args)
        if self._thread is None:
            self._done_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._thread = threading.Thread(target=self._work, name="queued-writer",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((fn, args))
        with trio.CancelScope(shield=True):
            while True:
                try:
                    os.eventfd_read(self._done_fd)
                    break
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self._done_fd)
        value, error = self._result
        self._result = (None, None)
        if error is not None:
            raise error
        return cast(T, value)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                self._result = (fn(*args), None)
            except BaseException as exc:  # handed to the caller, raised there
                self._result = (None, exc)
            del job, fn, args  # not kept until the next round: they hold its files and tickets
            os.eventfd_write(self._done_fd, 1)

    def close(self) -> None:
        """Stop the thread (after the job it runs, if any) and close the eventfd."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            os.close(self._done_fd)
            self._done_fd = -1
