"""One queue's producers (exactly-once puts): each one's last stored sequence and answer.

Owns the rule a put with a producer id meets: the next sequence is stored; one at or
below the last is a duplicate (answered as the last was when it is the last); one
further ahead is a gap. A producer the table does not know starts at 1 (anything else is
a gap: else a later put arriving first would make the first look like a repeat). Bounded
by a least-recently-used cap and an expiry: a producer forgotten must start again at 1
as a new producer (at-least-once, never a loss). PURE: the caller
passes the time and keeps the durability (`pending` is its opaque ticket).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from queued.journal.records import ProducerMark

#: Defaults of the queue settings max_producers and producer_expiry.
DEFAULT_MAX_PRODUCERS = 10_000
DEFAULT_PRODUCER_EXPIRY_MS = 7 * 24 * 3600 * 1000


class Verdict(enum.Enum):
    STORE = "store"  # the next sequence (1 for a producer unknown: new, evicted, expired)
    DUPLICATE = "duplicate"  # at or below the last stored: store nothing
    GAP = "gap"  # past the next: refused, store nothing


class ProducerEntry:
    """A producer's last stored put: its sequence, first id, item count, when."""

    __slots__ = ("count", "first_id", "pending", "sequence", "used_ms")

    def __init__(self, sequence: int, first_id: int, count: int, used_ms: int,
                 pending: object | None) -> None:
        self.sequence = sequence
        self.first_id = first_id
        self.count = count
        self.used_ms = used_ms
        #: the caller's ticket while that put is not yet durable, else None
        self.pending = pending


@dataclass(slots=True)
class ProducerCounters:
    """What the producer tables of a server did, together (metrics read them)."""

    evicted: int = 0  # pushed out by max_producers (least recently used first)
    expired: int = 0  # unused for producer_expiry
    duplicates: int = 0  # puts answered as duplicates
    gaps: int = 0  # puts refused for a gap


class ProducerTable:
    """See the module docstring. `changes` counts stores (snapshots compare it)."""

    __slots__ = ("changes", "counters", "entries", "expiry_ms", "max_producers")

    def __init__(self, max_producers: int = DEFAULT_MAX_PRODUCERS,
                 expiry_ms: int = DEFAULT_PRODUCER_EXPIRY_MS,
                 counters: ProducerCounters | None = None) -> None:
        self.entries: OrderedDict[bytes, ProducerEntry] = OrderedDict()
        self.max_producers = max_producers
        self.expiry_ms = expiry_ms
        self.changes = 0
        self.counters = ProducerCounters() if counters is None else counters

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, producer: bytes, sequence: int, now_ms: int,
              ) -> tuple[Verdict, ProducerEntry | None]:
        """What a put of `producer` with `sequence` meets; changes nothing but the
        recency of a duplicate's producer (and forgets one that expired)."""
        e = self.entries.get(producer)
        if e is not None and now_ms - e.used_ms > self.expiry_ms:
            del self.entries[producer]
            self.counters.expired += 1
            e = None
        if sequence == (1 if e is None else e.sequence + 1):
            return Verdict.STORE, e
        if e is None:  # (a later put before the first would make the first a "repeat")
            self.counters.gaps += 1
            return Verdict.GAP, None
        if sequence <= e.sequence:
            self.counters.duplicates += 1
            e.used_ms = now_ms
            self.entries.move_to_end(producer)
            return Verdict.DUPLICATE, e
        self.counters.gaps += 1
        return Verdict.GAP, e

    def verdict(self, producer: bytes, sequence: int, now_ms: int) -> Verdict:
        """What `check` would say, changing nothing (counting nothing)."""
        e = self.entries.get(producer)
        if e is None or now_ms - e.used_ms > self.expiry_ms:
            return Verdict.STORE if sequence == 1 else Verdict.GAP
        if sequence == e.sequence + 1:
            return Verdict.STORE
        return Verdict.DUPLICATE if sequence <= e.sequence else Verdict.GAP

    def store(self, producer: bytes, sequence: int, first_id: int, count: int, now_ms: int,
              pending: object | None = None) -> ProducerEntry:
        """Note a put stored (after `check` said STORE, nothing in between)."""
        e = self.entries.get(producer)
        if e is None:
            e = self.entries[producer] = ProducerEntry(sequence, first_id, count, now_ms,
                                                       pending)
            self._trim(now_ms)
        else:
            e.sequence, e.first_id, e.count, e.used_ms, e.pending = (
                sequence, first_id, count, now_ms, pending)
            self.entries.move_to_end(producer)
        self.changes += 1
        return e

    def forget(self, producer: bytes, entry: ProducerEntry) -> None:
        """Drop `entry` if it is still `producer`'s (its put failed to be written)."""
        if self.entries.get(producer) is entry:
            del self.entries[producer]
            self.changes += 1

    def _trim(self, now_ms: int) -> None:
        entries = self.entries
        while entries:
            producer, oldest = next(iter(entries.items()))
            if now_ms - oldest.used_ms > self.expiry_ms:
                self.counters.expired += 1
            elif len(entries) > self.max_producers:
                self.counters.evicted += 1
            else:
                return
            del entries[producer]

    def restore(self, marks: Iterable[ProducerMark], now_ms: int) -> None:
        """Load marks read back from the journal (any order): per producer the one with
        the highest first id wins (ids only grow), least recently used first."""
        best: dict[bytes, ProducerMark] = {}
        for m in marks:
            cur = best.get(m.producer)
            if cur is None or m.first_id > cur.first_id:
                best[m.producer] = m
        for m in sorted(best.values(), key=lambda m: (m.time_ms, m.first_id)):
            if now_ms - m.time_ms <= self.expiry_ms:
                self.entries[m.producer] = ProducerEntry(m.sequence, m.first_id, m.count,
                                                         m.time_ms, None)
        self._trim(now_ms)

    def marks(self, durable: Callable[[object], bool]) -> list[ProducerMark]:
        """The entries whose put is durable (`durable(pending)`), as marks."""
        return [ProducerMark(p, e.sequence, e.first_id, e.count, e.used_ms)
                for p, e in self.entries.items() if e.pending is None or durable(e.pending)]

    def all_durable(self, durable: Callable[[object], bool]) -> bool:
        return all(e.pending is None or durable(e.pending) for e in self.entries.values())
