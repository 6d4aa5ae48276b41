"""Giving memory back to the system once queues drain.

Item data lives in `bytes` objects that CPython takes from the C allocator (glibc's
malloc for anything over 512 bytes). glibc keeps freed memory in its heap for reuse,
so after a backlog of large items drains the process would keep its peak RSS for as
long as it runs (measured: 175 MiB held after draining 1 GiB of 64 KiB items, against
34 MiB idle). `malloc_trim(0)` hands the free pages back; a task looks every
`TRIM_CHECK_SECONDS` and calls it when RSS has grown by `TRIM_STEP` more than the item
data held in memory since the last call, and once whenever clients go quiet (no byte
received since the last look) after sending something: an idle server gives back what
the busy time left behind (a burst of hostile input, `stats` replies over thousands of
queues) even when it is less than `TRIM_STEP`. A no-op where the C
library has no malloc_trim (or there is no /proc).

At start-up `pin_mmap_threshold` also fixes glibc's mmap threshold. By default glibc
raises it (up to 32 MiB) each time a block it had mmap'd is freed, so after the first
password check (scrypt takes 16 MiB) every later check took its 16 MiB from the heap of
whichever thread ran it, and kept it there: a stream of failed logins grew RSS from 50 to
168 MiB (glibc makes an arena per thread, up to 8 per core), and `malloc_trim` did not
give it back. Pinned, blocks of `MMAP_THRESHOLD` and more are mapped and unmapped each time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger("queued.server")

TRIM_CHECK_SECONDS = 5.0
#: RSS beyond the items held, grown since the last trim, that makes the next one worthwhile.
TRIM_STEP = 16 << 20
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
#: Blocks this size and over come from mmap and go back at free (see the docstring): over
#: the 1 MiB items and 256 KiB receive buffers of a busy server, under scrypt's 16 MiB.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _libc(function: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The C library's `function` (int result), None where there is none (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_malloc_trim = _libc("malloc_trim", [ctypes.c_size_t])
_mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` (see the module docstring); True if set."""
    return _mallopt is not None and bool(_mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> bool:
    """Return free heap pages to the system; True if the C library could."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def rss_bytes() -> int | None:
    """This process's resident set size (Linux), None where /proc has no statm."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


async def trim_when_drained(held_bytes: Callable[[], int], seconds: float | None = None,
                            activity: Callable[[], int] | None = None) -> None:
    """Forever, every `seconds`: trim if RSS grew by TRIM_STEP more than the item bytes
    held in memory did since the last trim (memory used for items that are gone), and
    once each time `activity` (a count that grows with client traffic) stops moving."""
    if _malloc_trim is None or rss_bytes() is None:
        return
    base = (rss_bytes() or 0) - held_bytes()
    last = activity() if activity is not None else 0
    busy = False  # traffic since the last trim
    while True:
        await trio.sleep(TRIM_CHECK_SECONDS if seconds is None else seconds)
        unexplained = (rss_bytes() or 0) - held_bytes()
        now = activity() if activity is not None else 0
        went_quiet = busy and now == last
        busy, last = busy or now != last, now
        if unexplained - base >= TRIM_STEP or went_quiet:
            busy = False
            # In a thread: on a large heap a trim takes milliseconds, and malloc_trim
            # takes the allocator's own locks, so the event loop goes on meanwhile.
            await trio.to_thread.run_sync(trim)
            after = (rss_bytes() or 0) - held_bytes()
            log.debug("memory: heap trimmed, RSS %+d bytes", after - unexplained)
            base = after
