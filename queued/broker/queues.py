"""One queue's async state: its journal, its readers with their waiters, puts in flight.

`QueueState` is what the broker acts on for one queue: it hands durable puts to the
readers in id order, serves long-polling waiters first come first served, reads the
backlog back from the journal, returns open reads and disposes of expired items.
Work that runs on its own (refills ahead of time, moves to another queue) goes to a
`Background`, which `queued.broker.upkeep` attaches. Never creates queues or readers (the
registry does) and never touches a connection's open reads (`queued.broker.reliable` does).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from queued.broker.live_readers import LiveReader, Waiter, Wake
from queued.broker.readback import (
    FETCH_MAX_ITEMS,
    LOAD_SLICE,
    read_ids,
    read_range,
    segment_sizes,
)
from queued.errors import (
    ItemTooLargeError,
    JournalClosedError,
    JournalError,
    ProducerGapError,
    QueueClosedError,
    QueueFullError,
)
from queued.journal import format as jf
from queued.reader import shared
from queued.reader.dedup import DedupCounters, DedupEntry, DedupTable
from queued.reader.producers import ProducerCounters, ProducerEntry, ProducerTable, Verdict
from queued.reader.shared import NO_ENTRIES
from queued.reader.state import Item, pack_max_for
from queued.storage.journal import QueueJournal, Ticket, headers_overhead, put_overhead
from queued.storage.recovery import SegmentInfo

if TYPE_CHECKING:
    from queued.config import QueueConfig

log = logging.getLogger("queued.broker")
#: (C statics compiled, not look-ups in the module's globals at each use)
NO_ITEMS: Final[Any] = shared.NO_ITEMS
_new_deque: Final = deque


@dataclass(eq=False, slots=True, init=False)
class Inflight:
    puts: list[jf.Put]
    nbytes: int = 0  # item data bytes of `puts`
    due_ms: int | None = None  # delayed puts: when they fall due
    done: bool = False
    error: BaseException | None = None

    # (written out: a compiled class compiles it; see queued.journal.records.Put)
    def __init__(self, puts: list[jf.Put], nbytes: int = 0, due_ms: int | None = None,
                 done: bool = False, error: BaseException | None = None) -> None:
        self.puts = puts
        self.nbytes = nbytes
        self.due_ms = due_ms
        self.done = done
        self.error = error


@dataclass(eq=False, slots=True, init=False)
class PendingPut:
    """A put handed to the writer, not yet known durable (see Broker.begin_put).

    A put with a producer id or a deduplication key has an `answer`: (first id, count,
    duplicate); a duplicate stores nothing and waits for the ticket of the put it
    repeats, if that is in flight.
    """

    qs: QueueState
    entry: Inflight
    ticket: Ticket | None
    started: float = 0.0  # time.perf_counter() when begin_put was called
    answer: tuple[int, int, bool] | None = None
    producer: ProducerEntry | None = None  # the entry this put stored
    keys: Sequence[bytes] = ()  # the deduplication keys this put stored (its parts')

    # (written out, as Inflight's is)
    def __init__(self, qs: QueueState, entry: Inflight, ticket: Ticket | None,
                 started: float = 0.0, answer: tuple[int, int, bool] | None = None,
                 producer: ProducerEntry | None = None, keys: Sequence[bytes] = ()) -> None:
        self.qs = qs
        self.entry = entry
        self.ticket = ticket
        self.started = started
        self.answer = answer
        self.producer = producer
        self.keys = keys


def durable(pending: object) -> bool:
    """A producer entry's ticket says its put is durable."""
    return isinstance(pending, Ticket) and pending.done and pending.error is None


class Runner(Protocol):
    """What runs a queue's background work (`queued.broker.upkeep.Upkeep`)."""

    def refill(self, qs: QueueState, h: LiveReader) -> None: ...

    def move(
        self, qs: QueueState, h: LiveReader, items: list[Item], target: str, keep_errors: bool
    ) -> None: ...

    def timeouts_changed(self) -> None: ...

    def delays_changed(self, due_ms: int) -> None: ...


class Background:
    """Where queues send work that runs on its own. Until a runner attaches (upkeep does,
    in `open_broker`), read-behind waits for the next get and moves are refused."""

    def __init__(self) -> None:
        self.runner: Runner | None = None

    def start_refill(self, qs: QueueState, h: LiveReader) -> None:
        if self.runner is not None and not h.closed:
            self.runner.refill(qs, h)

    def start_move(
        self, qs: QueueState, h: LiveReader, items: list[Item], target: str, keep_errors: bool
    ) -> None:
        if self.runner is None:
            raise RuntimeError("broker is not running")
        self.runner.move(qs, h, items, target, keep_errors)

    def timeouts_changed(self) -> None:
        if self.runner is not None:
            self.runner.timeouts_changed()

    def delays_changed(self, due_ms: int) -> None:
        """An item now waits until `due_ms` (unix ms): wake its gets then."""
        if self.runner is not None:
            self.runner.delays_changed(due_ms)


