"""The queues of one server as the protocol sessions see them: put, get, confirm, abort.

Puts become durable through the data directory's writer and only then reach the
readers (in id order) and long-polling waiters (FIFO); a reliable read belongs to
the `OpenReads` ledger of its connection and goes back to the head of its queue
when aborted, not confirmed in time, or when its connection leaves. No sockets and no
background loops here: the sessions call these methods and `queued.broker.upkeep` runs
the periodic work (it may import this module; this module never imports it).
The registry (`queued.broker.registry`) finds and creates queues and readers; each
queue's own logic is `queued.broker.queues`; open reads across queues, `queued.broker.reliable`;
the per-reader state machine is pure, in `queued.reader.state`.

Readers. `q` is reader "" of queue q; `q+name` is reader `name`. A new named
reader starts at the tail (it sees items put after it was created), except the
first named reader of a queue that only has the default reader: it takes over
the default reader's backlog and checkpoint (libkestrel's rule), and a later
plain `q` starts a new default reader at the tail.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from queued.broker import parking
from queued.broker.live_readers import LiveReader, Waiter, Wake
from queued.broker.queues import Background, PendingPut, QueueState
from queued.broker.readback import read_live
from queued.broker.registry import BrokerCounters, Registry
from queued.broker.reliable import Owe, ReliableReads
from queued.errors import BadNameError, JournalError, QueueFullError
from queued.journal import format as jf
from queued.reader.open_reads import OpenReads, TimeoutHeapStatistics
from queued.reader.state import Item
from queued.stats import LATENCY_BUCKETS, Histogram
from queued.storage.datadir import DataDir
from queued.storage.journal import JournalStats

if TYPE_CHECKING:
    from queued.config import ServerConfig

__all__ = ["Broker", "BrokerCounters", "BrokerStatistics", "Owe", "PendingPut", "wall_ms"]

log = logging.getLogger("queued.broker")


class JoinedPut:
    """One connection's part of a put joined with others (`JoinedPuts`): ended, or why
    it failed; a part with a deduplication key has its own `answer` (first id, count,
    duplicate)."""

    __slots__ = ("answer", "ended", "error", "pending")

    def __init__(self) -> None:
        self.pending: PendingPut | None = None
        self.error: Exception | None = None
        self.ended = False
        self.answer: tuple[int, int, bool] | None = None


class _Join:
    """Puts joined into one append: the items, [(part, how many, key), ...], and the
    items' headers blocks (a list once a part has any, b"" for an item without)."""

    __slots__ = ("headers", "items", "parts")

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.parts: list[tuple[JoinedPut, int, bytes | None]] = []
        self.headers: list[bytes] | None = None


class JoinedPuts:
    """The puts of one pass (the reactor's), joined: every connection's put to a queue
    with the same expiry, flags and delay becomes one journal append (one id range, one
    hand-off to the readers), begun after every connection has run (`begin_all`) and
    ended after the pass's commit (`end_all`). A queue that must make room first (or is
    not loaded) is not joined: its puts begin on their own. A joined append that is
    refused is retried part by part, so each connection gets its own answer.

    A put with a deduplication key is joined too: its key is checked and reserved when it
    is added (`QueueState.join_key`), so a second put of the key in the pass follows the
    first (answered as it, storing nothing), and its DEDUP record goes after its items."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        #: (queue, expire_ms, flags, delay_ms) -> the puts joined
        self._joins: dict[tuple[str, int | None, int, int], _Join] = {}
        self._begun: list[tuple[PendingPut | None, list[JoinedPut]]] = []
        self._followers: list[tuple[JoinedPut, JoinedPut]] = []  # (a duplicate, its leader)
        #: queues found joinable in this pass (nothing else runs during a pass to change it)
        self._joinable: set[str] = set()

    def has(self, queue: str) -> bool:
        """Puts to `queue` are joined, not yet begun."""
        return any(key[0] == queue for key in self._joins)

    def can_join(self, queue: str) -> bool:
        if queue in self._joinable:
            return True
        qs = self.broker.registry.queues.get(queue)
        if qs is None or qs.needs_room() or qs.journal.config.max_journal_size:
            return False
        self._joinable.add(queue)
        return True

    def add(self, queue: str, items: Sequence[bytes], expire_ms: int | None, flags: int,
            delay_ms: int, headers: Sequence[bytes] | None = None,
            key: bytes | None = None) -> JoinedPut | PendingPut:
        """The part of a put in the pass; with a `key` already stored before the pass, the
        duplicate's PendingPut instead (not joined: it stores nothing)."""
        part = JoinedPut()
        if key is not None:
            seen = self.broker.registry.queue(queue).join_key(key, part)
            if isinstance(seen, PendingPut):
                return seen
            if seen is not None:  # an earlier part of this pass stored it
                assert isinstance(seen.pending, JoinedPut)
                self._followers.append((part, seen.pending))
                return part
        join_as = (queue, expire_ms, flags, delay_ms)
        join = self._joins.get(join_as)
        if join is None:
            join = self._joins[join_as] = _Join()
        if headers is not None or join.headers is not None:
            if join.headers is None:
                join.headers = [b""] * len(join.items)
            join.headers += [b""] * len(items) if headers is None else headers
        join.items += items
        join.parts.append((part, len(items), key))
        return part

    def begin_all(self) -> None:
        b = self.broker
        self._joinable.clear()
        for (queue, expire_ms, flags, delay_ms), join in self._joins.items():
            items, parts, headers = join.items, join.parts, join.headers
            keys, start = [], 0  # (start, end, key) of the keyed parts
            for _, n, key in parts:
                if key is not None:
                    keys.append((start, start + n, key))
                start += n
            try:
                pending = b.begin_put_nowait(queue, items, expire_ms=expire_ms, flags=flags,
                                             delay_ms=delay_ms, headers=headers, keys=keys)
            except Exception:  # (WouldBlock included) each part on its own, then
                start = 0
                qs = b.registry.queues.get(queue)
                for part, n, key in parts:
                    if key is not None and qs is not None:
                        qs.unjoin_key(key, part)
                    try:
                        part.pending = b.begin_put_nowait(
                            queue, items[start:start + n], expire_ms=expire_ms, flags=flags,
                            delay_ms=delay_ms,
                            headers=None if headers is None else headers[start:start + n],
                            key=key)
                        part.answer = part.pending.answer
                    except trio.WouldBlock:
                        part.error = QueueFullError(f"queue {queue!r} is full")
                    except Exception as exc:
                        part.error = exc
                    self._begun.append((part.pending, [part]))
                    start += n
                continue
            self._begun.append((pending, [part for part, _, _ in parts]))
            for part, _, _ in parts:
                part.pending = pending
            puts = pending.entry.puts
            for (start, end, _), part in zip(keys, (p for p, _, k in parts if k is not None),
                                             strict=True):
                part.answer = (puts[start].id, end - start, False)
        self._joins.clear()

    def end_all(self) -> None:
        """After the pass's commit (every ticket set)."""
        for pending, parts in self._begun:
            error: Exception | None = None
            if pending is not None:
                try:
                    self.broker.end_put_nowait(pending, len(parts))
                except Exception as exc:
                    error = exc
            for part in parts:
                part.ended = True
                if part.error is None:
                    part.error = error
        for follower, leader in self._followers:  # answered as the part they repeat
            follower.ended, follower.error, follower.pending = True, leader.error, leader.pending
            if leader.answer is not None:
                follower.answer = (leader.answer[0], leader.answer[1], True)
        self._begun.clear()
        self._followers.clear()


