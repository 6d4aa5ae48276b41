"""The queues of one server: journals, readers, waiters, open reads, background work.

Owns the async half of the queue logic: puts become durable through the data
directory's writer and only then reach readers (in id order) and long-polling
waiters (FIFO); reliable reads belong to an `OpenReads` (one per connection) and go
back to the head of their queue when it leaves; read-behind refills memory from
the journal in a worker thread; background tasks write checkpoints, compact,
sweep expired items and expire open reads. No sockets here: the protocol
sessions call these methods. The per-reader state machine is `queued.core.queue`.

Readers. `q` is reader "" of queue q; `q+name` is reader `name`. A new named
reader starts at the tail (it sees items put after it was created), except the
first named reader of a queue that only has the default reader: it takes over
the default reader's backlog and checkpoint (libkestrel's rule), and a later
plain `q` starts a new default reader at the tail.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from queued.core import journal_format as jf
from queued.core.errors import (
    BadNameError,
    ItemTooLargeError,
    JournalError,
    QueueClosedError,
    QueueFullError,
    ReadStateError,
)
from queued.core.open_reads import OpenReads, TimeoutHeap
from queued.core.queue import Item, Reader
from queued.core.stats import LATENCY_BUCKETS, Histogram
from queued.storage.datadir import DataDir, open_data_dir
from queued.storage.journal import QueueJournal, Ticket, wait_durable
from queued.storage.recovery import SegmentInfo

if TYPE_CHECKING:
    from queued.config import QueueConfig, ServerConfig

log = logging.getLogger("queued.broker")

MiB = 1 << 20
#: Items read back from the journal per worker-thread call, at most.
REFILL_MAX_ITEMS = 50_000


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass(eq=False, slots=True)
class _Waiter:
    peek: bool
    event: trio.Event = field(default_factory=trio.Event)
    item: Item | None = None


@dataclass(eq=False, slots=True)
class _Inflight:
    puts: list[jf.Put]
    nbytes: int = 0  # item data bytes of `puts`
    done: bool = False
    error: BaseException | None = None


@dataclass(eq=False, slots=True)
class PendingPut:
    """A put handed to the writer, not yet known durable (see Broker.begin_put)."""

    qs: QueueState
    entry: _Inflight
    ticket: Ticket | None
    started: float = 0.0  # time.perf_counter() when begin_put was called


class Handle:
    """A reader plus what only the async side needs: waiters, refill lock."""

    def __init__(self, reader: Reader, config: QueueConfig) -> None:
        self.reader = reader
        self.config = config
        self.waiters: deque[_Waiter] = deque()
        self.refill_lock = trio.Lock()
        self.refilling = False
        self.closed = False
        #: earlier names of this reader (the default reader it took over)
        self.aliases: set[str] = set()


class QueueState:
    def __init__(self, name: str, journal: QueueJournal, config: QueueConfig, now_ms: int) -> None:
        self.name = name
        self.journal = journal
        self.config = config
        self.readers: dict[str, Handle] = {}
        self.inflight: deque[_Inflight] = deque()
        self.inflight_items = 0
        self.inflight_bytes = 0
        self.delivered = journal.last_id  # highest id handed to the readers
        self.create_time_ms = now_ms
        self.reader_lock = trio.Lock()
        self.deleted = False


@dataclass(slots=True)
class BrokerCounters:
    cmd_get: int = 0
    cmd_set: int = 0
    cmd_peek: int = 0
    get_hits: int = 0
    get_misses: int = 0
    total_items: int = 0
    queue_creates: int = 0
    queue_deletes: int = 0
    queue_expires: int = 0


class Broker:
    """See the module docstring. Create with `open_broker`."""

    def __init__(
        self, datadir: DataDir, config: ServerConfig, clock: Callable[[], int] = wall_ms
    ) -> None:
        self.datadir = datadir
        self.config = config
        self.clock = clock
        self.queues: dict[str, QueueState] = {}
        self.clients: dict[int, OpenReads] = {}
        self.counters = BrokerCounters()
        #: begin_put to durable, per put call (a batch of items is one observation).
        self.put_latency = Histogram(LATENCY_BUCKETS)
        #: Call to answer, per get that did not wait for an item to arrive.
        self.get_latency = Histogram(LATENCY_BUCKETS)
        self.start_time = time.time()
        self.closing = False
        self._nursery: trio.Nursery | None = None
        self.timeouts = TimeoutHeap()
        self._timeout_wake = trio.Event()

    # -- startup ------------------------------------------------------------------------

    async def load(self) -> None:
        """Build every recovered queue's readers from their durable checkpoints."""
        started = time.monotonic()
        for name, journal in sorted(self.datadir.queues.items()):
            qs = self._new_queue_state(name, journal)
            for rname, cp in sorted(journal.readers.items()):
                cfg = self._reader_config(name, rname)
                reader = Reader(name, rname, cfg, head=cp.head, done=cp.done,
                                tail=journal.last_id, create_time_ms=qs.create_time_ms)
                count, nbytes = await trio.to_thread.run_sync(
                    _count_unconsumed, journal, cp.head, frozenset(cp.done)
                )
                # Everything starts on disk; read-behind fills memory once running.
                reader.restore([], cp.head + 1 if count else None, count, nbytes)
                qs.readers[rname] = Handle(reader, cfg)
                log.info("queue %s%s: %d items (%d bytes) recovered", name,
                         f"+{rname}" if rname else "", count, nbytes)
        if self.queues:
            log.info("loaded %d queues in %.3f s", len(self.queues), time.monotonic() - started)

    def _new_queue_state(self, name: str, journal: QueueJournal) -> QueueState:
        qs = QueueState(name, journal, self.config.queue_config(name), self.clock())
        journal.before_drop = partial(self._before_drop, qs)
        self.queues[name] = qs
        return qs

    def _reader_config(self, queue: str, reader: str) -> QueueConfig:
        if reader:
            return self.config.reader_config(queue, reader)
        return self.config.queue_config(queue)

    # -- queues and readers ------------------------------------------------------------------

    def _queue(self, name: str) -> QueueState:
        qs = self.queues.get(name)
        if qs is None:
            if self.closing:
                raise QueueClosedError("server is shutting down")
            if not jf.valid_name(name):
                raise BadNameError(f"invalid queue name {name!r}")
            if not jf.names_fit(name) or not jf.names_fit(name, ""):
                raise BadNameError(
                    f"queue name of {len(name)} characters is too long for its journal file "
                    f"names ({jf.NAME_MAX} bytes at most)"
                )
            qs = self._new_queue_state(name, self.datadir.queue(name))
            cfg = qs.config
            qs.readers[""] = Handle(
                Reader(name, "", cfg, tail=qs.journal.last_id, create_time_ms=qs.create_time_ms),
                cfg,
            )
            self.counters.queue_creates += 1
        return qs

    async def _handle(self, qs: QueueState, name: str) -> Handle:
        h = qs.readers.get(name)
        if h is not None:
            return h
        if name and not jf.valid_name(name):
            raise BadNameError(f"invalid reader name {name!r}")
        if not jf.names_fit(qs.name, name):
            raise BadNameError(
                f"queue and reader names together are too long for a checkpoint file name "
                f"({jf.NAME_MAX} bytes at most)"
            )
        async with qs.reader_lock:
            h = qs.readers.get(name)
            if h is not None:
                return h
            if qs.deleted:
                raise QueueClosedError(f"queue {qs.name!r} was deleted")
            if name and set(qs.readers) == {""}:
                # The first named reader takes over the default reader's backlog.
                # Shielded: both files must change, or neither (a shutdown may cancel).
                with trio.CancelScope(shield=True):
                    taken = qs.readers[""]
                    head, done = taken.reader.checkpoint()
                    await qs.journal.write_checkpoint(name, head, done)
                    await qs.journal.remove_reader("")
                    del qs.readers[""]
                    taken.reader.name = name
                    taken.config = self._reader_config(qs.name, name)
                    taken.reader.limits = taken.config
                    taken.aliases.add("")  # open reads taken as `q` are still confirmed as `q`
                    qs.readers[name] = taken
                log.info("queue %s: reader %r took over the default reader", qs.name, name)
                return taken
            cfg = self._reader_config(qs.name, name)
            start = qs.delivered
            reader = Reader(qs.name, name, cfg, head=start, tail=start,
                            create_time_ms=self.clock())
            h = Handle(reader, cfg)
            # Registered first, so puts delivered while its checkpoint is written reach
            # it; durable before it serves, so compaction keeps what it will need.
            qs.readers[name] = h
            try:
                with trio.CancelScope(shield=True):
                    await qs.journal.write_checkpoint(name, start)
            except BaseException:
                qs.readers.pop(name, None)
                raise
            if qs.deleted:
                raise QueueClosedError(f"queue {qs.name!r} was deleted")
            log.info("queue %s: new reader %r starts at id %d", qs.name, name, start)
            return h

    # -- put ------------------------------------------------------------------------------------

    async def put(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        error_count: int = 0,
    ) -> int:
        """Journal `datas`; returns once durable under the queue's fsync policy.

        `expire_ms` is absolute unix milliseconds. Raises QueueFullError,
        ItemTooLargeError, JournalError (write failures, journal full), ValueError.
        """
        self.counters.cmd_set += 1
        entry = await self.begin_put(queue, datas, expire_ms=expire_ms, error_count=error_count)
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
    ) -> PendingPut:
        """First half of `put`: checks, limits, ids; hands the items to the writer.

        Every PendingPut must be passed to `end_put`. A session begins each put of
        a pipelined batch before ending any, so they share one write and one fsync.
        Does not yield unless the queue is full (discard_old, read-behind) or near
        max_journal_size.
        """
        started = time.perf_counter()
        qs = self._queue(queue)
        cfg = qs.config
        if not datas:
            return PendingPut(qs, _Inflight([], done=True), None)
        if cfg.max_item_size and max(map(len, datas)) > cfg.max_item_size:
            raise ItemTooLargeError(
                f"item over max_item_size ({cfg.max_item_size} bytes) of queue {queue!r}"
            )
        now = self.clock()
        if cfg.max_age:
            cap = now + cfg.max_age
            expire_ms = cap if expire_ms is None else min(expire_ms, cap)
        n, nbytes = len(datas), sum(map(len, datas))
        if cfg.max_items or cfg.max_size or self._limited(qs):
            await self._make_room(qs, n, nbytes)
        if qs.journal.config.max_journal_size:
            await qs.journal.make_room(nbytes + jf.PUT_EXPIRE_HEADER_SIZE * n)
        if qs.deleted:
            raise QueueClosedError(f"queue {queue!r} was deleted")
        puts, ticket = qs.journal.append_nowait(datas, now, expire_ms, error_count)
        entry = _Inflight(puts, nbytes)
        qs.inflight.append(entry)
        qs.inflight_items += n
        qs.inflight_bytes += nbytes
        return PendingPut(qs, entry, ticket, started)

    async def end_put(self, pending: PendingPut) -> int:
        """Second half of `put`: wait until durable; returns the number of items.

        Call it inside a shielded cancel scope: if it were cancelled, the queue
        would never hand this put, or any later one, to its readers.
        """
        qs, entry, ticket = pending.qs, pending.entry, pending.ticket
        if ticket is None:
            return 0
        n, nbytes = len(entry.puts), entry.nbytes
        try:
            await wait_durable(ticket)
        except Exception as exc:
            entry.error = exc
        entry.done = True
        qs.inflight_items -= n
        qs.inflight_bytes -= nbytes
        self._drain(qs)
        if entry.error is not None:
            raise entry.error
        self.counters.total_items += n
        self.put_latency.observe(time.perf_counter() - pending.started)
        return n

    def _limited(self, qs: QueueState) -> bool:
        return any(h.config.max_items or h.config.max_size for h in qs.readers.values())

    async def _make_room(self, qs: QueueState, n: int, nbytes: int) -> None:
        for h in list(qs.readers.values()):
            r = h.reader
            while r.over_limits(n + qs.inflight_items, nbytes + qs.inflight_bytes):
                if not h.config.discard_old_when_full:
                    raise QueueFullError(f"queue {qs.name!r} is full")
                if r.discard_oldest() is None:
                    if r.behind is not None and not h.closed:
                        await self._refill_once(qs, h)
                        continue
                    raise QueueFullError(f"queue {qs.name!r} cannot hold {n} items")

    def _drain(self, qs: QueueState) -> None:
        """Hand durable puts to the readers in id order."""
        while qs.inflight and qs.inflight[0].done:
            entry = qs.inflight.popleft()
            if entry.error is not None or qs.deleted:
                continue
            qs.delivered = entry.puts[-1].id
            for h in list(qs.readers.values()):
                h.reader.add(entry.puts)
                self._serve(qs, h)

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
        qs = self._queue(queue)
        rname = reader or ""
        h = await self._handle(qs, rname)
        if open:
            self._open_room(client)
        deadline = trio.current_time() + timeout_ms / 1000
        while True:
            expired: list[Item] = []
            it = h.reader.peek(self.clock(), expired) if peek else h.reader.take(
                self.clock(), expired)
            self._dispose_expired(qs, h, expired)
            if it is not None:
                if not peek:
                    h.reader.hold(it)  # until _finish_get
                    it = self._finish_get(qs, h, rname, it, client if open else None,
                                          open_timeout_ms)
                self.counters.get_hits += 1
                if h.reader.wants_refill():
                    self._start_refill(qs, h)
                self.get_latency.observe(time.perf_counter() - started)
                return it
            if h.reader.behind is None or h.closed:
                break
            await self._refill_once(qs, h)
        if timeout_ms <= 0 or h.closed or self.closing:
            self.counters.get_misses += 1
            self.get_latency.observe(time.perf_counter() - started)
            return None
        w = _Waiter(peek)
        h.waiters.append(w)
        finished = False
        try:
            with trio.move_on_at(deadline):
                await w.event.wait()
            if w.item is not None and not peek:
                got = self._finish_get(qs, h, rname, w.item, client if open else None,
                                       open_timeout_ms)
                finished = True
                self.counters.get_hits += 1
                return got
            finished = True
            if w.item is None:
                self.counters.get_misses += 1
            return w.item
        finally:
            if w.item is None:
                with suppress(ValueError):
                    h.waiters.remove(w)
            elif not (finished or peek) and h.reader.abort(w.item.id, count_error=False):
                # Cancelled after an item was handed over: it goes back, unharmed.
                h.reader.counters.canceled_transactions -= 1
                h.reader.put_back(w.item)
                self._serve(qs, h)

    def _open_room(self, client: OpenReads | None) -> int:
        """How many more open reads `client` may take (at least 1), or ReadStateError."""
        if client is None:
            raise ValueError("an open read needs a client")
        room = self.config.max_open_reads - client.open_total
        if room <= 0:
            raise ReadStateError(
                f"too many open reads on this connection (max {self.config.max_open_reads})"
            )
        return room

    def _finish_get(
        self, qs: QueueState, h: Handle, rname: str, it: Item, client: OpenReads | None,
        open_timeout_ms: int | None = None,
    ) -> Item | None:
        """A held item becomes the client's open read (under the name the client used),
        or is consumed. None if the queue or reader was deleted meanwhile."""
        done = self._finish_many(qs, h, rname, [it], client, open_timeout_ms)
        return done[0] if done else None

    def _finish_many(
        self, qs: QueueState, h: Handle, rname: str, items: list[Item], client: OpenReads | None,
        open_timeout_ms: int | None,
    ) -> list[Item]:
        if client is None:
            confirm = h.reader.confirm
            for it in items:
                confirm(it.id)
            return items
        if h.closed or qs.deleted:
            return []  # deleted with its queue: there is nothing left to confirm
        h.reader.counters.transactions += len(items)
        timeout = (h.config.open_transaction_timeout if open_timeout_ms is None
                   else open_timeout_ms)
        deadline = trio.current_time() + timeout / 1000 if timeout else None
        for it in items:
            client.add(qs.name, rname, it.id, deadline)  # the held item stays open
        if deadline is not None and self.timeouts.push(
            deadline, client, qs.name, rname, [it.id for it in items]
        ):
            self._timeout_wake.set()
        return items

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
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> list[Item]:
        """Up to `max_items` items: those there now, or, if none, the first to arrive
        within `timeout_ms` plus whatever else is there by then.

        Stops adding items once `max_bytes` (0 = no cap) of data is reached (one item
        at least). `open`, `client`, `open_timeout_ms` as in `get`; with `open` the
        batch is cut to the client's remaining open-read allowance. Under
        `nursery.start`, it reports started when it answers or begins to wait, so a
        session can go on with later requests while it waits.
        """
        started = time.perf_counter()
        qs = self._queue(queue)
        rname = reader or ""
        h = await self._handle(qs, rname)
        if open:
            max_items = min(max_items, self._open_room(client))
        owner = client if open else None
        taken = await self._take_now(qs, h, max_items, max_bytes)
        if taken or timeout_ms <= 0 or h.closed or self.closing:
            self.counters.cmd_get += 1
            if taken:
                self.counters.get_hits += len(taken)
            else:
                self.counters.get_misses += 1
            task_status.started()
            done = self._finish_many(qs, h, rname, taken, owner, open_timeout_ms)
            self.get_latency.observe(time.perf_counter() - started)
            return done
        task_status.started()
        first = await self.get(queue, reader, timeout_ms=timeout_ms, client=client, open=open,
                               open_timeout_ms=open_timeout_ms)
        if first is None or max_items == 1 or h.closed or qs.deleted:
            return [] if first is None else [first]
        more = await self._take_now(qs, h, max_items - 1,
                                    max(1, max_bytes - len(first.data)) if max_bytes else 0)
        self.counters.get_hits += len(more)
        return [first, *self._finish_many(qs, h, rname, more, owner, open_timeout_ms)]

    async def _take_now(self, qs: QueueState, h: Handle, max_items: int,
                        max_bytes: int) -> list[Item]:
        """Items available now (read back from disk if need be), each held by `hold`."""
        r = h.reader
        out: list[Item] = []
        nbytes = 0
        expired: list[Item] = []
        now = self.clock()
        try:
            while len(out) < max_items and not (max_bytes and nbytes >= max_bytes):
                it = r.take(now, expired)
                if it is None:
                    if expired:
                        self._dispose_expired(qs, h, expired)
                        expired = []
                    if r.behind is None or h.closed:
                        break
                    try:
                        await self._refill_once(qs, h)
                    except JournalError:
                        if out:
                            break  # serve what we have; the next get reports it
                        raise
                    now = self.clock()
                    continue
                r.hold(it)
                out.append(it)
                nbytes += len(it.data)
        except BaseException:
            for it in reversed(out):  # cancelled while reading back: put them back unharmed
                if r.abort(it.id, count_error=False) is not None:
                    r.counters.canceled_transactions -= 1
                    r.put_back(it)
            raise
        if expired:
            self._dispose_expired(qs, h, expired)
        if r.wants_refill():
            self._start_refill(qs, h)
        return out

    def _serve(self, qs: QueueState, h: Handle) -> None:
        """Hand available items to waiting gets, first come first served."""
        if not h.waiters:
            if h.reader.wants_refill():
                self._start_refill(qs, h)
            return
        expired: list[Item] = []
        now = self.clock()
        while h.waiters:
            w = h.waiters[0]
            it = h.reader.peek(now, expired) if w.peek else h.reader.take(now, expired)
            if it is None:
                break
            h.waiters.popleft()
            if not w.peek:
                h.reader.hold(it)  # until the waiter's get finishes
            w.item = it
            w.event.set()
        self._dispose_expired(qs, h, expired)
        if h.reader.wants_refill():
            self._start_refill(qs, h)

    # -- reliable reads ---------------------------------------------------------------------

    def confirm(
        self,
        client: OpenReads,
        queue: str,
        reader: str | None = None,
        count: int | None = None,
        ids: Sequence[int] | None = None,
    ) -> int:
        """Confirm the client's open reads on queue/reader: `ids`, the `count` oldest, or all."""
        rname = reader or ""
        chosen = client.choose(queue, rname, count, ids)
        qs = self.queues.get(queue)
        for i in chosen:
            client.remove(queue, rname, i)
            h = self._owner(qs, rname, i)
            if h is not None:
                h.reader.confirm(i)
        return len(chosen)

    def abort(
        self,
        client: OpenReads,
        queue: str,
        reader: str | None = None,
        count: int | None = None,
        ids: Sequence[int] | None = None,
        *,
        count_error: bool = True,
    ) -> int:
        """Return the client's open reads on queue/reader to the head of the queue."""
        rname = reader or ""
        chosen = client.choose(queue, rname, count, ids)
        qs = self.queues.get(queue)
        served: dict[int, Handle] = {}
        for i in sorted(chosen, reverse=True):  # the lowest id ends up first
            client.remove(queue, rname, i)
            h = self._owner(qs, rname, i)
            if h is not None and qs is not None:
                self._return(qs, h, i, count_error=count_error)
                served[id(h)] = h
        for h in served.values():
            assert qs is not None
            self._serve(qs, h)
        return len(chosen)

    @staticmethod
    def _owner(qs: QueueState | None, rname: str, item_id: int) -> Handle | None:
        """The reader holding open read `item_id` taken under the name `rname`."""
        if qs is None:
            return None
        h = qs.readers.get(rname)
        if h is not None and item_id in h.reader.open:
            return h
        for other in qs.readers.values():
            if rname in other.aliases and item_id in other.reader.open:
                return other
        return None

    def _return(self, qs: QueueState, h: Handle, item_id: int, *, count_error: bool) -> None:
        it = h.reader.abort(item_id, count_error=count_error)
        if it is None:
            return
        cfg = h.config
        if cfg.error_queue and cfg.max_errors and it.error_count >= cfg.max_errors:
            h.reader.start_move(it)
            self._spawn(self._move, qs, h, [it], cfg.error_queue, True)
        else:
            h.reader.put_back(it)

    def release(self, client: OpenReads, *, count_error: bool = True) -> None:
        """The client is gone: every open read goes back to the head of its queue."""
        self.clients.pop(client.id, None)
        for queue, rname in client.open_keys():
            self.abort(client, queue, rname, count_error=count_error)

    def register(self, client: OpenReads) -> OpenReads:
        self.clients[client.id] = client
        return client

    # -- expiry and moves ----------------------------------------------------------------

    def _dispose_expired(self, qs: QueueState, h: Handle, items: list[Item]) -> None:
        if not items:
            return
        target = h.config.expire_to_queue
        if target and target != qs.name:
            for it in items:
                h.reader.start_move(it)
            self._spawn(self._move, qs, h, items, target, False)
        else:
            for it in items:
                h.reader.consume(it.id)

    async def _move(
        self, qs: QueueState, h: Handle, items: list[Item], target: str, keep_errors: bool
    ) -> None:
        """Put items into `target` (expire_to_queue or error_queue), then consume them here."""
        moved = False
        try:
            if keep_errors:
                for it in items:
                    await self.put(target, [it.data], error_count=it.error_count)
            else:
                await self.put(target, [it.data for it in items])
            moved = True
        except (JournalError, QueueFullError, ItemTooLargeError, QueueClosedError,
                ValueError, OSError) as exc:
            log.error("queue %s: could not move %d items to %s: %s",
                      qs.name, len(items), target, exc)
        if keep_errors or moved:
            for it in items:
                h.reader.end_move(it.id, moved=moved)
        else:  # an expired item that cannot move is dropped, as Kestrel drops it
            for it in items:
                h.reader.end_move(it.id, moved=True)
        if not moved:
            self._serve(qs, h)

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is None:
            raise RuntimeError("broker is not running")
        self._nursery.start_soon(fn, *args)

    def flush_expired(self, queue: str, reader: str | None = None) -> int:
        qs = self.queues.get(queue)
        h = qs.readers.get(reader or "") if qs is not None else None
        if h is None or qs is None:
            return 0
        expired: list[Item] = []
        h.reader.expire_head(self.clock(), 0, expired)
        self._dispose_expired(qs, h, expired)
        return len(expired)

    def flush_all_expired(self) -> int:
        return sum(
            self.flush_expired(q, r)
            for q, qs in list(self.queues.items())
            for r in list(qs.readers)
        )

    async def _before_drop(self, qs: QueueState, seg: SegmentInfo) -> None:
        """drop_oldest is about to remove `seg`: take its items out of every reader.

        The segment is read (in a thread) so items that were only on disk are
        subtracted exactly; ids in a reader's `done` were never counted.
        """
        sizes: list[tuple[int, int]] = []
        if any(h.reader.behind is not None and h.reader.behind <= seg.last_id
               for h in qs.readers.values()):
            sizes = await trio.to_thread.run_sync(_segment_sizes, qs.journal, seg)
        for h in qs.readers.values():
            r = h.reader
            count = nbytes = 0
            if r.behind is not None:
                for item_id, size in sizes:
                    if item_id >= r.behind and item_id <= r.tail and item_id not in r.done:
                        count += 1
                        nbytes += size
            r.drop_through(seg.last_id, count, nbytes)

    # -- flush and delete -------------------------------------------------------------------

    def flush(self, queue: str, reader: str | None = None) -> int:
        qs = self.queues.get(queue)
        h = qs.readers.get(reader or "") if qs is not None else None
        return self._flush(h) if h is not None else 0

    def flush_all(self) -> int:
        return sum(self._flush(h) for qs in self.queues.values() for h in qs.readers.values())

    @staticmethod
    def _flush(h: Handle) -> int:
        n = h.reader.flush()
        if h.reader.flush_overflow:
            log.warning(
                "queue %s reader %r: flushed with reads open; %d flushed items would come "
                "back after a crash before those reads end (READ_DONE is capped)",
                h.reader.queue, h.reader.name, h.reader.flush_overflow,
            )
            h.reader.flush_overflow = 0
        return n

    async def delete(self, queue: str, reader: str | None = None) -> bool:
        """Delete reader `reader` of `queue`, or the whole queue with every file.

        Deleting a queue's last reader leaves a default reader at the tail (written
        durably), so items put afterwards have a reader before and after a restart.
        """
        qs = self.queues.get(queue)
        if qs is None:
            return False
        if reader:
            h = qs.readers.pop(reader, None)
            if h is None:
                return False
            self._close_handle(h)
            self._forget_open_reads(queue, reader, h)
            await qs.journal.remove_reader(reader)
            if not qs.readers and not qs.deleted:
                await self._handle(qs, "")
            return True
        qs.deleted = True
        del self.queues[queue]
        for h in qs.readers.values():
            self._close_handle(h)
        self._forget_open_reads(queue, None, None)
        await self.datadir.delete_queue(queue)
        self.counters.queue_deletes += 1
        return True

    def _forget_open_reads(self, queue: str, reader: str | None, h: Handle | None) -> None:
        """Open reads of a deleted queue (reader None) or reader end: ids are reused.

        Reads taken under an alias of the deleted reader (`q` before a takeover) end
        only if that reader holds them: a newer default reader's reads stay.
        """
        for client in self.clients.values():
            if reader is None:
                client.forget(queue)
                continue
            client.forget(queue, reader)
            if h is not None:
                for alias in h.aliases:
                    for item_id in client.open_ids(queue, alias):
                        if item_id in h.reader.open:
                            client.remove(queue, alias, item_id)

    def _close_handle(self, h: Handle) -> None:
        h.closed = True
        while h.waiters:
            h.waiters.popleft().event.set()

    # -- read-behind --------------------------------------------------------------------------

    def _start_refill(self, qs: QueueState, h: Handle) -> None:
        if not h.refilling and self._nursery is not None and not h.closed:
            h.refilling = True
            self._nursery.start_soon(self._refill_task, qs, h)

    async def _refill_task(self, qs: QueueState, h: Handle) -> None:
        try:
            while h.reader.wants_refill() and not h.closed:
                await self._refill_once(qs, h)
        except JournalError:
            pass  # logged; the next get tries again (and reports it to its client)
        finally:
            h.refilling = False

    async def _refill_once(self, qs: QueueState, h: Handle) -> None:
        async with h.refill_lock:
            r = h.reader
            if r.behind is None or h.closed:
                return
            start, end = r.behind, r.tail
            try:
                items, next_id = await trio.to_thread.run_sync(
                    _read_range, qs.journal, start, end, r.refill_budget()
                )
            except (OSError, JournalError) as exc:
                if h.closed or qs.deleted:
                    return  # deleted while reading: nothing left to serve
                log.error("queue %s: read-behind failed: %s", qs.name, exc)
                raise JournalError(f"queue {qs.name!r}: reading items back failed: {exc}") from exc
            r.load(start, items, next_id)
            self._serve(qs, h)

    # -- background work ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background tasks and moves; cancel to stop (after `aclose`)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for qs in list(self.queues.values()):
                for h in list(qs.readers.values()):
                    if h.reader.wants_refill():
                        self._start_refill(qs, h)  # warm memory with the recovered backlog
            nursery.start_soon(self._checkpoint_loop)
            nursery.start_soon(self._sweep_loop)
            nursery.start_soon(self._timeout_loop)
            task_status.started()

    async def _checkpoint_loop(self) -> None:
        while True:
            await trio.sleep(self.config.checkpoint_interval / 1000)
            try:
                await self.checkpoint_all()
            except Exception:  # a background task must outlive one bad round
                log.exception("checkpoint round failed")

    async def checkpoint_all(self, *, force: bool = False) -> int:
        """Write the checkpoint of every reader that consumed something; compact."""
        written = 0
        for qs in list(self.queues.values()):
            wrote = False
            async with qs.reader_lock:  # not in the middle of a takeover
                for name, h in list(qs.readers.items()):
                    if not (h.reader.dirty or force) or qs.deleted or h.closed:
                        continue
                    head, done = h.reader.checkpoint()
                    try:
                        await qs.journal.write_checkpoint(name, head, done)
                    except OSError as exc:
                        h.reader.dirty = True
                        log.error("queue %s: checkpoint of reader %r failed: %s",
                                  qs.name, name, exc)
                        continue
                    wrote = True
                    written += 1
            if wrote and not qs.deleted and len(qs.journal.segments) > 1:
                try:
                    await qs.journal.compact()
                except (OSError, JournalError) as exc:
                    log.error("queue %s: compaction failed: %s", qs.name, exc)
        return written

    async def _sweep_loop(self) -> None:
        while True:
            await trio.sleep(self.config.expiration_timer / 1000)
            try:
                await self.sweep()
            except Exception:
                log.exception("expiry sweep failed")

    async def sweep(self) -> None:
        """Expire items at the head of every reader; delete queues past max_queue_age."""
        now = self.clock()
        for qs in list(self.queues.values()):
            for h in list(qs.readers.values()):
                expired: list[Item] = []
                h.reader.expire_head(now, h.config.max_expire_sweep, expired)
                self._dispose_expired(qs, h, expired)
            age = qs.config.max_queue_age
            if age and now - qs.create_time_ms > age and self._idle(qs):
                log.info("queue %s: empty and older than max_queue_age, deleting", qs.name)
                await self.delete(qs.name)
                self.counters.queue_expires += 1

    def _idle(self, qs: QueueState) -> bool:
        return not qs.inflight and all(
            not (h.reader.items or h.reader.open or h.reader.moving or h.waiters)
            for h in qs.readers.values()
        )

    async def _timeout_loop(self) -> None:
        while True:
            self._timeout_wake = trio.Event()
            deadline = self.timeouts.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timeout_wake.wait()
            self.expire_open_reads(trio.current_time())

    def expire_open_reads(self, now: float) -> int:
        """Return every open read whose deadline passed to its queue; how many."""
        due = self.timeouts.pop_due(now)
        for t in due:
            qs = self.queues.get(t.queue)
            h = self._owner(qs, t.reader, t.item_id)
            if qs is not None and h is not None:
                log.info("queue %s: open read %d of %s timed out, returned to the queue",
                         t.queue, t.item_id, t.reads.name)
                self._return(qs, h, t.item_id, count_error=True)
                self._serve(qs, h)
        return len(due)

    def wake_waiters(self) -> None:
        """Answer every waiting get as empty (shutdown)."""
        self.closing = True
        for qs in self.queues.values():
            for h in qs.readers.values():
                while h.waiters:
                    h.waiters.popleft().event.set()

    def reconfigure(self, config: ServerConfig) -> None:
        """Apply reloaded queue configs to every existing queue and reader."""
        self.config = config
        for name, qs in self.queues.items():
            qs.config = config.queue_config(name)
            qs.journal.config = qs.config.journal_config()
            for rname, h in qs.readers.items():
                h.config = self._reader_config(name, rname)
                h.reader.limits = h.config

    # -- shutdown -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Refuse new work, return open reads (no error counted), write every checkpoint."""
        self.wake_waiters()
        for client in list(self.clients.values()):
            self.release(client, count_error=False)
        await self.checkpoint_all(force=True)

    # -- statistics ----------------------------------------------------------------------------

    def reader_stats(self, qs: QueueState, h: Handle) -> dict[str, int]:
        r, c = h.reader, h.reader.counters
        oldest = r.oldest_add_time_ms()
        return {
            "items": r.items,
            "bytes": r.bytes,
            "total_items": c.total_items,
            "logsize": qs.journal.total_bytes,
            "expired_items": c.expired,
            "mem_items": len(r.front) + len(r.mem),
            "mem_bytes": r.mem_bytes,
            "age": c.age_ms,
            "discarded": c.discarded,
            "waiters": len(h.waiters),
            "open_transactions": len(r.open),
            "transactions": c.transactions,
            "canceled_transactions": c.canceled_transactions,
            "total_flushes": c.flushes,
            "age_msec": c.age_ms,
            "create_time": r.create_time_ms,
            "gets": c.taken,
            "oldest_item_age_msec": 0 if oldest is None else max(0, self.clock() - oldest),
        }

    def reader_info(self, queue: str, reader: str | None = None) -> dict[str, int]:
        """reader_stats of one reader ({} if it does not exist)."""
        qs = self.queues.get(queue)
        rname = reader or ""
        if qs is None:
            return {}
        h = qs.readers.get(rname) or next(
            (o for o in qs.readers.values() if rname in o.aliases), None)
        return {} if h is None else self.reader_stats(qs, h)

    def queue_stats(self) -> list[tuple[str, dict[str, int]]]:
        """(`q` or `q+reader`, fields) for every reader, sorted by name."""
        out = []
        for name, qs in sorted(self.queues.items()):
            for rname, h in sorted(qs.readers.items()):
                out.append((f"{name}+{rname}" if rname else name, self.reader_stats(qs, h)))
        return out


