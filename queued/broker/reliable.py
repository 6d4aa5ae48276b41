"""Reliable reads across queues: every connection's open reads and their deadlines, and
what a confirm, an abort, a timeout, a hang-up or a delete does to them.

The ledgers and the deadline heap are pure (`queued.reader.open_reads`); this module
applies them to the queues: an open read ends in its ledger first, then in the
reader holding it (found under the name it was taken by, aliases included). A
confirm, and the error count of an abort, is journaled in the reader's file (one
append per reader per round): whoever acknowledges it waits for the ticket handed to
`owe`. It never waits: the upkeep sleeps until the next deadline and calls `expire`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence

import trio

from queued.broker.live_readers import LiveReader
from queued.broker.queues import Background, QueueState
from queued.errors import NotOpenError, ReadStateError
from queued.reader.open_reads import OpenReads, TimeoutHeap
from queued.reader.state import Item
from queued.storage.journal import Ticket

log = logging.getLogger("queued.broker")

#: Takes the ticket of a journal write that an acknowledgement must wait for.
Owe = Callable[[Ticket], None]


def _held(client: OpenReads, queue: str, rname: str, ids: Sequence[int] | None) -> list[int]:
    """`client`'s open reads on queue/reader among `ids` (None: all); NotOpenError when
    `ids` names one it does not hold (a touch or reject of someone else's read)."""
    chosen = client.choose(queue, rname, None, ids)
    if ids is not None and len(chosen) != len(set(ids)):
        missing = sorted(set(ids) - set(chosen))
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise NotOpenError(f"not open on this connection: {queue} id {shown}")
    return chosen


class ReliableReads:
    """See the module docstring. `queues` is the registry's live dict."""

    def __init__(self, queues: dict[str, QueueState], background: Background) -> None:
        self.queues = queues
        self.background = background
        self.clients: dict[int, OpenReads] = {}  # registered: released at shutdown
        self.timeouts = TimeoutHeap()

    def register(self, client: OpenReads) -> OpenReads:
        self.clients[client.id] = client
        return client

    def release(self, client: OpenReads, *, count_error: bool = True,
                owe: Owe | None = None) -> None:
        """The client is gone: every open read goes back to the head of its queue (`owe`
        gets the tickets of the error counts' journal writes)."""
        self.clients.pop(client.id, None)
        for queue, rname in client.open_keys():
            self.abort(client, queue, rname, count_error=count_error, owe=owe)

    @staticmethod
    def room(client: OpenReads | None, max_open_reads: int) -> int:
        """How many more open reads `client` may take (at least 1), or ReadStateError."""
        if client is None:
            raise ValueError("an open read needs a client")
        room = max_open_reads - client.open_total
        if room <= 0:
            raise ReadStateError(
                f"too many open reads on this connection (max {max_open_reads})"
            )
        return room

    def open(
        self, qs: QueueState, h: LiveReader, rname: str, items: list[Item], client: OpenReads,
        open_timeout_ms: int | None,
    ) -> list[Item]:
        """Held items become `client`'s open reads under the name it used, returned
        after `open_timeout_ms` (None: the reader's open_transaction_timeout; 0:
        never). None of them if the queue or reader was deleted meanwhile."""
        if h.closed or qs.deleted:
            return []  # deleted with its queue: there is nothing left to confirm
        h.reader.counters.transactions += len(items)
        timeout = (h.config.open_transaction_timeout if open_timeout_ms is None
                   else open_timeout_ms)
        deadline = trio.current_time() + timeout / 1000 if timeout else None
        ids = [it.id for it in items]
        client.add_many(qs.name, rname, ids, deadline)  # the held items stay open
        if deadline is not None and self.timeouts.push(deadline, client, qs.name, rname, ids):
            self.background.timeouts_changed()
        return items

    def confirm(
        self, client: OpenReads, queue: str, rname: str, count: int | None,
        ids: Sequence[int] | None, owe: Owe | None = None, *, journal: bool = True,
    ) -> int:
        """Confirm open reads; with `journal` (not for a read that stands for a plain
        get) the confirms are appended to the reader's file and `owe` gets the ticket.
        A confirm takes effect at once; if its append fails, it is undone (`_unconfirm`)
        before the ticket wakes anyone: a refused confirm leaves its reads open."""
        taken = client.take(queue, rname, count, ids)  # id -> deadline, closed
        if not taken:
            return 0
        qs = self.queues.get(queue)
        if qs is None:
            return len(taken)
        confirmed: list[tuple[LiveReader, list[Item]]] = []
        h = qs.readers.get(rname)
        others: Iterable[int] = taken
        if h is not None:  # (the usual case: every read is the named reader's)
            items = h.reader.confirm_many(taken)
            if items:
                confirmed.append((h, items))
            if len(items) == len(taken):
                others = ()
            else:
                got = {it.id for it in items}
                others = [i for i in taken if i not in got]
        by_owner: dict[int, tuple[LiveReader, list[Item]]] = {}
        for i in others:  # taken under a name another reader took over since
            o = qs.owner(rname, i)
            if o is not None:
                it = o.reader.open[i]
                if o.reader.confirm(i):
                    by_owner.setdefault(id(o), (o, []))[1].append(it)
        confirmed.extend(by_owner.values())
        if not journal:
            return len(taken)
        for o, done in confirmed:
            ticket = qs.note_read(o, done=[it.id for it in done])
            if ticket is None:
                continue
            ticket.on_failure(functools.partial(self._unconfirm, client, qs, o, rname, done,
                                                taken))
            if owe is not None:
                owe(ticket)
        return len(taken)

    def _unconfirm(self, client: OpenReads, qs: QueueState, h: LiveReader, rname: str,
                   items: list[Item], deadlines: dict[int, float | None],
                   error: BaseException) -> None:
        """Confirms whose append failed are undone: the reads are open again on their
        connection, with their deadlines; or, if it has ended meanwhile, back at the
        head of the queue as its other reads went. Nothing was acknowledged, so nothing
        is lost: the items are delivered again unless a confirm of them succeeds."""
        if qs.deleted or h.closed:
            return  # deleted with its queue: there is nothing left to deliver
        reads = [(it, deadlines[it.id]) for it in items]
        log.warning("queue %s: %d confirms of %s undone, not durable: %s", qs.name,
                    len(reads), client.name, error)
        for it, _ in reads:
            h.reader.reopen(it)
        if client.id not in self.clients:
            self._return(qs, rname, [it.id for it, _ in reads], count_error=False)
            return
        by_deadline: dict[float | None, list[int]] = {}
        for it, deadline in reads:
            by_deadline.setdefault(deadline, []).append(it.id)
        for deadline, ids in by_deadline.items():
            client.add_many(qs.name, rname, ids, deadline)
            if deadline is not None and self.timeouts.push(deadline, client, qs.name, rname,
                                                           ids):
                self.background.timeouts_changed()

    def abort(
        self, client: OpenReads, queue: str, rname: str, count: int | None = None,
        ids: Sequence[int] | None = None, *, count_error: bool = True, owe: Owe | None = None,
        delay_ms: int = 0,
    ) -> int:
        chosen = list(client.take(queue, rname, count, ids))
        qs = self.queues.get(queue)
        if qs is not None:
            self._return(qs, rname, chosen, count_error=count_error, owe=owe,
                         delay_ms=delay_ms)
        return len(chosen)

    def _return(self, qs: QueueState, rname: str, ids: list[int], *, count_error: bool,
                owe: Owe | None = None, delay_ms: int = 0) -> None:
        """Open reads (closed in their ledgers already) go back to the head of their
        readers, the lowest id first (or wait `delay_ms` first); then waiting gets are
        served. The error counts and due times they got are journaled (`owe` gets the
        ticket)."""
        due_ms = qs.clock() + delay_ms if delay_ms > 0 else None
        served: dict[int, tuple[LiveReader, list[tuple[int, int]], list[tuple[int, int]]]] = {}
        for i in sorted(ids, reverse=True):
            h = qs.owner(rname, i)
            if h is not None:
                back = qs.return_read(h, i, count_error=count_error, due_ms=due_ms)
                _, errors, delays = served.setdefault(id(h), (h, [], []))
                if back is None:
                    continue
                it, due = back
                if count_error:
                    errors.append((i, it.error_count))
                if due is not None:  # (an abort's delay, or the retry_backoff step)
                    delays.append((i, due))
        for h, errors, delays in served.values():
            if errors or delays:
                ticket = qs.note_read(h, errors=errors, delays=delays)
                if ticket is not None and owe is not None:
                    owe(ticket)
            qs.serve(h)

    def extend(self, client: OpenReads, queue: str, rname: str, ids: Sequence[int] | None,
               ms: int, now: float) -> int:
        """Move the deadline of `client`'s open reads on queue/reader (`ids`, else all) to
        `ms` from `now` (trio time; 0: no deadline); how many. NotOpenError (nothing
        changed) if `ids` names a read the client does not hold."""
        chosen = _held(client, queue, rname, ids)
        if not chosen:
            return 0
        deadline = now + ms / 1000 if ms else None
        client.add_many(queue, rname, chosen, deadline)
        if deadline is not None and self.timeouts.push(deadline, client, queue, rname, chosen):
            self.background.timeouts_changed()
        return len(chosen)

    def reject(self, client: OpenReads, queue: str, rname: str, ids: Sequence[int] | None,
               owe: Owe | None = None) -> int:
        """Give up on `client`'s open reads on queue/reader (`ids`, else all): each goes
        to the reader's error_queue at once, or is consumed (journaled as a confirm is)
        when it has none. NotOpenError (nothing changed) for an id not held."""
        chosen = _held(client, queue, rname, ids)
        if not chosen:
            return 0
        client.remove_many(queue, rname, chosen)
        qs = self.queues.get(queue)
        if qs is None:
            return len(chosen)
        dropped: dict[int, tuple[LiveReader, list[int]]] = {}
        for i in chosen:
            h = qs.owner(rname, i)
            if h is None:
                continue
            target = h.config.error_queue
            if qs.reject_read(h, i) is not None and not (target and target != qs.name):
                dropped.setdefault(id(h), (h, []))[1].append(i)
        for h, done in dropped.values():
            ticket = qs.note_read(h, done=done)
            if ticket is not None and owe is not None:
                owe(ticket)
        return len(chosen)

    def expire(self, now: float) -> int:
        """Return every open read whose deadline (trio time) is <= now; how many."""
        due = self.timeouts.pop_due(now)
        # Returned together per queue and reader name, so a batch that timed out goes
        # back lowest id first, as an abort's does (one at a time, each went to the
        # head in turn: the batch came back reversed).
        back: dict[tuple[str, str], list[int]] = {}
        for t in due:
            qs = self.queues.get(t.queue)
            if qs is not None and qs.owner(t.reader, t.item_id) is not None:
                log.info("queue %s: open read %d of %s timed out, returned to the queue",
                         t.queue, t.item_id, t.reads.name)
                back.setdefault((t.queue, t.reader), []).append(t.item_id)
        for (queue, rname), ids in back.items():
            qs = self.queues.get(queue)
            if qs is not None:
                self._return(qs, rname, ids, count_error=True)
        return len(due)

    def forget(self, queue: str, reader: str | None, h: LiveReader | None) -> None:
        """Open reads of a deleted queue (reader None) or reader end: ids are reused.

        Reads taken under an alias of the deleted reader (`q` before a takeover) end
        only if that reader holds them: a newer default reader's reads stay.
        """
        for client in self.clients.values():
            client.forget(queue, reader)
            if h is None:
                continue
            for alias in h.aliases:
                for item_id in client.open_ids(queue, alias):
                    if item_id in h.reader.open:
                        client.remove(queue, alias, item_id)
