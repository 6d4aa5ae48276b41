"""One reader of a queue as the async side sees it: the pure `Reader` plus its waiting
gets, its refill lock and the names it answers to.

Holds state only; what moves items between readers, waiters and the journal is
`queued.broker.queues.QueueState`. No journal access here.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from queued.reader.shared import NO_ITEMS, ReaderCounters
from queued.reader.state import Item, Reader

if TYPE_CHECKING:
    from queued.config import QueueConfig

log = logging.getLogger("queued.broker")


class Wake(Protocol):
    """What a waiter is woken through: a trio.Event (a get waiting in a task), or the
    reactor's note that a connection's long poll can be answered."""

    def set(self) -> None: ...


@dataclass(eq=False, slots=True)
class Waiter:
    """A get waiting for an item; `serve` hands it one (held, unless `peek`) and wakes it."""

    peek: bool
    event: Wake = field(default_factory=trio.Event)
    item: Item | None = None



#: A reader's earlier names, for the many that have none (one object for all).
NO_ALIASES: frozenset[str] = frozenset()


class LiveReader:
    """A reader plus what only the async side needs: waiters, refill lock."""

    __slots__ = ("_refill_lock", "aliases", "closed", "config", "reader", "refilling", "waiters")

    def __init__(self, reader: Reader, config: QueueConfig) -> None:
        self.reader = reader
        self.config = config
        self.waiters: deque[Waiter] = NO_ITEMS  # a deque from the first wait on
        self._refill_lock: trio.Lock | None = None  # made on first use: most readers never
        self.refilling = False  # a background refill task runs for it
        self.closed = False
        #: earlier names of this reader (the default reader it took over)
        self.aliases: frozenset[str] = NO_ALIASES

    @property
    def refill_lock(self) -> trio.Lock:
        """Held while a refill reads this reader's items back from disk."""
        lock = self._refill_lock
        if lock is None:
            lock = self._refill_lock = trio.Lock()
        return lock

    @property
    def refill_busy(self) -> bool:
        """A refill holds the refill lock (or waits for it)."""
        return self._refill_lock is not None and self._refill_lock.locked()

    def close(self) -> None:
        """Deleted: waiting gets answer empty; nothing more is read back for it."""
        self.closed = True
        self.wake_all()

    def wake_all(self) -> None:
        while self.waiters:
            self.waiters.popleft().event.set()

    def flush(self) -> int:
        """Discard every available item; how many."""
        r = self.reader
        n = r.flush()
        if r.flush_overflow:
            log.warning(
                "queue %s reader %r: flushed with reads open; %d flushed items would come "
                "back after a crash before those reads end (READ_DONE is capped)",
                r.queue, r.name, r.flush_overflow,
            )
            r.flush_overflow = 0
        return n

    def stats(self, now_ms: int, logsize: int, paused: bool = False) -> dict[str, int]:
        """The `stats` fields of this reader (`logsize`: its queue's journal bytes;
        `paused`: its queue's)."""
        r = self.reader
        oldest = r.oldest_add_time_ms()
        return stats_fields(
            r.items, r.bytes, r.counters, logsize, r.mem_count, r.mem_bytes, len(self.waiters),
            len(r.open), r.create_time_ms,
            0 if oldest is None else max(0, now_ms - oldest), r.delayed_count, paused)


def stats_fields(
    items: int, nbytes: int, c: ReaderCounters, logsize: int, mem_items: int, mem_bytes: int,
    waiters: int, open_reads: int, create_time_ms: int, oldest_age_ms: int, delayed: int,
    paused: bool = False,
) -> dict[str, int]:
    """A reader's `stats` fields (Kestrel's names), loaded or parked."""
    return {
        "items": items,
        "bytes": nbytes,
        "total_items": c.total_items,
        "logsize": logsize,
        "expired_items": c.expired,
        "mem_items": mem_items,
        "mem_bytes": mem_bytes,
        "age": c.age_ms,
        "discarded": c.discarded,
        "waiters": waiters,
        "open_transactions": open_reads,
        "transactions": c.transactions,
        "canceled_transactions": c.canceled_transactions,
        "total_flushes": c.flushes,
        "age_msec": c.age_ms,
        "create_time": create_time_ms,
        "gets": c.taken,
        "oldest_item_age_msec": oldest_age_ms,
        "delayed": delayed,
        "rejected": c.rejected,
        "paused": int(paused),
    }
