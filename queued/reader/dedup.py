"""One queue's deduplication keys: the puts that carried a key within the window.

Owns the rule a put with a key meets: a key stored within `window_ms` makes the put a
duplicate (it stores nothing and is answered as the put that stored the key); else it is
stored and its key remembered from then on. A duplicate does not extend the window (as
SQS and NATS count it from the first put). Bounded by `max_keys`, oldest first out: a key
forgotten (window passed or evicted) is at-least-once again, never a loss. PURE: the
caller passes the time and keeps the durability (`pending` is its opaque ticket).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from queued.journal.records import DedupMark

#: Defaults of the queue settings dedup_window and max_dedup_keys. 100,000 keys cover
#: 333 keyed puts a second for the whole default window and take about 28 MiB at most
#: (bench/producer_mem.py --keys measures ~290 bytes per 16-byte key, ~340 per 64-byte).
DEFAULT_DEDUP_WINDOW_MS = 5 * 60 * 1000
DEFAULT_MAX_DEDUP_KEYS = 100_000


class DedupEntry:
    """The put that stored a key: its first id, item count and when."""

    __slots__ = ("count", "first_id", "pending", "time_ms")

    def __init__(self, first_id: int, count: int, time_ms: int, pending: object | None,
                 ) -> None:
        self.first_id = first_id
        self.count = count
        self.time_ms = time_ms
        #: the caller's ticket while that put is not yet durable, else None
        self.pending = pending


@dataclass(slots=True)
class DedupCounters:
    """What the key tables of a server did, together (metrics read them)."""

    evicted: int = 0  # pushed out by max_dedup_keys (oldest first) within their window
    expired: int = 0  # forgotten once dedup_window passed
    duplicates: int = 0  # puts answered as duplicates (nothing stored)


class DedupTable:
    """See the module docstring. `entries` is in insertion order, which is time order
    while the clock does not step back (then the trim, which looks at the oldest, merely
    keeps some keys longer; each lookup checks the window itself). `changes` counts
    stores and forgets (snapshots compare it)."""

    __slots__ = ("changes", "counters", "entries", "max_keys", "window_ms")

    def __init__(self, max_keys: int = DEFAULT_MAX_DEDUP_KEYS,
                 window_ms: int = DEFAULT_DEDUP_WINDOW_MS,
                 counters: DedupCounters | None = None) -> None:
        # (Ordered: the oldest is found in O(1) however many were removed before it; a
        # plain dict's iteration walks past every deleted slot: quadratic under evictions.)
        self.entries: OrderedDict[bytes, DedupEntry] = OrderedDict()
        self.max_keys = max_keys
        self.window_ms = window_ms
        self.changes = 0
        self.counters = DedupCounters() if counters is None else counters

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, key: bytes, now_ms: int) -> DedupEntry | None:
        """The entry of the put that stored `key` within the window (this put is a
        duplicate: counted), or None (store it; a key past its window is forgotten)."""
        e = self.entries.get(key)
        if e is None:
            return None
        if now_ms - e.time_ms > self.window_ms:
            del self.entries[key]
            self.counters.expired += 1
            self.changes += 1
            return None
        self.counters.duplicates += 1
        return e

    def seen(self, key: bytes, now_ms: int) -> bool:
        """What `check` would say (True: a duplicate), changing and counting nothing."""
        e = self.entries.get(key)
        return e is not None and now_ms - e.time_ms <= self.window_ms

    def store(self, key: bytes, first_id: int, count: int, now_ms: int,
              pending: object | None = None) -> DedupEntry:
        """Note a put stored with `key` (after `check` said None, nothing in between)."""
        e = DedupEntry(first_id, count, now_ms, pending)
        self.entries[key] = e
        self.entries.move_to_end(key)  # (a stale one goes to the end: its new time)
        self.changes += 1
        if len(self.entries) > self.max_keys or not self.changes & 63:
            self._trim(now_ms)  # (keys past the window: every 64 stores, not each)
        return e

    def forget(self, key: bytes, entry: DedupEntry) -> None:
        """Drop `entry` if it is still `key`'s (its put failed to be written)."""
        if self.entries.get(key) is entry:
            del self.entries[key]
            self.changes += 1

    def trim(self, now_ms: int) -> None:
        """Forget the keys past their window (oldest first), and any over max_keys."""
        self._trim(now_ms)

    def _trim(self, now_ms: int) -> None:
        entries = self.entries
        while entries:
            key, oldest = next(iter(entries.items()))
            if now_ms - oldest.time_ms > self.window_ms:
                self.counters.expired += 1
            elif len(entries) > self.max_keys:
                self.counters.evicted += 1
            else:
                return
            del entries[key]
            self.changes += 1

    def restore(self, marks: Iterable[DedupMark], now_ms: int) -> None:
        """Load marks read back from the journal (any order): per key the one with the
        highest first id wins (ids only grow), oldest first; keys past the window are
        left out (forgetting them is allowed: the window has passed)."""
        best: dict[bytes, DedupMark] = {}
        for m in marks:
            cur = best.get(m.key)
            if cur is None or m.first_id > cur.first_id:
                best[m.key] = m
        for m in sorted(best.values(), key=lambda m: (m.time_ms, m.first_id)):
            if now_ms - m.time_ms <= self.window_ms:
                self.entries[m.key] = DedupEntry(m.first_id, m.count, m.time_ms, None)
        self._trim(now_ms)

    def marks(self, durable: Callable[[object], bool]) -> list[DedupMark]:
        """The entries whose put is durable (`durable(pending)`), as marks."""
        return [DedupMark(k, e.first_id, e.count, e.time_ms)
                for k, e in self.entries.items() if e.pending is None or durable(e.pending)]

    def all_durable(self, durable: Callable[[object], bool]) -> bool:
        return all(e.pending is None or durable(e.pending) for e in self.entries.values())