class MustWait(trio.WouldBlock):
    """`get_many_nowait` found nothing and the get would wait for an item to arrive."""


class AfterCommit(trio.WouldBlock):
    """`get_many_nowait` found nothing while puts to the queue wait for the pass's commit:
    run the get again after it rather than answer it empty."""


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class BrokerStatistics:
    queues: int  # loaded and parked
    parked: int  # queues parked (queued.broker.parking)
    readers: int  # of loaded queues
    waiters: int
    clients: int  # registered connections
    open_reads: int  # of registered connections
    timeouts: TimeoutHeapStatistics
    counters: tuple[tuple[str, int], ...]  # BrokerCounters' fields, in order
    closing: bool


class Broker:
    """See the module docstring. Create with `queued.broker.upkeep.open_broker`."""

    def __init__(
        self, datadir: DataDir, config: ServerConfig, clock: Callable[[], int] = wall_ms
    ) -> None:
        self.datadir = datadir
        self.clock = clock
        #: where queues send refills and moves; upkeep attaches what runs them
        self.background = Background()
        self.counters = BrokerCounters()
        # Through _now, not `clock` itself: reassigning broker.clock reaches every queue.
        self.registry = Registry(datadir, config, self._now, self.background, self.counters)
        self.queues = self.registry.queues
        self.reads = ReliableReads(self.queues, self.background)
        self.clients = self.reads.clients
        #: deadlines of open reads; upkeep sleeps until the next and calls expire_open_reads
        self.timeouts = self.reads.timeouts
        #: begin_put to durable, per put call (a batch of items is one observation).
        self.put_latency = Histogram(LATENCY_BUCKETS)
        #: Call to answer, per get that did not wait for an item to arrive.
        self.get_latency = Histogram(LATENCY_BUCKETS)
        self.start_time = time.time()
        self._pause_lock = trio.Lock()  # (set_paused)

    def _now(self) -> int:
        return self.clock()

    @property
    def config(self) -> ServerConfig:
        return self.registry.config

    @property
    def closing(self) -> bool:
        """Shutting down: no new queues, waiting gets answered empty, no new waits."""
        return self.registry.closing

    async def load(self) -> None:
        """Build every recovered queue's readers from their durable checkpoints."""
        await self.registry.load()

    # -- put ------------------------------------------------------------------------------------

    async def put(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
    ) -> int:
        """Journal `datas`; returns once durable under the queue's fsync policy.

        `expire_ms` is absolute unix milliseconds; `flags` are the items' memcache
        flags (u32); `delay_ms` > 0 keeps the items invisible that long; `producer` and
        `sequence`: an exactly-once put (a repeat stores nothing and returns 0);
        `headers`: each item's headers block (queued.journal.headers; b"": none); `key`: a
        deduplication key (a put whose key was stored within the queue's dedup_window
        stores nothing and returns 0). Raises
        QueueFullError, ItemTooLargeError, JournalError (write failures, journal full),
        ProducerGapError, ValueError.
        """
        self.counters.cmd_set += 1
        entry = await self.begin_put(queue, datas, expire_ms=expire_ms, error_count=error_count,
                                     flags=flags, delay_ms=delay_ms, producer=producer,
                                     sequence=sequence, headers=headers, key=key)
        # Shielded: the readers must hear about every durable put, in id order,
        # even if the caller is cancelled. The wait is one writer round.
        with trio.CancelScope(shield=True):
            n = await self.end_put(entry)
        return n

    async def begin_put(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
    ) -> PendingPut:
        """First half of `put`: checks, limits, ids; hands the items to the writer.
        With a `producer` (exactly-once puts), see `QueueState.begin_put`: a repeat of
        its last put stores nothing (`PendingPut.answer`), a gap raises ProducerGapError.
        With a deduplication `key`, likewise a put whose key is in the window (no gap).

        Every PendingPut must be passed to `end_put`. A session begins each put of
        a pipelined batch before ending any, so they share one write and one fsync.
        Does not yield unless the queue is full (discard_old, read-behind) or near
        max_journal_size.
        """
        started = time.perf_counter()
        pending = await self.registry.queue(queue).begin_put(
            datas, expire_ms=expire_ms, error_count=error_count, flags=flags, delay_ms=delay_ms,
            producer=producer, sequence=sequence, headers=headers, key=key)
        pending.started = started
        return pending

    def begin_put_nowait(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
        keys: Sequence[tuple[int, int, bytes]] = (),
    ) -> PendingPut:
        """`begin_put` that never waits: trio.WouldBlock (nothing changed) when the
        queue must make room first (a parked queue loads here, synchronously). `keys`:
        see `QueueState.begin_put_nowait` (JoinedPuts)."""
        started = time.perf_counter()
        pending = self.registry.queue(queue).begin_put_nowait(
            datas, expire_ms=expire_ms, error_count=0, flags=flags, delay_ms=delay_ms,
            producer=producer, sequence=sequence, headers=headers, key=key, keys=keys)
        pending.started = started
        return pending

    def end_put_nowait(self, pending: PendingPut, puts: int = 1) -> int:
        """`end_put` once the put's write is done (its ticket set); `puts`: how many
        puts it stands for (joined: each is one observation of the put latency)."""
        n = pending.qs.end_put_nowait(pending)
        if pending.ticket is not None:
            self.counters.total_items += n
            self.put_latency.observe(time.perf_counter() - pending.started, puts)
        return n

    async def end_put(self, pending: PendingPut) -> int:
        """Second half of `put`: wait until durable; returns the number of items.

        Call it inside a shielded cancel scope: if it were cancelled, the queue
        would never hand this put, or any later one, to its readers.
        """
        n = await pending.qs.end_put(pending)
        if pending.ticket is not None:
            self.counters.total_items += n
            self.put_latency.observe(time.perf_counter() - pending.started)
        return n

    # -- get --------------------------------------------------------------------------------------

    async def get(
        self,
        queue: str,
        reader: str | None = None,
        *,
        timeout_ms: int = 0,
        client: OpenReads | None = None,
        open: bool = False,
        peek: bool = False,
        open_timeout_ms: int | None = None,
    ) -> Item | None:
        """The next item, waiting up to `timeout_ms` (FIFO among waiters).

        `open` makes it a reliable read owned by `client`, returned to the queue after
        `open_timeout_ms` (None: the queue's open_transaction_timeout; 0: never) unless
        confirmed; `peek` leaves it in place. Raises ReadStateError past the client's
        open-read limit.
        """
        started = time.perf_counter()
        if peek:
            self.counters.cmd_peek += 1
        else:
            self.counters.cmd_get += 1
        qs = self.registry.queue(queue)
        rname = reader or ""
        h = qs.readers.get(rname) or await self.registry.live_reader(qs, rname)
        if open:
            self.reads.room(client, self.config.max_open_reads)
        owner = client if open else None
        deadline = trio.current_time() + timeout_ms / 1000
        while True:
            expired: list[Item] = []
            now = self.clock()
            if peek:
                it = h.reader.peek(now, expired)
            elif qs.paused:
                break  # (a long poll waits for `resume`)
            else:
                it = h.reader.take(now, expired)
            qs.dispose_expired(h, expired)
            if it is not None:
                if not peek:
                    h.reader.hold(it)  # until _finish_get
                    it = self._finish_get(qs, h, rname, it, owner, open_timeout_ms)
                self.counters.get_hits += 1
                if h.reader.wants_refill():
                    self.background.start_refill(qs, h)
                self.get_latency.observe(time.perf_counter() - started)
                return it
            fetch = h.reader.wants_fetch()  # (a due item whose data is on disk)
            if (h.reader.behind is None and not fetch) or h.closed:
                break
            await (qs.fetch_once(h) if fetch else qs.refill_once(h))
        if timeout_ms <= 0 or h.closed or self.closing:
            self.counters.get_misses += 1
            self.get_latency.observe(time.perf_counter() - started)
            return None
        it = await qs.wait(h, peek=peek, deadline=deadline)
        if it is None:
            self.counters.get_misses += 1
        elif not peek:
            it = self._finish_get(qs, h, rname, it, owner, open_timeout_ms)
            self.counters.get_hits += 1
        return it

    def _finish_get(
        self, qs: QueueState, h: LiveReader, rname: str, it: Item, client: OpenReads | None,
        open_timeout_ms: int | None = None,
    ) -> Item | None:
        """A held item becomes the client's open read (under the name the client used),
        or is consumed. None if the queue or reader was deleted meanwhile."""
        done = self._finish_many(qs, h, rname, [it], client, open_timeout_ms)
        return done[0] if done else None

    def _finish_many(
        self, qs: QueueState, h: LiveReader, rname: str, items: list[Item],
        client: OpenReads | None, open_timeout_ms: int | None,
    ) -> list[Item]:
        if client is None:
            confirm = h.reader.confirm
            for it in items:
                confirm(it.id)
            return items
        return self.reads.open(qs, h, rname, items, client, open_timeout_ms)

    async def get_many(
        self,
        queue: str,
        reader: str | None = None,
        max_items: int = 1,
        *,
        timeout_ms: int = 0,
        client: OpenReads | None = None,
        open: bool = False,
        open_timeout_ms: int | None = None,
        max_bytes: int = 0,
        separate: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> list[Item]:
        """Up to `max_items` items: those there now, or, if none, the first to arrive
        within `timeout_ms` plus whatever else is there by then.

        Stops adding items once `max_bytes` (0 = no cap) of data is reached (one item
        at least). `open`, `client`, `open_timeout_ms` as in `get`; with `open` the
        batch is cut to the client's remaining open-read allowance. Under
        `nursery.start`, it reports started when it answers or begins to wait, so a
        session can go on with later requests while it waits. `separate`: the call
        stands for `max_items` gets of one item each (pipelined, run together): the
        counters count them so.
        """
        started = time.perf_counter()
        qs = self.registry.queue(queue)
        rname = reader or ""
        h = qs.readers.get(rname) or await self.registry.live_reader(qs, rname)
        if open:
            max_items = min(max_items, self.reads.room(client, self.config.max_open_reads))
        owner = client if open else None
        taken = await qs.take_now(h, max_items, max_bytes)
        if taken or timeout_ms <= 0 or h.closed or self.closing:
            counters = self.counters
            counters.get_hits += len(taken)
            if separate:
                counters.cmd_get += max_items
                counters.get_misses += max_items - len(taken)
            else:
                counters.cmd_get += 1
                counters.get_misses += not taken
            task_status.started()
            done = self._finish_many(qs, h, rname, taken, owner, open_timeout_ms)
            self.get_latency.observe(time.perf_counter() - started)
            return done
        task_status.started()
        first = await self.get(queue, reader, timeout_ms=timeout_ms, client=client, open=open,
                               open_timeout_ms=open_timeout_ms)
        if first is None or max_items == 1 or h.closed or qs.deleted:
            return [] if first is None else [first]
        more = await qs.take_now(h, max_items - 1,
                                 max(1, max_bytes - len(first.data)) if max_bytes else 0)
        self.counters.get_hits += len(more)
        return [first, *self._finish_many(qs, h, rname, more, owner, open_timeout_ms)]

    def get_many_nowait(
        self,
        queue: str,
        reader: str | None = None,
        max_items: int = 1,
        *,
        wait: bool = False,
        client: OpenReads | None = None,
        open: bool = False,
        open_timeout_ms: int | None = None,
        max_bytes: int = 0,
        separate: bool = False,
        defer: JoinedPuts | None = None,
        partial: bool = False,
    ) -> list[Item]:
        """`get_many` of what is in memory now: trio.WouldBlock (nothing taken) when it
        would have to wait: for a reader not made yet, for items to be read back from
        disk, or (`wait`: the get has a timeout) for an item to arrive. `separate` (the
        call stands for `max_items` gets of one item) with `max_bytes`: the gets past the
        bytes are not counted (the caller asks again for them). `defer` (the pass's
        joined puts): AfterCommit rather than nothing when puts to the queue are in the
        pass, begun or joined, and not yet ended. `partial` with `separate`: only the
        gets that took an item are counted (the caller asks again for the rest)."""
        started = time.perf_counter()
        qs = self.registry.queue(queue)
        rname = reader or ""
        h = qs.readers.get(rname)
        if h is None:
            raise trio.WouldBlock  # made durably, in `registry.live_reader`
        consumed = not open and max_items == 1  # (a plain get of one: consumed as taken)
        if open:
            max_items = min(max_items, self.reads.room(client, self.config.max_open_reads))
            taken = qs.take_nowait(h, max_items, max_bytes)
        elif consumed:
            it = qs.take_one_nowait(h)
            taken = [] if it is None else [it]
        else:
            taken = qs.take_nowait(h, max_items, max_bytes)
        if not taken and not (h.closed or self.closing):
            if wait:
                raise MustWait
            if defer is not None and self.puts_pending(queue, defer):
                raise AfterCommit
        counters = self.counters
        counters.get_hits += len(taken)
        if separate:
            if partial or (max_bytes and sum([len(it.data) for it in taken]) >= max_bytes):
                max_items = len(taken)  # cut short: the rest are asked again, later
            counters.cmd_get += max_items
            counters.get_misses += max_items - len(taken)
        else:
            counters.cmd_get += 1
            counters.get_misses += not taken
        if not consumed:
            taken = self._finish_many(qs, h, rname, taken, client if open else None,
                                      open_timeout_ms)
        self.get_latency.observe(time.perf_counter() - started)
        return taken

    def line_up(self, queue: str, reader: str | None, wake: Wake,
                ) -> tuple[QueueState, LiveReader, Waiter]:
        """A get that waits without a task of its own (the reactor's long poll): in line
        with the other waiters of the reader, woken through `wake` when `serve` hands
        it an item (held for it) or the reader closes; then `end_wait`. Call it right
        after `get_many_nowait` raised MustWait for the same reader."""
        qs = self.registry.queue(queue)
        h = qs.readers[reader or ""]
        self.counters.cmd_get += 1
        return qs, h, qs.line_up(h, False, wake)

    def end_wait(self, qs: QueueState, h: LiveReader, rname: str, w: Waiter, *,
                 client: OpenReads | None, open_timeout_ms: int | None,
                 take: bool = True) -> Item | None:
        """A lined-up get ends: the item it was handed (as a get's: consumed, or open
        for `client`), or None: none came, or `take` is False (the peer left, time is
        up); a handed item then goes back unharmed."""
        if not take or w.item is None:
            qs.leave_line(h, w)
            self.counters.get_misses += 1
            return None
        it = self._finish_get(qs, h, rname, w.item, client, open_timeout_ms)
        self.counters.get_hits += 1
        return it

    def puts_pending(self, queue: str, joined: JoinedPuts) -> bool:
        """Puts to `queue` are in the reactor's pass (joined, or begun and not ended)."""
        qs = self.registry.queues.get(queue)
        return joined.has(queue) or (qs is not None and bool(qs.inflight))

    def take_more(self, qs: QueueState, h: LiveReader, rname: str, max_items: int, max_bytes: int,
                  nbytes: int, *, client: OpenReads | None,
                  open_timeout_ms: int | None) -> list[Item]:
        """After a waited get's first item: whatever more is in memory now (as
        `get_many` takes after its wait), up to `max_items` and `max_bytes` in all with
        the first's `nbytes`; nothing read back from disk."""
        if h.closed or qs.deleted:
            return []
        if client is not None:
            max_items = min(max_items, self.reads.room(client, self.config.max_open_reads))
        try:
            more = qs.take_nowait(h, max_items, max(1, max_bytes - nbytes) if max_bytes else 0)
        except trio.WouldBlock:
            return []
        self.counters.get_hits += len(more)
        return self._finish_many(qs, h, rname, more, client, open_timeout_ms)

    # -- reliable reads ---------------------------------------------------------------------

    def register(self, client: OpenReads) -> OpenReads:
        return self.reads.register(client)

    def release(self, client: OpenReads, *, count_error: bool = True,
                owe: Owe | None = None) -> None:
        """The client is gone: every open read goes back to the head of its queue. The
        error counts are journaled like an abort's, in the next writer round; nobody
        waits for them (a connection that hung up has no reply to hold back), but `owe`
        gets their tickets (the power-loss tests wait for them)."""
        self.reads.release(client, count_error=count_error, owe=owe)

    def confirm(
        self,
        client: OpenReads,
        queue: str,
        reader: str | None = None,
        count: int | None = None,
        ids: Sequence[int] | None = None,
        *,
        owe: Owe | None = None,
        journal: bool = True,
    ) -> int:
        """Confirm the client's open reads on queue/reader: `ids`, the `count` oldest, or all.

        The confirms are appended to the reader's file in the next writer round (one
        append and, under fsync "always", one fsync per reader per round, shared with
        every confirm of that round); `owe` gets the ticket that is set once they are
        durable: acknowledge the confirm only then. `journal=False` for an open read that
        stands for a plain get (a plain get is consumed at the next checkpoint).
        """
        return self.reads.confirm(client, queue, reader or "", count, ids, owe,
                                  journal=journal)

    def defer_writes(self, on: bool) -> None:
        """While on, journal changes wait for `commit_now` (one write per file for a
        whole pass) instead of being written as they are planned."""
        self.datadir.deferring = on

    def commit_now(self) -> bool:
        """Every planned journal change written and synced by policy, here and now
        (the reactor's pass); False, nothing done, while a writer round is under way."""
        return self.datadir.commit_now()

    async def wait_round(self) -> None:
        """Until no writer round is under way (then `commit_now` can run)."""
        await self.datadir.wait_round()

    def write_ready(self) -> None:
        """Write now the journal changes that need no fsync (confirms under fsync never or
        <ms>): a connection calls it before it waits for what its batch owes."""
        self.datadir.write_ready()

    def abort(
        self,
        client: OpenReads,
        queue: str,
        reader: str | None = None,
        count: int | None = None,
        ids: Sequence[int] | None = None,
        *,
        count_error: bool = True,
        owe: Owe | None = None,
        delay_ms: int = 0,
    ) -> int:
        """Return the client's open reads on queue/reader to the head of the queue (or,
        with `delay_ms` > 0, make them wait that long first); the error counts and due
        times they get are journaled like confirms (`owe`: the ticket)."""
        return self.reads.abort(client, queue, reader or "", count, ids,
                                count_error=count_error, owe=owe, delay_ms=delay_ms)

    def extend(self, client: OpenReads, queue: str, reader: str | None,
               ids: Sequence[int] | None, ms: int) -> int:
        """Move the timeout of the client's open reads on queue/reader (`ids`, else all)
        to `ms` from now (0: none); how many. NotOpenError for an id it does not hold."""
        return self.reads.extend(client, queue, reader or "", ids, ms, trio.current_time())

    def reject(self, client: OpenReads, queue: str, reader: str | None,
               ids: Sequence[int] | None, *, owe: Owe | None = None) -> int:
        """Give up on the client's open reads on queue/reader (`ids`, else all): to the
        reader's error_queue at once, or dropped (journaled as a confirm; `owe` gets the
        ticket); how many. NotOpenError for an id it does not hold."""
        return self.reads.reject(client, queue, reader or "", ids, owe)

    # -- pause, move, browse ----------------------------------------------------------------

    @property
    def paused(self) -> frozenset[str]:
        """The paused queues, loaded or parked."""
        return frozenset(self.registry.paused)

    async def set_paused(self, queue: str, on: bool) -> bool:
        """Pause (`on`) or resume `queue`, durably before it returns; whether that
        changed anything. Resuming serves the gets that waited meanwhile."""
        if not jf.valid_name(queue):
            raise BadNameError(f"invalid queue name {queue!r}")
        async with self._pause_lock:  # one write at a time, each of the whole list
            paused = self.registry.paused
            if (queue in paused) == on:
                return False
            await self.datadir.save_paused(paused | {queue} if on else paused - {queue})
            if on:
                paused.add(queue)
            else:
                paused.discard(queue)
        qs = self.queues.get(queue)
        if qs is not None:
            qs.paused = on
            if not on:
                for h in list(qs.readers.values()):
                    qs.serve(h)
        log.info("queue %s: %s", queue, "paused" if on else "resumed")
        return True

    async def move(self, source: str, reader: str | None, destination: str, max_items: int = 0,
                   rate: int = 0) -> int:
        """Move up to `max_items` (0: until the source has none) of source's items, in
        delivery order, to `destination`, at most `rate` a second (0: no limit); how
        many. One at a time: each is durable in the destination (keeping its error count,
        flags and headers) before its removal from the source is journaled, and that removal is
        durable before the next starts, so a crash duplicates at most the item in
        flight and loses nothing. Works on a paused source (its consumers stay off)."""
        if destination == source:
            raise ValueError("move: the destination is the source")
        if not jf.valid_name(destination):
            raise BadNameError(f"invalid queue name {destination!r}")
        qs = self.registry.queue(source)
        rname = reader or ""
        h = qs.readers.get(rname) or await self.registry.live_reader(qs, rname)
        interval = 1 / rate if rate else 0.0
        next_at = trio.current_time()
        moved = 0
        while (not max_items or moved < max_items) and not (self.closing or qs.deleted):
            taken = await qs.take_now(h, 1, 0, even_paused=True)
            if not taken:
                break
            it = taken[0]
            del h.reader.open[it.id]  # held -> moving (an open read of nobody's)
            h.reader.start_move(it)
            try:
                await self.put(destination, [it.data], error_count=it.error_count,
                               flags=it.flags, headers=[it.headers] if it.headers else None)
            except BaseException:
                qs.finish_move(h, [it], moved=False, keep_errors=True)
                raise
            h.reader.end_move(it.id, moved=True)
            ticket = qs.note_read(h, done=[it.id])
            moved += 1
            self.counters.moved += 1
            if ticket is not None:
                with trio.CancelScope(shield=True):
                    await ticket.event.wait()
                if ticket.error is not None:
                    raise ticket.error
            if interval:
                next_at += interval
                await trio.sleep_until(next_at)
        log.info("moved %d items from %s to %s", moved, source, destination)
        return moved

    async def browse(self, queue: str, reader: str | None, after_id: int, n: int) -> list[Item]:
        """Up to `n` items of an existing reader in delivery order, after the item
        `after_id` (0: from the head; an id no longer there: the items after it by id),
        without taking them: those in memory, then those on disk (read in a worker
        thread). Each carries its error count."""
        found = self.registry.find(queue, reader)
        if found is None or n <= 0:
            return []
        qs, h = found
        r = h.reader
        now = self.clock()
        out = r.browse(now, after_id, n)
        if len(out) < n and r.behind is not None:
            start = max(r.behind, after_id + 1, out[-1].id + 1 if out else 0)
            skip = frozenset(r.done) | frozenset(r.delays)
            errors = dict(r.errors)
            more = await trio.to_thread.run_sync(
                read_live, qs.journal, start, r.tail, n - len(out), skip, now)
            out += [dataclasses.replace(it, error_count=errors[it.id])
                    if it.id in errors else it for it in more]
        return out

    def next_due_ms(self) -> int | None:
        """When the next delayed item of any reader falls due (unix ms), if any."""
        return min((d for qs in self.queues.values() for h in qs.readers.values()
                    if (d := h.reader.next_due_ms()) is not None), default=None)

    def promote_due(self) -> int:
        """Delayed items now due join their readers' due items; waiting gets are served."""
        now = self.clock()
        n = 0
        for qs in list(self.queues.values()):
            for h in list(qs.readers.values()):
                due = h.reader.next_due_ms()
                if due is not None and due <= now:
                    n += h.reader.promote(now)
                    qs.serve(h)
        return n

    def expire_open_reads(self, now: float) -> int:
        """Return every open read whose deadline (trio time) is <= now; how many."""
        return self.reads.expire(now)

    # -- flush and delete -------------------------------------------------------------------

    def flush(self, queue: str, reader: str | None = None) -> int:
        found = self.registry.find(queue, reader)
        return found[1].flush() if found is not None else 0

    async def flush_all(self) -> int:
        """Flush every queue; the number of items flushed.

        A parked queue holding items loads to be flushed (and parks again later); an
        empty one only counts the flush in its summary. A load reads files (~0.3 ms,
        ~4 ms at the parking limits), so the loop lets other tasks run after each one:
        a flush_all over thousands of parked queues does not hold the event loop for
        seconds. Queue by queue, as Kestrel's, not one atomic step across queues.
        """
        n = sum(h.flush() for qs in list(self.queues.values()) for h in qs.readers.values())
        registry = self.registry
        for name in list(registry.parked):
            data = registry.parked.get(name)
            if data is None:  # loaded since the loop above (or deleted): flush it there
                loaded = self.queues.get(name)
                n += sum(h.flush() for h in loaded.readers.values()) if loaded else 0
                continue
            p = parking.unpack(data)
            if p.empty:
                for r in p.readers:
                    r.counters.flushes += 1
                registry.parked[name] = parking.pack(p)
                continue
            try:
                qs = registry.unpark(name)
            except JournalError:
                continue  # (logged) the others are flushed all the same
            n += sum(h.flush() for h in qs.readers.values())
            await trio.lowlevel.checkpoint()
        return n

    def flush_expired(self, queue: str, reader: str | None = None) -> int:
        found = self.registry.find(queue, reader)
        return found[0].expire_head(found[1], self.clock(), 0) if found is not None else 0

    def flush_all_expired(self) -> int:
        """Loaded queues only: a parked queue's items expire when it loads."""
        return sum(
            self.flush_expired(q, r)
            for q, qs in list(self.queues.items())
            for r in list(qs.readers)
        )

    async def delete(self, queue: str, reader: str | None = None) -> bool:
        """Delete reader `reader` of `queue`, or the whole queue with every file.

        Deleting a queue's last reader leaves a default reader at the tail (written
        durably), so items put afterwards have a reader before and after a restart.
        """
        qs = self.queues.get(queue)
        if qs is None and queue in self.registry.parked:
            if not reader:
                return await self._delete_parked(queue)
            qs = self.registry.unpark(queue)
        if qs is None:
            return False
        if reader:
            h = qs.readers.pop(reader, None)
            if h is None:
                return False
            self.registry.forget_names()
            h.close()
            self.reads.forget(queue, reader, h)
            await qs.journal.remove_reader(reader)
            if not qs.readers and not qs.deleted:
                await self.registry.live_reader(qs, "")
            return True
        qs.deleted = True
        del self.queues[queue]
        self.registry.forget_names()
        for h in qs.readers.values():
            h.close()
        self.reads.forget(queue, None, None)
        await self.datadir.delete_queue(queue)
        self.counters.queue_deletes += 1
        return True

    async def _delete_parked(self, queue: str) -> bool:
        self.registry.forget_parked(queue)
        await self.datadir.delete_queue(queue, parked=True)
        self.counters.queue_deletes += 1
        return True

    # -- rounds of upkeep (queued.broker.upkeep runs them on timers) ---------------------

    async def checkpoint_all(self, *, force: bool = False) -> int:
        """Write the checkpoint of every reader that consumed something; compact."""
        written = 0
        for qs in list(self.queues.values()):
            written += await qs.write_checkpoints(force=force)
        return written

    async def sweep(self) -> None:
        """Expire items at the head of every loaded reader (a parked queue's expire when
        it loads); delete queues past max_queue_age, parked ones too (idle if empty)."""
        now = self.clock()
        for qs in list(self.queues.values()):
            if self.queues.get(qs.name) is not qs:
                continue  # parked (or deleted) while an earlier queue was being deleted
            for h in list(qs.readers.values()):
                qs.expire_head(h, now, h.config.max_expire_sweep)
            age = qs.config.max_queue_age
            if age and now - qs.create_time_ms > age and qs.idle():
                await self._expire_queue(qs.name)
        cfg = self.config
        if self.registry.parked and (cfg.default.max_queue_age or any(
                "max_queue_age" in section for section in cfg.queues.values())):
            for name, p in self.registry.parked_views():
                age = cfg.queue_config(name).max_queue_age
                if age and now - p.create_time_ms > age and p.empty:
                    await self._expire_queue(name)

    async def _expire_queue(self, name: str) -> None:
        log.info("queue %s: empty and older than max_queue_age, deleting", name)
        await self.delete(name)
        self.counters.queue_expires += 1

    # -- configuration and shutdown ---------------------------------------------------------------

    def wake_waiters(self) -> None:
        """Answer every waiting get as empty (shutdown)."""
        self.registry.closing = True
        for qs in self.queues.values():
            for h in qs.readers.values():
                h.wake_all()

    def reconfigure(self, config: ServerConfig) -> None:
        """Apply reloaded queue configs to every existing queue and reader."""
        self.registry.reconfigure(config)

    async def park_idle(self, now: float) -> int:
        """Park the queues unused for `park_after` among the next slice the parker looks
        at (see Registry.park_idle); how many parked."""
        return await self.registry.park_idle(now, self.config.park_after / 1000)

    async def aclose(self) -> list[str]:
        """Refuse new work, return open reads (no error counted), write every checkpoint
        (parked queues wrote theirs when they parked). Returns what could not be saved,
        one line per reader ([] when all was)."""
        self.wake_waiters()
        for client in list(self.clients.values()):
            self.release(client, count_error=False)
        await self.checkpoint_all(force=True)
        return [f"queue {qs.name}, {f'reader {reader}' if reader else 'default reader'}: "
                f"checkpoint not written ({why}); what it read since its last checkpoint "
                f"will be delivered again"
                for qs in self.queues.values()
                for reader, why in sorted(qs.unsaved_checkpoints.items())]

    # -- statistics ----------------------------------------------------------------------------

    def reader_stats(self, qs: QueueState, h: LiveReader) -> dict[str, int]:
        return qs.reader_stats(h)

    def reader_info(self, queue: str, reader: str | None = None) -> dict[str, int]:
        """reader_stats of one reader, found by any of its names ({} if none)."""
        found = self.registry.find(queue, reader, aliases=True)
        return {} if found is None else found[0].reader_stats(found[1])

    def head_items(self, queue: str, reader: str | None, limit: int) -> list[Item] | None:
        """Up to `limit` items at the head of an existing reader, in delivery order, from
        memory (None if the queue or reader does not exist). Read-only: creates nothing,
        opens nothing, reads nothing back from disk, counts no peek."""
        found = self.registry.find(queue, reader)
        return None if found is None else found[1].reader.first_items(self.clock(), limit)

    def queue_stats(self) -> list[tuple[str, dict[str, int]]]:
        """(`q` or `q+reader`, fields) for every reader, loaded or parked, sorted by name."""
        out = [(f"{qs.name}+{rname}" if rname else qs.name, qs.reader_stats(h))
               for qs, rname, h in self.registry.all_readers()]
        if self.registry.parked:
            now = self.clock()
            out += [(f"{name}+{r.name}" if r.name else name, parking.reader_fields(
                        p, r, now, name in self.registry.paused))
                    for name, p in self.registry.parked_views() for r in p.readers]
            out.sort(key=lambda pair: pair[0])
        return out

    def queue_names(self) -> list[str]:
        """Every queue, loaded or parked, sorted."""
        return sorted([*self.queues, *self.registry.parked])

    def queue_view(self, name: str) -> tuple[list[tuple[str, dict[str, int]]], JournalStats]:
        """(reader, fields) of every reader of queue `name`, sorted, and its journal's
        figures; from the summary if it is parked (it stays parked)."""
        qs = self.queues.get(name)
        if qs is not None:
            return ([(rname, qs.reader_stats(qs.readers[rname])) for rname in sorted(qs.readers)],
                    qs.journal.statistics())
        p = parking.unpack(self.registry.parked[name])
        now = self.clock()
        return [(r.name, parking.reader_fields(p, r, now, name in self.registry.paused))
                for r in p.readers], \
            p.journal_stats(name)

    def reader_count(self, queue: str) -> int:
        """Readers of queue `queue`, loaded or parked (0: no such queue)."""
        qs = self.queues.get(queue)
        if qs is not None:
            return len(qs.readers)
        data = self.registry.parked.get(queue)
        return 0 if data is None else len(parking.unpack(data).readers)

    def has_reader(self, queue: str, reader: str | None) -> bool:
        """Queue `queue` exists (loaded or parked), and its reader `reader` if not None."""
        qs = self.queues.get(queue)
        if qs is not None:
            return reader is None or reader in qs.readers
        data = self.registry.parked.get(queue)
        return data is not None and (
            reader is None or any(r.name == reader for r in parking.unpack(data).readers))

    def held_bytes(self) -> int:
        """Item data the readers hold in memory (read-ahead; not open reads)."""
        return sum(h.reader.mem_bytes for qs in self.queues.values() for h in qs.readers.values())

    def statistics(self) -> BrokerStatistics:
        handles = [h for qs in self.queues.values() for h in qs.readers.values()]
        return BrokerStatistics(
            queues=len(self.queues) + len(self.registry.parked),
            parked=len(self.registry.parked),
            readers=len(handles),
            waiters=sum(len(h.waiters) for h in handles),
            clients=len(self.clients),
            open_reads=sum(c.open_total for c in self.clients.values()),
            timeouts=self.timeouts.statistics(),
            counters=tuple(dataclasses.asdict(self.counters).items()),
            closing=self.closing,
        )
