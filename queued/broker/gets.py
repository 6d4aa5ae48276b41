"""The broker's get path: gets and batch gets (waiting, or never waiting for the reactor's
pass), long polls lined up without a task (`line_up`, `end_wait`), and the reliable reads
they open: register, release, confirm, abort, extend, reject (the ledger itself is
`queued.broker.reliable`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from queued.broker.live_readers import LiveReader, Waiter, Wake
from queued.broker.puts import JoinedPuts, PutPath
from queued.broker.queues import QueueState
from queued.broker.reliable import Owe
from queued.reader.open_reads import OpenReads
from queued.reader.state import Item

if TYPE_CHECKING:
    pass


class MustWait(trio.WouldBlock):
    """`get_many_nowait` found nothing and the get would wait for an item to arrive."""


class AfterCommit(trio.WouldBlock):
    """`get_many_nowait` found nothing while puts to the queue wait for the pass's commit:
    run the get again after it rather than answer it empty."""


class GetPath(PutPath):
    """The get and confirm layer of `Broker`, over the put path (see the module docstring
    of queued.broker.broker)."""

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
