"""Waiting in tests: on a condition, with a deadline, never for a fixed time.

`wait_until` (trio) and `wait_until_blocking` (threads, subprocesses) poll a condition
until it holds and fail the test when it does not hold within the deadline. The poll
interval is a few milliseconds, so a condition that holds early ends the wait early;
under trio's MockClock (autojump) the trio waits take no real time at all.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")

#: Every single wait of a test is bounded by this (seconds) unless it says otherwise.
WAIT = 10.0
#: Between two looks at a condition (seconds).
POLL = 0.01


async def wait_until(what: Callable[[], object], timeout: float = WAIT, *,
                     poll: float = POLL, why: str = "") -> None:
    """Until `what()` is true; an AssertionError naming `why` after `timeout` seconds."""
    with trio.move_on_after(timeout):
        while not what():
            await trio.sleep(poll)
        return
    raise AssertionError(f"not true within {timeout} s: {why or what}")


async def wait_for(probe: Callable[[], Awaitable[T]], ok: Callable[[T], object],
                   timeout: float = WAIT, *, poll: float = POLL) -> T:
    """Call the async `probe` until `ok(result)`; returns that result (TooSlowError after
    `timeout` seconds)."""
    with trio.fail_after(timeout):
        while True:
            got = await probe()
            if ok(got):
                return got
            await trio.sleep(poll)


def wait_until_blocking(what: Callable[[], object], timeout: float = WAIT, *,
                        poll: float = POLL, why: str = "") -> None:
    """Blocking `wait_until`, for threads and tests that drive subprocesses."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout} s: {why or what}")
        time.sleep(poll)