class QueueState:
    """See the module docstring. `clock` is the broker's wall clock (unix ms)."""

    __slots__ = ("_reader_lock", "background", "busy", "clock", "config", "create_time_ms",
                 "dedup", "dedup_counters", "dedup_saved", "deleted", "delivered", "idle_since",
                 "inflight", "inflight_bytes", "inflight_items", "journal", "name", "paused",
                 "producer_counters", "producers", "producers_saved", "readers",
                 "unsaved_checkpoints", "used")

    def __init__(
        self,
        name: str,
        journal: QueueJournal,
        config: QueueConfig,
        clock: Callable[[], int],
        background: Background,
        producer_counters: ProducerCounters | None = None,
        dedup_counters: DedupCounters | None = None,
    ) -> None:
        self.name = name
        self.journal = journal
        self.config = config
        self.clock = clock
        self.background = background
        self.readers: dict[str, LiveReader] = {}
        self.inflight: deque[Inflight] = NO_ITEMS  # a deque from the first put on
        self.inflight_items = 0
        self.inflight_bytes = 0
        self.delivered = journal.last_id  # highest id handed to the readers
        self.create_time_ms = clock()
        self._reader_lock: trio.Lock | None = None  # made on first use (~0.5 KiB a lock)
        self.deleted = False
        #: reader -> why its last checkpoint write failed, until one succeeds (a dict from
        #: the first failure on)
        self.unsaved_checkpoints: dict[str, str] = NO_ENTRIES
        #: tasks inside an operation that yields before it shows (a put making room)
        self.busy = 0
        #: the registry handed it out since the parker last looked (queued.broker.parking)
        self.used = True
        self.idle_since = 0.0  # trio time the parker first saw it unused
        #: paused (pause/resume): puts go on, gets take nothing and long polls wait
        self.paused = False
        #: exactly-once puts: each producer's last put (None until the first, or recovered)
        self.producers: ProducerTable | None = None
        self.producers_saved = 0  # producers.changes the snapshot file holds
        self.producer_counters = producer_counters
        if journal.producer_marks:
            self.producer_table().restore(journal.producer_marks, clock())
            journal.producer_marks = NO_ITEMS
            self.producers_saved = -1  # (marks read from segments: in no snapshot yet)
        #: deduplication keys stored within their window (None until the first, or recovered)
        self.dedup: DedupTable | None = None
        self.dedup_saved = 0  # dedup.changes the snapshot file holds
        self.dedup_counters = dedup_counters
        if journal.dedup_marks:
            self.dedup_table().restore(journal.dedup_marks, clock())
            journal.dedup_marks = NO_ITEMS
            self.dedup_saved = -1

    @property
    def reader_lock(self) -> trio.Lock:
        """Held while a reader is created or removed (a takeover changes two files)."""
        lock = self._reader_lock
        if lock is None:
            lock = self._reader_lock = trio.Lock()
        return lock

    @property
    def reader_busy(self) -> bool:
        """A task holds the reader lock or waits for it."""
        return self._reader_lock is not None and self._reader_lock.locked()

    def forget_reader_lock(self) -> None:
        """Drop the reader lock unless a task holds it or waits for it (trio hands a
        released lock straight to the next waiter): the next use makes a new one."""
        lock = self._reader_lock
        if lock is not None and not lock.locked():
            self._reader_lock = None

    # -- puts --------------------------------------------------------------------------------

    async def begin_put(
        self, datas: Sequence[bytes], *, expire_ms: int | None, error_count: int, flags: int = 0,
        delay_ms: int = 0, producer: bytes | None = None, sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
    ) -> PendingPut:
        """Checks, limits, ids; hands the items to the writer (see Broker.begin_put)."""
        if not datas:
            return PendingPut(self, Inflight([], done=True), None)
        now, expire_ms, nbytes = self._check_put(datas, expire_ms)
        n = len(datas)
        # Shielded: a discard, refill, compaction or drop cut short by a cancellation could
        # leave the readers' counts and the files apart (the session does not shield a put
        # whose write is done when its begin returns: see Session._puts).
        room = self.needs_room()
        if producer is not None and self.producers is not None and self.producers.verdict(
                producer, sequence, now) is not Verdict.STORE:
            room = False  # (a repeat or a gap stores nothing: it makes no room either)
        elif key is not None and self.dedup is not None and self.dedup.seen(key, now):
            room = False  # (likewise a duplicate key)
        elif room or self.journal.config.max_journal_size:
            self.busy += 1  # (these awaits show in no other way: the queue must not park)
            try:
                await self._make_room(room, n, nbytes, put_overhead(flags, delay_ms > 0) * n
                                      + headers_overhead(headers))
            finally:
                self.busy -= 1
        return self._reserve(datas, now, expire_ms, error_count, flags, delay_ms, nbytes,
                             producer, sequence, headers, key)

    def begin_put_nowait(
        self, datas: Sequence[bytes], *, expire_ms: int | None, error_count: int, flags: int = 0,
        delay_ms: int = 0, producer: bytes | None = None, sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None, keys: Sequence[tuple[int, int, bytes]] = (),
    ) -> PendingPut:
        """`begin_put` without waiting: trio.WouldBlock (nothing changed) when the put
        must first make room (per-reader limits, max_journal_size). `keys`: the parts of
        puts joined in a pass that carry a key, (start, end, key), each reserved by
        `join_key`."""
        if not datas:
            return PendingPut(self, Inflight([], done=True), None)
        now, expire_ms, nbytes = self._check_put(datas, expire_ms)
        if self.needs_room() or self.journal.config.max_journal_size:
            raise trio.WouldBlock
        if keys:
            return self._reserve_joined(datas, now, expire_ms, flags, delay_ms, nbytes, keys,
                                        headers)
        return self._reserve(datas, now, expire_ms, error_count, flags, delay_ms, nbytes,
                             producer, sequence, headers, key)

    def producer_table(self) -> ProducerTable:
        t = self.producers
        if t is None:
            cfg = self.config
            t = self.producers = ProducerTable(cfg.max_producers, cfg.producer_expiry,
                                               self.producer_counters)
            self.journal.before_compact = self.save_marks
        return t

    def dedup_table(self) -> DedupTable:
        t = self.dedup
        if t is None:
            cfg = self.config
            t = self.dedup = DedupTable(cfg.max_dedup_keys, cfg.dedup_window,
                                        self.dedup_counters)
            self.journal.before_compact = self.save_marks
        return t

    async def save_marks(self) -> None:
        """Write the producer and key snapshots that changed (see save_producers)."""
        await self.save_producers()
        t = self.dedup
        if t is None or t.changes == self.dedup_saved or self.deleted:
            return
        t.trim(self.clock())  # (keys past the window need no saving)
        changes, complete = t.changes, t.all_durable(durable)
        await self.journal.write_dedup(t.marks(durable))
        if complete:
            self.dedup_saved = changes

    async def save_producers(self) -> None:
        """Write the producer snapshot (`q.producers`) if it changed: before a compaction
        or a drop removes segments, whose PRODUCER records it then stands for. Marks of
        puts not yet durable are left out: they are in the newest segment, which stays."""
        t = self.producers
        if t is None or t.changes == self.producers_saved or self.deleted:
            return
        changes, complete = t.changes, t.all_durable(durable)
        await self.journal.write_producers(t.marks(durable))
        if complete:
            self.producers_saved = changes

    def _producer_check(self, producer: bytes, sequence: int, now: int,
                        ) -> tuple[ProducerTable, PendingPut | None]:
        """A repeat's answer (a PendingPut storing nothing), or None: store it. Raises
        ProducerGapError for a gap."""
        t = self.producer_table()
        e = t.entries.get(producer)
        if e is not None and isinstance(e.pending, Ticket) and e.pending.done:
            if e.pending.error is not None:
                t.forget(producer, e)  # its put failed: never stored
            else:
                e.pending = None
        verdict, e = t.check(producer, sequence, now)
        if verdict is Verdict.STORE:
            return t, None
        if verdict is Verdict.GAP:
            raise ProducerGapError(f"producer sequence {sequence} skips ahead: "
                                   f"{1 if e is None else e.sequence + 1} is next on queue "
                                   f"{self.name!r}")
        assert e is not None
        same = sequence == e.sequence
        ticket = e.pending if isinstance(e.pending, Ticket) else None
        return t, PendingPut(self, Inflight([], done=True), ticket,
                             answer=(e.first_id if same else 0, e.count if same else 0, True))

    def needs_room(self) -> bool:
        """A put must check (and maybe make) room under item or size limits first."""
        cfg = self.config
        return bool(cfg.max_items or cfg.max_size or self.limited())

    def _check_put(self, datas: Sequence[bytes], expire_ms: int | None,
                   ) -> tuple[int, int | None, int]:
        """(now, the expiry capped by max_age, the data's bytes); raises when refused."""
        cfg = self.config
        limit = cfg.max_item_size
        nbytes = 0
        for d in datas:  # (one loop: compiled, `max(map(len, ...))` looks up three builtins)
            if limit and len(d) > limit:
                raise ItemTooLargeError(
                    f"item over max_item_size ({limit} bytes) of queue {self.name!r}")
            nbytes += len(d)
        now = self.clock()
        max_age = cfg.max_age
        if max_age:
            cap = now + max_age
            expire_ms = cap if expire_ms is None else min(expire_ms, cap)
        return now, expire_ms, nbytes

    def _reserve(self, datas: Sequence[bytes], now: int, expire_ms: int | None,
                 error_count: int, flags: int, delay_ms: int, nbytes: int,
                 producer: bytes | None = None, sequence: int = 0,
                 headers: Sequence[bytes] | None = None,
                 key: bytes | None = None) -> PendingPut:
        """Ids and the journal append (the writer makes it durable); in flight until ended.
        With a producer: a repeat answered as the original, a gap refused, else the
        append carries the producer's mark. With a key: likewise (no gap). `headers`: a
        block per item (b"": none)."""
        if self.deleted:
            raise QueueClosedError(f"queue {self.name!r} was deleted")
        due_ms = now + delay_ms if delay_ms > 0 else None
        if key is not None:
            if producer is not None:
                raise ValueError("a put carries a producer or a deduplication key, not both")
            return self._reserve_keyed(datas, now, expire_ms, error_count, flags, due_ms,
                                       nbytes, key, headers)
        if producer is not None:
            table, repeat = self._producer_check(producer, sequence, now)
            if repeat is not None:
                return repeat
            puts, ticket = self.journal.append_nowait(datas, now, expire_ms, error_count,
                                                      flags, due_ms, (producer, sequence),
                                                      headers)
            mark = table.store(producer, sequence, puts[0].id, len(puts), now, ticket)
            pending = self._inflight(puts, ticket, nbytes, due_ms, len(datas))
            pending.answer = (puts[0].id, len(puts), False)
            pending.producer = mark
            return pending
        puts, ticket = self.journal.append_nowait(datas, now, expire_ms, error_count, flags,
                                                  due_ms, headers=headers)
        return self._inflight(puts, ticket, nbytes, due_ms, len(datas))

    def _reserve_keyed(self, datas: Sequence[bytes], now: int, expire_ms: int | None,
                       error_count: int, flags: int, due_ms: int | None, nbytes: int,
                       key: bytes, headers: Sequence[bytes] | None = None) -> PendingPut:
        """_reserve of a put with a deduplication key: a duplicate answered as the put
        that stored the key (once that is durable), else stored with a DEDUP record."""
        t, e = self._key_check(key, now)
        if e is not None:
            if not (e.pending is None or isinstance(e.pending, Ticket)):
                raise trio.WouldBlock  # a put joined in this pass holds it: after its commit
            return PendingPut(self, Inflight([], done=True), e.pending,
                              answer=(e.first_id, e.count, True))
        puts, ticket = self.journal.append_nowait(datas, now, expire_ms, error_count, flags,
                                                  due_ms, headers=headers,
                                                  dedup=((0, len(datas), key),))
        t.store(key, puts[0].id, len(puts), now, ticket)
        pending = self._inflight(puts, ticket, nbytes, due_ms, len(datas))
        pending.answer = (puts[0].id, len(puts), False)
        pending.keys = (key,)
        return pending

    @staticmethod
    def _keys_ended(table: DedupTable, keys: Sequence[bytes], ticket: Ticket,
                    error: BaseException | None) -> None:
        """The put that stored `keys` is durable (their entries keep no ticket), or failed
        (never stored: forgotten)."""
        for key in keys:
            kept = table.entries.get(key)
            if kept is not None and kept.pending is ticket:
                if error is None:
                    kept.pending = None
                else:
                    table.forget(key, kept)

    def _key_check(self, key: bytes, now: int) -> tuple[DedupTable, DedupEntry | None]:
        """The table and the entry of the put that stored `key` in the window (this put is
        a duplicate), or None; an entry whose put failed is forgotten first."""
        t = self.dedup_table()
        e = t.entries.get(key)
        if e is not None and isinstance(e.pending, Ticket) and e.pending.done:
            if e.pending.error is not None:
                t.forget(key, e)  # its put failed: never stored
            else:
                e.pending = None
        return t, t.check(key, now)

    def join_key(self, key: bytes, part: object) -> PendingPut | DedupEntry | None:
        """A keyed put about to be joined in the reactor's pass: None, the key is new and
        now reserved for `part` (its entry holds `part` until the joined append, or
        `unjoin_key`); the entry reserved by an earlier part of this pass (a duplicate of
        it); or a duplicate's PendingPut (the key was stored before this pass)."""
        now = self.clock()
        t, e = self._key_check(key, now)
        if e is None:
            t.store(key, 0, 0, now, part)
            return None
        if e.pending is None or isinstance(e.pending, Ticket):
            return PendingPut(self, Inflight([], done=True), e.pending,
                              answer=(e.first_id, e.count, True))
        return e

    def unjoin_key(self, key: bytes, part: object) -> None:
        """`part` is not joined after all: drop its reservation (it begins on its own)."""
        t = self.dedup
        e = None if t is None else t.entries.get(key)
        if t is not None and e is not None and e.pending is part:
            t.forget(key, e)

    def _reserve_joined(self, datas: Sequence[bytes], now: int, expire_ms: int | None,
                        flags: int, delay_ms: int, nbytes: int,
                        keys: Sequence[tuple[int, int, bytes]],
                        headers: Sequence[bytes] | None = None) -> PendingPut:
        """_reserve of puts joined in a pass, some with keys reserved by `join_key`: one
        append, a DEDUP record after each keyed part; the reservations become entries."""
        if self.deleted:
            raise QueueClosedError(f"queue {self.name!r} was deleted")
        due_ms = now + delay_ms if delay_ms > 0 else None
        puts, ticket = self.journal.append_nowait(datas, now, expire_ms, 0, flags, due_ms,
                                                  headers=headers, dedup=keys)
        t = self.dedup_table()
        for start, end, key in keys:
            e = t.entries.get(key)
            if e is not None and not (e.pending is None or isinstance(e.pending, Ticket)):
                e.first_id, e.count, e.pending = puts[start].id, end - start, ticket
        pending = self._inflight(puts, ticket, nbytes, due_ms, len(datas))
        pending.keys = [key for _, _, key in keys]
        return pending

    def _inflight(self, puts: list[jf.Put], ticket: Ticket, nbytes: int, due_ms: int | None,
                  n: int) -> PendingPut:
        entry = Inflight(puts, nbytes, due_ms)
        if self.inflight is NO_ITEMS:
            self.inflight = _new_deque()
        self.inflight.append(entry)
        self.inflight_items += n
        self.inflight_bytes += nbytes
        return PendingPut(self, entry, ticket)

    async def end_put(self, pending: PendingPut) -> int:
        """Wait until durable, then deliver (in id order); the number of items."""
        ticket = pending.ticket
        if ticket is not None:
            await ticket.wait()
        return self.end_put_nowait(pending)

    def end_put_nowait(self, pending: PendingPut) -> int:
        """`end_put` once its write is done (its ticket set): deliver, or raise its error."""
        entry, ticket = pending.entry, pending.ticket
        if ticket is None:
            return 0
        assert ticket.done, "end_put_nowait before the write was done"
        error = ticket.error
        if error is not None and not isinstance(error, Exception):
            raise error  # (as wait_durable would: not a write's failure)
        mark = pending.producer
        if mark is not None and mark.pending is ticket:
            if error is None:
                mark.pending = None  # durable: the entry keeps no ticket
            elif self.producers is not None:
                for p, e in list(self.producers.entries.items()):
                    if e is mark:
                        self.producers.forget(p, e)  # never stored: forget it
        if pending.keys and self.dedup is not None:
            self._keys_ended(self.dedup, pending.keys, ticket, error)
        if not entry.puts:
            if error is not None:
                raise error  # (a repeat of a put that failed)
            return 0
        entry.error = error
        entry.done = True
        self.inflight_items -= len(entry.puts)
        self.inflight_bytes -= entry.nbytes
        self.drain()
        if entry.error is not None:
            raise entry.error
        return len(entry.puts)

    async def _make_room(self, room: bool, n: int, nbytes: int, overhead: int) -> None:
        if room:
            with trio.CancelScope(shield=True):
                await self.make_room(n, nbytes)
        if self.journal.config.max_journal_size:
            if self.journal.before_drop is None:  # (set here: a bound method is ~64 B)
                self.journal.before_drop = self.before_drop
            with trio.CancelScope(shield=True):
                await self.journal.make_room(nbytes + overhead)

    def limited(self) -> bool:
        return any(h.config.max_items or h.config.max_size for h in self.readers.values())

    async def make_room(self, n: int, nbytes: int) -> None:
        """Room for `n` more items (`nbytes`) under every reader's limits, discarding the
        oldest where the config says so; QueueFullError otherwise."""
        for h in list(self.readers.values()):
            r = h.reader
            while r.over_limits(n + self.inflight_items, nbytes + self.inflight_bytes):
                if not h.config.discard_old_when_full:
                    raise QueueFullError(f"queue {self.name!r} is full")
                if r.discard_oldest() is None:
                    if r.behind is not None and not h.closed:
                        await self.refill_once(h)
                        continue
                    raise QueueFullError(f"queue {self.name!r} cannot hold {n} items")

    def drain(self) -> None:
        """Hand durable puts to the readers in id order."""
        while self.inflight and self.inflight[0].done:
            entry = self.inflight.popleft()
            if entry.error is not None or self.deleted:
                continue
            self.delivered = entry.puts[-1].id
            readers = list(self.readers.values())
            most = pack_max_for(len(readers))  # the readers share these objects
            for h in readers:
                if h.reader.pack_max != most:  # (one reader: the class default, no slot set)
                    h.reader.pack_max = most
                h.reader.add(entry.puts)
                self.serve(h)
            if entry.due_ms is not None:
                self.background.delays_changed(entry.due_ms)
        if not self.inflight:
            self.inflight = NO_ITEMS  # (most queues are idle most of the time)

    # -- gets --------------------------------------------------------------------------------

    def serve(self, h: LiveReader) -> None:
        """Hand available items to waiting gets, first come first served."""
        if h.waiters:
            expired: list[Item] = []
            now = self.clock()
            while h.waiters:
                w = h.waiters[0]
                if self.paused and not w.peek:
                    break  # (they wait for `resume`)
                it = h.reader.peek(now, expired) if w.peek else h.reader.take(now, expired)
                if it is None:
                    break
                h.waiters.popleft()
                if not w.peek:
                    h.reader.hold(it)  # until the waiter's get finishes
                w.item = it
                w.event.set()
            self.dispose_expired(h, expired)
        if h.reader.wants_refill() or h.reader.wants_fetch():
            self.background.start_refill(self, h)

    def line_up(self, h: LiveReader, peek: bool, wake: Wake) -> Waiter:
        """A waiter at the end of `h`'s line, woken through `wake` (see `serve`)."""
        w = Waiter(peek, wake)
        if h.waiters is NO_ITEMS:
            h.waiters = deque()
        h.waiters.append(w)
        return w

    def leave_line(self, h: LiveReader, w: Waiter) -> None:
        """`w` gives up: out of the line, and an item it was handed goes back unharmed."""
        if w.item is None:
            with suppress(ValueError):
                h.waiters.remove(w)
        elif not w.peek and h.reader.unhold(w.item.id):
            w.item = None
            self.serve(h)

    async def wait(self, h: LiveReader, *, peek: bool, deadline: float) -> Item | None:
        """Wait in line until `deadline` (trio time) for the next item: held for the
        caller unless `peek`, None if none came. If the wait is cancelled after an
        item was handed over, the item goes back unharmed."""
        woken = trio.Event()
        w = self.line_up(h, peek, woken)
        try:
            with trio.move_on_at(deadline):
                await woken.wait()
        except BaseException:
            if w.item is not None and not peek and h.reader.unhold(w.item.id):
                self.serve(h)
            raise
        finally:
            if w.item is None:
                with suppress(ValueError):
                    h.waiters.remove(w)
        return w.item

    async def take_now(self, h: LiveReader, max_items: int, max_bytes: int, *,
                       even_paused: bool = False) -> list[Item]:
        """Items available now (read back from disk if need be), each held by `hold`;
        none while paused, unless `even_paused` (a move)."""
        r = h.reader
        out: list[Item] = []
        try:
            while (fetch := self._take_held(h, out, max_items, max_bytes,
                                            even_paused)) is not None:
                try:
                    await (self.fetch_once(h) if fetch else self.refill_once(h))
                except JournalError:
                    if out:
                        break  # serve what we have; the next get reports it
                    raise
        except BaseException:
            for it in reversed(out):  # cancelled while reading back: put them back unharmed
                r.unhold(it.id)
            raise
        if r.wants_refill() or r.wants_fetch():
            self.background.start_refill(self, h)
        return out

    def take_nowait(self, h: LiveReader, max_items: int, max_bytes: int) -> list[Item]:
        """`take_now` without reading back from disk: trio.WouldBlock (every item put
        back unharmed) when it would have to."""
        r = h.reader
        out: list[Item] = []
        if self._take_held(h, out, max_items, max_bytes) is not None:
            for it in reversed(out):
                r.unhold(it.id)
            raise trio.WouldBlock
        if r.wants_refill() or r.wants_fetch():
            self.background.start_refill(self, h)
        return out

    def take_one_nowait(self, h: LiveReader) -> Item | None:
        """`take_nowait` of one item for a plain get (no open read): consumed at once,
        as its hold and confirm would leave it; None: none in memory (trio.WouldBlock
        when one waits on disk)."""
        r = h.reader
        it = None
        if not self.paused:  # (paused: nothing taken, as `_take_held` takes nothing)
            expired: list[Item] = []
            it = r.take(self.clock(), expired)
            if expired:
                self.dispose_expired(h, expired)
            if it is not None:
                r.consume(it.id)
            elif (r.behind is not None or r.wants_fetch()) and not h.closed:
                raise trio.WouldBlock
        if r.wants_refill() or r.wants_fetch():
            self.background.start_refill(self, h)
        return it

    def _take_held(self, h: LiveReader, out: list[Item], max_items: int,
                   max_bytes: int, even_paused: bool = False) -> bool | None:
        """Take (and hold) into `out` what memory has, up to the limits; None when done,
        else what must be read back before more can come: True a due item's data
        (fetch), False the next run of the backlog (refill)."""
        r = h.reader
        if self.paused and not even_paused:
            return None
        nbytes = sum([len(it.data) for it in out])
        expired: list[Item] = []
        now = self.clock()
        bulk = True  # (off once take_held finds the next items are not plain ones)
        try:
            while len(out) < max_items and not (max_bytes and nbytes >= max_bytes):
                want = max_items - len(out)
                if bulk and want > 1:  # (for one item, take's path is as quick)
                    run = r.take_held(now, want, max_bytes - nbytes if max_bytes else 0)
                    if run:
                        out += run
                        nbytes += sum([len(it.data) for it in run])
                        continue
                    bulk = False  # expiring, returned or delayed items: one at a time
                it = r.take(now, expired)
                if it is None:
                    fetch = r.wants_fetch()
                    if (r.behind is None and not fetch) or h.closed:
                        return None
                    return fetch
                r.hold(it)
                out.append(it)
                nbytes += len(it.data)
            return None
        finally:
            self.dispose_expired(h, expired)

    async def refill_once(self, h: LiveReader) -> None:
        """Read the next run of on-disk items back into memory (in a worker thread)."""
        async with h.refill_lock:
            r = h.reader
            if r.behind is None or h.closed:
                return
            start, end = r.behind, r.tail
            try:
                items, next_id = await trio.to_thread.run_sync(
                    read_range, self.journal, start, end, r.refill_budget()
                )
            except (OSError, JournalError) as exc:
                if h.closed or self.deleted:
                    return  # deleted while reading: nothing left to serve
                log.error("queue %s: read-behind failed: %s", self.name, exc)
                raise JournalError(
                    f"queue {self.name!r}: reading items back failed: {exc}") from exc
            # Into memory a slice at a time, with the event loop's other work (every
            # connection the reactor serves) between the slices: a whole read (50,000
            # items) took ~38 ms of the loop compiled, a stall for every client.
            n = len(items)
            for a in range(0, n, LOAD_SLICE):
                b = a + LOAD_SLICE
                upto = items[b].id if b < n else next_id
                # (`load` says whether to go on: `r.behind`, read here, is still the int
                # mypy narrowed it to before the awaits, and compiled code trusts that,
                # though a flush between the slices may have made it None)
                more = r.load(start, items[a:b], upto)
                self.serve(h)
                if b >= n or not more or h.closed:
                    break  # (done; or a flush moved read-behind meanwhile: the rest is moot)
                start = upto
                await trio.lowlevel.checkpoint()

    async def fetch_once(self, h: LiveReader) -> None:
        """Read the data of the next due items that wait on disk (in a worker thread)."""
        async with h.refill_lock:
            r = h.reader
            ids = r.fetch_ids(FETCH_MAX_ITEMS)
            if not ids or h.closed:
                return
            try:
                items = await trio.to_thread.run_sync(read_ids, self.journal, ids)
            except (OSError, JournalError) as exc:
                if h.closed or self.deleted:
                    return
                log.error("queue %s: reading due items back failed: %s", self.name, exc)
                raise JournalError(
                    f"queue {self.name!r}: reading items back failed: {exc}") from exc
            lost = r.fetched(items, ids)
            if lost:
                log.error("queue %s reader %r: %d due items were no longer in the journal",
                          self.name, r.name, lost)
            self.serve(h)

    # -- open reads, expiry, moves ---------------------------------------------------------

    def owner(self, rname: str, item_id: int) -> LiveReader | None:
        """The reader holding open read `item_id` taken under the name `rname`."""
        h = self.readers.get(rname)
        if h is not None and item_id in h.reader.open:
            return h
        for other in self.readers.values():
            if rname in other.aliases and item_id in other.reader.open:
                return other
        return None

    def return_read(self, h: LiveReader, item_id: int, *, count_error: bool,
                    due_ms: int | None = None) -> tuple[Item, int | None] | None:
        """An open read goes back to the head (or waits until `due_ms`; with no `due_ms`,
        an error counted waits the reader's `retry_backoff` step), or to the error queue
        past max_errors; the item as returned and the due time it got (None if it was
        not open)."""
        it = h.reader.abort(item_id, count_error=count_error)
        if it is None:
            return None
        cfg = h.config
        if due_ms is None and count_error and cfg.retry_backoff:
            due_ms = self.clock() + cfg.backoff_ms(it.error_count)
        if cfg.error_queue and cfg.max_errors and it.error_count >= cfg.max_errors:
            h.reader.start_move(it)
            self.background.start_move(self, h, [it], cfg.error_queue, True)
            return it, None
        if due_ms is not None:
            h.reader.delay_back(it, due_ms)
            self.background.delays_changed(due_ms)
        else:
            h.reader.put_back(it)
        return it, due_ms

    def reject_read(self, h: LiveReader, item_id: int) -> Item | None:
        """An open read given up on: to the error queue at once (keeping its error count),
        or consumed when the reader has none; the item (None if it was not open)."""
        it = h.reader.open.get(item_id)
        if it is None:
            return None
        h.reader.counters.rejected += 1
        target = h.config.error_queue
        if target and target != self.name:
            del h.reader.open[item_id]
            h.reader.start_move(it)
            self.background.start_move(self, h, [it], target, True)
        else:
            h.reader.confirm(item_id)
        return it

    def note_read(
        self, h: LiveReader, done: Sequence[int] = (), errors: Sequence[tuple[int, int]] = (),
        delays: Sequence[tuple[int, int]] = (),
    ) -> Ticket | None:
        """Journal what reader `h` consumed (`done`), the error counts aborts gave
        (`errors`) or the due times aborts with a delay gave (`delays`): the ticket is set
        once durable (None: queue or reader deleted)."""
        if self.deleted or h.closed:
            return None
        try:
            return self.journal.note_read(h.reader.name, done=done, errors=errors,
                                          delays=delays)
        except JournalClosedError:
            return None

    def dispose_expired(self, h: LiveReader, items: list[Item]) -> None:
        """Expired items leave: moved to expire_to_queue if set, else consumed."""
        if not items:
            return
        target = h.config.expire_to_queue
        if target and target != self.name:
            for it in items:
                h.reader.start_move(it)
            self.background.start_move(self, h, items, target, False)
        else:
            for it in items:
                h.reader.consume(it.id)

    def expire_head(self, h: LiveReader, now_ms: int, limit: int) -> int:
        """Expired items at the head of `h` leave (at most `limit`, 0 = all); how many."""
        expired: list[Item] = []
        h.reader.expire_head(now_ms, limit, expired)
        self.dispose_expired(h, expired)
        return len(expired)

    def finish_move(self, h: LiveReader, items: list[Item], *, moved: bool,
                    keep_errors: bool) -> None:
        """Items sent to another queue arrived (consume them here) or did not: a failed
        error-queue move puts them back; an expired item that cannot move is dropped,
        as Kestrel drops it."""
        for it in items:
            h.reader.end_move(it.id, moved=moved or not keep_errors)
        if moved:  # durable in the other queue: gone from here for good
            self.note_read(h, done=[it.id for it in items])
        else:
            self.serve(h)

    # -- lifetime ----------------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing in flight, stored, open, moving or waiting (max_queue_age may delete it)."""
        return not self.inflight and all(
            not (h.reader.items or h.reader.open or h.reader.moving or h.waiters)
            for h in self.readers.values()
        )

    async def write_checkpoints(self, *, force: bool = False) -> int:
        """Write the checkpoint of every reader that consumed something (all if `force`),
        then compact if one was written; returns how many were written."""
        written = 0
        if not (force or any(h.reader.dirty for h in self.readers.values())):
            return 0  # (most queues, most of the time: their reader lock is not made)
        async with self.reader_lock:  # not in the middle of a takeover
            for name, h in list(self.readers.items()):
                if not (h.reader.dirty or force) or self.deleted or h.closed:
                    continue
                head, done = h.reader.checkpoint()
                try:
                    await self.journal.write_checkpoint(name, head, done,
                                                        h.reader.error_counts(),
                                                        h.reader.delay_entries())
                except (OSError, JournalError) as exc:
                    h.reader.dirty = True
                    cause = exc if isinstance(exc, OSError) else exc.__cause__
                    if self.unsaved_checkpoints is NO_ENTRIES:
                        self.unsaved_checkpoints = {}
                    self.unsaved_checkpoints[name] = str(
                        cause.strerror if isinstance(cause, OSError) and cause.strerror
                        else exc)
                    log.error("queue %s: checkpoint of reader %r failed: %s",
                              self.name, name, exc)
                    continue
                if name in self.unsaved_checkpoints:
                    del self.unsaved_checkpoints[name]
                written += 1
        self.forget_reader_lock()  # (a lock is ~0.3 KiB, on each of 10,000 idle queues)
        if written and not self.deleted and len(self.journal.segments) > 1:
            try:
                await self.journal.compact()
            except (OSError, JournalError) as exc:
                log.error("queue %s: compaction failed: %s", self.name, exc)
        return written

    async def before_drop(self, seg: SegmentInfo) -> None:
        """drop_oldest is about to remove `seg`: take its items out of every reader.

        The segment is read (in a thread) so items that were only on disk are
        subtracted exactly; ids in a reader's `done` were never counted. The producer
        snapshot is written first: the segment's PRODUCER records go with it (and the
        key snapshot: its DEDUP records).
        """
        await self.save_marks()
        sizes: list[tuple[int, int, bool]] = []
        if any(h.reader.behind is not None and h.reader.behind <= seg.last_id
               for h in self.readers.values()):
            sizes = await trio.to_thread.run_sync(segment_sizes, self.journal, seg)
        for h in self.readers.values():
            r = h.reader
            count = nbytes = 0
            if r.behind is not None:
                for item_id, size, delayed in sizes:
                    if delayed or item_id in r.delays:
                        continue  # the delay heap counts it (drop_through)
                    if item_id >= r.behind and item_id <= r.tail and item_id not in r.done:
                        count += 1
                        nbytes += size
            r.drop_through(seg.last_id, count, nbytes)

    # -- statistics --------------------------------------------------------------------------

    def reader_stats(self, h: LiveReader) -> dict[str, int]:
        return h.stats(self.clock(), self.journal.total_bytes, self.paused)
