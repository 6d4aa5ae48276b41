"""What `queued serve` does to its own process: before serving, one malloc arena for all
threads, rarer collections of the young generation and a shorter GIL switch interval;
once serving, the start-up heap left out of garbage collections (`freeze_startup_heap`).

Owns process-wide settings that suit a long-running server and nothing else; only the
command line calls `tune_process` (tests and applications that run the server in their
own process keep theirs). The mmap threshold is pinned by queued.server.memory, beside
the heap trimming it serves.
"""

from __future__ import annotations

import ctypes
import gc
import sys


def tune_process() -> None:
    """Every setting of this module, once, before the server starts."""
    limit_malloc_arenas()
    tune_gc()
    shorten_switch_interval()


M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas() -> None:
    """One malloc arena for all threads (glibc; a no-op elsewhere).

    Read-behind decodes items in a worker thread and the event loop frees them; with
    glibc's per-thread arenas that kept ~20 MiB more resident than the items need.
    Measured with bench/load.py --rss-only: dequeue peak 61 -> 42 MiB (baseline 30).
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


#: gc thresholds for the server (CPython's default is 700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """Collect the young generation less often.

    Every queued item is a tracked object (its Put); with CPython's default
    threshold of 700 allocations the collector ran about once per 100-item RPC
    batch and took ~16% of the event loop's CPU (perf, 4 connections putting
    64 B items in batches of 100). Long-lived items still cost their full
    collections (CPython runs one after 25% growth), but those are rarer.
    """
    gc.set_threshold(*GC_THRESHOLDS)


#: The GIL switch interval for the server, seconds (CPython's default is 0.005).
SWITCH_INTERVAL = 0.0005


def shorten_switch_interval() -> None:
    """Let the event loop have the GIL back sooner from a worker thread running Python.

    A worker thread that runs Python for long (compaction's rewrite decodes and
    encodes the items it keeps, and did every item of the run before it read past the
    readers' heads: ~1 s of CPU for one 16 MiB segment of 64 B items; read-behind
    decodes the items it reads back) takes the GIL whenever the event loop's
    thread makes a system call, and keeps it until the interpreter makes it drop it:
    CPython's default of 5 ms after the loop's thread asks. A reactor pass makes
    several calls (recv, the commit's write and fsync, each reply's send), so one pass
    took 20-35 ms while compaction ran, and RPC get+confirm's p99 was 56-110 ms
    instead of ~7 (bench/rpc_bench.py, 64 B, batches of 100, 4 connections, fsync
    always, 4.5 s of puts first; 9-20 ms with this interval alone, 7.7-9.5 ms with the
    rewrite reading past the heads as well). With one thread running,
    the interval costs nothing: no thread asks for the GIL.
    """
    sys.setswitchinterval(SWITCH_INTERVAL)


def freeze_startup_heap() -> int:
    """Once the server serves: collect, then move every object the collector tracks to
    its permanent generation, which no collection walks again; the count moved.

    A full collection walks every tracked object. Most are the start-up's (modules,
    functions, classes, the configuration, trio's and prometheus-client's own): ~50,000
    of them, and a full collection took 17-27 ms with the reactor waiting, once or twice
    per RPC benchmark run; 1.7-2.4 ms once they were frozen (`gc.callbacks`, compiled,
    bench/rpc_bench.py 64 B in batches of 100 over 4 connections, fsync always). The
    collect before the freeze takes ~27 ms once, the ports already listening.
    Frozen objects are still freed when their last reference goes (items recovered at
    start-up, say, once consumed); only a reference cycle among them is never
    collected, so garbage from before the freeze is collected first.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