# -- worker-thread helpers --------------------------------------------------------------------


def _count_unconsumed(journal: QueueJournal, head: int, done: frozenset[int]) -> tuple[int, int]:
    """(items, bytes) a reader has not consumed: ids above `head` and not in `done`.

    A segment without a `done` id inside is counted from what recovery learnt while
    verifying it (count and data bytes); only the others are decoded again.
    """
    count = nbytes = 0
    done_sorted = sorted(done)
    for seg in list(journal.segments):
        if not seg.count or seg.last_id <= head:
            continue
        lo = bisect.bisect_left(done_sorted, seg.first_id)
        clean = lo == len(done_sorted) or done_sorted[lo] > seg.last_id
        if seg.first_id > head and clean and seg.data_bytes is not None:
            count += seg.count
            nbytes += seg.data_bytes
            continue
        for put in journal.iter_segment(seg, head + 1, None):
            if put.id not in done:
                count += 1
                nbytes += len(put.data)
    return count, nbytes


def _segment_sizes(journal: QueueJournal, seg: SegmentInfo) -> list[tuple[int, int]]:
    """(id, data size) of every item in one segment."""
    return [(p.id, len(p.data)) for p in journal.iter_segment(seg, 1, None)]


def _read_range(
    journal: QueueJournal, start: int, end: int, budget: int
) -> tuple[list[Item], int]:
    """Items with ids in [start, end] up to `budget` bytes; and the id to continue from."""
    items: list[Item] = []
    nbytes = 0
    for put in journal.iter_puts(start, end):
        if items and (nbytes + len(put.data) > budget or len(items) >= REFILL_MAX_ITEMS):
            return items, put.id
        items.append(put)
        nbytes += len(put.data)
    return items, end + 1


@asynccontextmanager
async def open_broker(
    config: ServerConfig, clock: Callable[[], int] = wall_ms
) -> AsyncIterator[Broker]:
    """Recover the data directory, load the queues, run background work; close cleanly."""
    async with open_data_dir(
        config.data_dir,
        config.data_dir_config(),
        lambda name: config.queue_config(name).journal_config(),
    ) as dd:
        broker = Broker(dd, config, clock)
        await broker.load()
        async with trio.open_nursery() as nursery:
            await nursery.start(broker.run)
            try:
                yield broker
            finally:
                with trio.CancelScope(shield=True):
                    await broker.aclose()
                nursery.cancel_scope.cancel()
