"""The gets of the reactor's pass (queued.server.reactor): a get run without waiting
(`get_nowait`; pipelined plain gets of one key, `_gets_nowait`), and the long polls
that wait in their reader's line without a task (`LongPoll`): one per memcache or text
connection (`long_poll`, its later requests wait behind it) and any number per RPC
connection (`polls`, later requests go on), answered by the reactor's next pass once
woken or out of time (`end_long_poll`, `end_polls`).

A base of `queued.server.session.Session`, which owns the connection's state (declared
here as the task path declares it) and the replies; the chain is TaskBase -> TaskGets ->
TaskPath -> PassGets -> Session. Never parses bytes itself and never touches the journal
but through the broker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from queued.broker.broker import AfterCommit, JoinedPuts, MustWait
from queued.broker.live_readers import LiveReader, Waiter
from queued.broker.queues import QueueState
from queued.reader.state import Item
from queued.server.task_gets import MAX_WAITING
from queued.server.task_path import TaskPath
from queued.storage.journal import Ticket
from queued.wire import commands as c

# (named directly where compiled code tests a type: `c.Put` as a value is a look-up in the
# module at each use, `Put` a static reference)
from queued.wire.commands import Done, Get, Items, Request

log = logging.getLogger("queued.server")


class LongPoll:
    """A memcache or text get that waits in its reader's line without a task (the
    reactor's long poll): woken (`set`) by `serve` or a closing reader, or by the
    reactor at its deadline; `Session.end_long_poll` answers it."""

    __slots__ = ("deadline", "handle", "notify", "owing", "queue_state", "request", "waiter",
                 "woken")

    def __init__(self, request: c.Request, deadline: float,
                 notify: Callable[[], None]) -> None:
        self.request = request
        self.deadline = deadline  # trio time
        self.notify = notify
        self.woken = False
        self.owing: list[Ticket] = []  # of a /close that ran before it waited
        self.queue_state: QueueState | None = None
        self.handle: LiveReader | None = None
        self.waiter: Waiter | None = None

    def set(self) -> None:
        self.woken = True
        self.notify()



class PassGets(TaskPath):
    """The pass's gets and long polls of a `Session` (see the module docstring)."""

    # The session's own state (set by Session.__init__) that these use, beyond the task
    # path's.
    owing: list[Ticket]
    long_poll: LongPoll | None
    polls: list[LongPoll]
    notify: Callable[[], None] | None
    joined: JoinedPuts | None
    out_cap: int
    after_commit: bool
    deferred: c.Request | None

    def get_nowait(self, requests: list[c.Parsed], i: int) -> bool:
        """handlers.get without waiting; False (nothing done but a confirm, which is
        then rewritten out of the request) when it must wait."""
        r = requests[i]
        assert type(r) is Request
        cmd = r.command
        assert type(cmd) is Get
        if cmd.peek or cmd.reject:
            return False  # (handlers.get)
        b, reads, reader = self.broker, self.reads, cmd.reader or ""
        try:
            if cmd.abort:
                b.abort(reads, cmd.queue, reader, owe=self.reply_after, delay_ms=cmd.delay_ms)
                reply: c.Reply = Done()
            elif cmd.close and not cmd.open:
                b.confirm(reads, cmd.queue, reader, owe=self.reply_after)
                reply = Done()
            else:
                if cmd.close:
                    b.confirm(reads, cmd.queue, reader, owe=self.reply_after)
                    cmd = cmd.copy()
                    cmd.close = False
                    requests[i] = Request(cmd, r.context, r.name, r.count)
                if cmd.exclusive and reads.open_ids(cmd.queue, reader):
                    log.warning("%s: get %s with a read already open on it", self.name,
                                cmd.queue)
                    reply = c.Failure(c.ErrorKind.READ_OPEN,
                                      "a read is already open on this queue")
                elif self.ordered and cmd.max_items > 1:
                    return self._gets_nowait(requests, i)
                else:
                    reply = self._take_nowait(cmd, self._defer(requests[i]))
        except AfterCommit:
            self.deferred = requests[i]  # type: ignore[assignment]
            self.after_commit = True
            return False
        except MustWait:
            if self.notify is None or (self.ordered and cmd.max_items != 1):
                return False
            if not self.ordered and len(self.polls) + self.waiting >= MAX_WAITING:
                reply = c.Failure(c.ErrorKind.BUSY,
                                  f"{MAX_WAITING} gets are already waiting on this connection")
            else:
                ri = requests[i]
                assert type(ri) is Request
                poll = LongPoll(ri, trio.current_time() + cmd.timeout_ms / 1000, self.notify)
                poll.queue_state, poll.handle, poll.waiter = b.line_up(cmd.queue, cmd.reader,
                                                                      poll)
                if self.ordered:
                    poll.owing, self.owing = self.owing, []  # (a /close ran: its reply waits)
                    self.long_poll = poll
                    return False  # (later requests wait behind it)
                self.polls.append(poll)
                self.stats.count(ri.name, ri.count)
                return True  # answered when it ends (`end_polls`); later requests go on
        except trio.WouldBlock:
            return False
        except Exception as exc:
            reply = self.failure(r, exc)
        self.stats.count(r.name, r.count)
        self.reply(r, reply)
        return True

    def _gets_nowait(self, requests: list[c.Parsed], i: int) -> bool:
        """Pipelined plain gets of one key (a joined Get, one item each): answered as far
        as `out_cap` leaves room; the rest stay in `requests` for later (False)."""
        r = requests[i]
        assert type(r) is Request and type(r.command) is Get
        cmd = r.command
        room = max(1, self.out_cap - len(self.out))
        b = self.broker
        defer = self._defer(r)
        later = defer is not None and b.puts_pending(cmd.queue, defer)
        items = b.get_many_nowait(
            cmd.queue, cmd.reader, cmd.max_items, wait=False, client=self.reads,
            open=cmd.open, open_timeout_ms=cmd.open_timeout_ms, separate=True,
            max_bytes=room, partial=later)
        k = len(items)
        if k == cmd.max_items or (not later and sum([len(it.data) for it in items]) < room):
            self.stats.count(r.name, r.count)
            self.reply(r, Items(items))
            return True
        if later:  # the rest after the pass's commit, which brings more items
            self.after_commit = True
        if not k:
            self.deferred = r
            return False
        taken = cmd.copy()
        taken.max_items = k
        head = Request(taken, r.context, r.name, k)
        self.stats.count(head.name, k)
        self.reply(head, Items(items))
        left = cmd.max_items - k
        rest = cmd.copy()
        rest.max_items = left
        requests[i] = Request(rest, r.context, r.name, left)
        if later:
            self.deferred = requests[i]  # type: ignore[assignment]
        return False

    def _take_nowait(self, cmd: c.Get, defer: JoinedPuts | None) -> c.Reply:
        b = self.broker
        if not self.ordered:
            return Items(b.get_many_nowait(
                cmd.queue, cmd.reader, cmd.max_items, wait=cmd.timeout_ms > 0,
                client=self.reads, open=cmd.open, open_timeout_ms=cmd.open_timeout_ms,
                max_bytes=cmd.max_bytes, defer=defer))
        items = b.get_many_nowait(
            cmd.queue, cmd.reader, cmd.max_items, wait=cmd.timeout_ms > 0 and not self.eof,
            client=self.reads, open=cmd.open, open_timeout_ms=cmd.open_timeout_ms,
            separate=cmd.max_items > 1, defer=defer)
        return self._line_safe(cmd, items)

    def _defer(self, request: c.Parsed) -> JoinedPuts | None:
        """A get that finds nothing waits for the pass's commit when puts to its queue
        are in the pass (so a consumer is not answered empty while an item it could have
        is on its way): once per request. What `get_many_nowait` checks that against."""
        return self.joined if self.deferred is not request else None

    def _line_safe(self, cmd: c.Get, items: list[Item]) -> c.Reply:
        """The reply to a get; one that the text protocol's line cannot carry is given
        back (as handlers.get does)."""
        if cmd.line_safe and items:
            b, it = self.broker, items[0]
            if b"\n" in it.data:
                b.abort(self.reads, cmd.queue, cmd.reader, ids=[it.id], count_error=False)
                return c.Failure(c.ErrorKind.NOT_ENCODABLE, "item contains a newline")
            b.confirm(self.reads, cmd.queue, cmd.reader, ids=[it.id], journal=False)
        return Items(items)

    def end_long_poll(self, now: float) -> bool:
        """Answer the long poll if it can be: woken, out of time, or its peer gone or
        the server stopping. False: it waits on."""
        poll = self.long_poll
        assert poll is not None and poll.waiter is not None
        if not (poll.woken or now >= poll.deadline or self.eof or self.server.closing):
            return False
        self.long_poll = None
        r = poll.request
        cmd = r.command
        assert type(cmd) is Get and poll.queue_state is not None and poll.handle is not None
        b = self.broker
        try:
            it = b.end_wait(poll.queue_state, poll.handle, cmd.reader or "", poll.waiter,
                            client=self.reads if cmd.open else None,
                            open_timeout_ms=cmd.open_timeout_ms,
                            take=not self.eof)  # (a peer that left takes no item with it)
            reply = self._line_safe(cmd, [] if it is None else [it])
        except Exception as exc:
            reply = self.failure(r, exc)
        self.stats.count(r.name, r.count)
        self.owing = poll.owing
        self.reply(r, reply)
        return True

    def next_poll_deadline(self) -> float:
        """The earliest deadline of the RPC gets waiting (inf: none)."""
        return min((p.deadline for p in self.polls), default=math.inf)

    def end_polls(self, now: float) -> None:
        """Answer the RPC gets waiting that can be: woken, out of time, or the peer
        gone (empty) or the server stopping."""
        keep: list[LongPoll] = []
        b = self.broker
        for poll in self.polls:
            if not (poll.woken or now >= poll.deadline or self.eof or self.server.closing):
                keep.append(poll)
                continue
            r = poll.request
            cmd = r.command
            assert type(cmd) is Get and poll.waiter is not None
            assert poll.queue_state is not None and poll.handle is not None
            client = self.reads if cmd.open else None
            try:
                it = b.end_wait(poll.queue_state, poll.handle, cmd.reader or "", poll.waiter,
                                client=client, open_timeout_ms=cmd.open_timeout_ms,
                                take=not self.eof)
                items = [] if it is None else [it]
                if it is not None and cmd.max_items > 1:
                    items += b.take_more(poll.queue_state, poll.handle, cmd.reader or "",
                                         cmd.max_items - 1, cmd.max_bytes, len(it.data),
                                         client=client, open_timeout_ms=cmd.open_timeout_ms)
                reply: c.Reply = Items(items)
            except Exception as exc:
                reply = self.failure(r, exc)
            if not self.lost:
                self.answer(r, reply)
        self.polls = keep

    def cancel_long_poll(self) -> None:
        """The connection ends while gets wait in line: out of it, unanswered."""
        polls = self.polls if self.long_poll is None else [self.long_poll, *self.polls]
        self.long_poll, self.polls = None, []
        for poll in polls:
            if poll.waiter is not None:
                assert poll.queue_state is not None and poll.handle is not None
                self.broker.end_wait(poll.queue_state, poll.handle, "", poll.waiter,
                                     client=None, open_timeout_ms=None, take=False)
