"""Waiting in tests: on a condition, with a deadline, never for a fixed time.

`wait_until` (trio) and `wait_until_blocking` (threads, subprocesses) poll a condition
until it holds and fail the test when it does not hold within the deadline. The poll
interval is a few milliseconds, so a condition that holds early ends the wait early.

Where a test must let time pass (a deadline that must fire, or one that must not), it
runs on trio's MockClock: `held_clock()` gives one that stands still (but for a guard
against hangs), and `autojumping(clock)` lets it jump to the next deadline as soon as
every task waits, inside a block. Why not autojump for a whole server test: the server
still hands some work to threads (reader checkpoint writes and takeovers, read-behind,
password checks, recovery at start-up, the clients' DNS look-ups), and trio counts a
task waiting on a thread as blocked, so an autojump clock would run ahead of that work
and fire deadlines (the test's own fail_after included) while it is still under way.
Item times (expiry, max_age, delays) are the wall clock's, which no trio clock moves.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio
import trio.testing

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


#: Real seconds with every task blocked after which a held clock jumps anyway, so that a
#: test waiting on a deadline nothing will reach fails instead of hanging.
HANG_GUARD_S = 10.0


def held_clock() -> trio.testing.MockClock:
    """A trio clock that stands still until `autojumping` (or the hang guard) moves it."""
    return trio.testing.MockClock(autojump_threshold=HANG_GUARD_S)


@contextmanager
def autojumping(clock: trio.testing.MockClock) -> Iterator[None]:
    """Inside the block, trio time jumps to the next deadline whenever every task waits:
    for stretches where no work runs in a thread (see the module docstring)."""
    before = clock.autojump_threshold
    clock.autojump_threshold = 0
    try:
        yield
    finally:
        clock.autojump_threshold = before
