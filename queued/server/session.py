"""One connection, whatever its protocol: receive, parse, run a batch, send.

Two ways in: the reactor (queued.server.reactor) feeds a plain connection's bytes and runs
what needs no wait through the synchronous core (`run_nowait`, `end_pass`), handing the
rest to the connection's task (`serve_turns`); a TLS connection (or any other
`trio.abc.Stream`) runs the receive loop of its own task (`run`). Owns that loop, the
batching (every complete request in a chunk is run before one send; consecutive puts
share one journal append and one fsync), long-poll gets with hang-up detection, the
connection's open-read ledger and monitor. A codec (`queued.wire.*_commands`) turns
bytes into protocol-neutral requests and replies into bytes; `handlers` says what each
command does. Replies go out only once the confirms and aborts they acknowledge are
durable (one wait per batch, the writer's round shared by all); one that could not be
made durable is answered with an error instead (`handlers.not_durable`). Never parses
bytes itself and never touches the journal but through the broker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from queued.broker.broker import (
    AfterCommit,
    Broker,
    JoinedPut,
    JoinedPuts,
    MustWait,
    PendingPut,
)
from queued.broker.live_readers import LiveReader, Waiter
from queued.broker.queues import QueueState
from queued.errors import ItemTooLargeError, RemoteProtocolError
from queued.reader.open_reads import OpenReads
from queued.reader.state import Item
from queued.server.auth import Authenticator
from queued.server.handlers import HANDLERS, ServerControl, not_durable
from queued.server.transport import Transport, transport_of
from queued.stats import ProtocolStats
from queued.storage.journal import Ticket
from queued.wire import commands as c
from queued.wire.access import Grant
from queued.wire.parsing import ConnectionClosed

log = logging.getLogger("queued.server")

RECEIVE_SIZE = 256 * 1024
#: Requests parsed from the receive buffer before they are run (bounds the batch).
MAX_BATCH = 1024
#: Gets waiting at once in tasks of their own (RPC) on one connection; more are refused.
MAX_WAITING = 1024
#: The caps of a connection's parser until it has authenticated (credentials are short:
#: a stranger cannot make the server buffer a large item or frame).
LOGIN_LIMITS = c.Limits(max_line=1024, max_item_size=1024, max_frame=4096, max_batch=4)


@dataclass(slots=True)
class Guard:
    """What every session of a listener is held to: who may log in (None: no users,
    everyone may do everything) and the deadlines, in seconds."""

    login: Authenticator | None
    request_timeout: float
    auth_timeout: float
    limits: c.Limits  # the parser's caps once authenticated


class Turns(Protocol):
    """How the reactor (queued.server.reactor) hands a connection to its own task."""

    async def next(self) -> list[c.Parsed] | None:
        """Wait for the reactor to hand the connection over: the requests it left to
        run (which may wait), or None: the connection ends."""

    def give_back(self) -> None:
        """This turn is done: the reactor serves the connection again."""


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


@dataclass(slots=True)
class Owed:
    """A reply held back until the confirms and aborts it acknowledges are durable."""

    at: int  # where in `out` it goes
    request: c.Request
    reply: c.Reply
    tickets: list[Ticket]


@dataclass(slots=True)
class ServerCounters:
    bytes_read: int = 0
    bytes_written: int = 0


class Session:
    """A connection's loop; the listener's handler does the bookkeeping around it."""

    def __init__(self, server: ServerControl, broker: Broker, stream: trio.abc.Stream,
                 codec: c.Codec, *, name: str, max_item_size: int, counters: ServerCounters,
                 stats: ProtocolStats, guard: Guard | None = None,
                 started: float | None = None, transport: Transport | None = None) -> None:
        self.server = server
        self.broker = broker
        self.max_item_size = max_item_size
        self.counters = counters
        self.stream = stream
        self.transport = transport_of(stream) if transport is None else transport
        self.codec = codec
        self.ordered = codec.ordered
        self.name = name
        self.stats = stats
        self.reads = OpenReads(name)
        self.out = bytearray()
        self.sending = False  # a send is under way (see _flush)
        self.sent: trio.Event | None = None  # set when it ends, if anyone waits
        self.receive_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        self.busy = False
        self.done = False  # stop reading (quit, shutdown, or a closing error was answered)
        self.eof = False  # the peer ended its side; fed to the parser once
        self.lost = False  # sending failed: the peer is gone
        self.batches = 0  # batches run; a get that answers after its batch sends itself
        self.waiting = 0
        self.waits: set[trio.CancelScope] = set()  # of the gets waiting in tasks (RPC)
        self.guard = guard
        self.login = guard.login if guard is not None else None
        #: what this connection may do; None: everything (a server without users)
        self.grant: Grant | None = None
        #: when the login must be done by (trio time), while it is not
        self.login_by: float | None = None
        if self.login is not None:
            codec.set_limits(LOGIN_LIMITS)
            codec.set_logins(self.login.knows)
            now = trio.current_time() if started is None else started
            self.login_by = now + guard.auth_timeout  # type: ignore[union-attr]
        self.requests = 0  # parsed so far: progress, for request_timeout
        self.request_since = 0.0  # when the request now buffered in part began to arrive
        self.owing: list[Ticket] = []  # the tickets of the request being run
        self.owed: list[Owed] = []  # replies in `out`'s order, each waiting for its tickets
        #: the reactor's long poll this connection waits in (its later requests wait)
        self.long_poll: LongPoll | None = None
        #: the reactor's RPC gets waiting in their readers' lines (later requests go on)
        self.polls: list[LongPoll] = []
        #: how the reactor hears that a long poll can be answered (set by the reactor)
        self.notify: Callable[[], None] | None = None
        #: puts the reactor's pass began, answered by `end_pass` after its commit
        self.begun: list[tuple[list[tuple[c.Request, c.Put]],
                               PendingPut | JoinedPut | Exception]] = []
        #: the reactor's puts of a pass, joined across connections (set by the reactor)
        self.joined: JoinedPuts | None = None
        #: replies `run_nowait` lets pile up before it stops (the reactor sends them)
        self.out_cap = RECEIVE_SIZE
        #: a get found nothing while puts to its queue waited for the pass's commit: it
        #: runs again after it (once: `deferred` is the request)
        self.after_commit = False
        self.deferred: c.Request | None = None

    def stop_if_idle(self) -> None:
        """Shutdown: stop reading; a batch that runs finishes, waiting gets (woken empty
        by the broker) still answer."""
        if not self.busy and self.receive_scope is not None:
            self.receive_scope.cancel()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._receive_loop()
            self._end(nursery)

    def _end(self, nursery: trio.Nursery) -> None:
        """The connection stops reading: what becomes of the gets still waiting."""
        if self.server.closing:
            return  # the broker answers waiting gets empty; they send themselves
        if self.eof and not self.lost:
            # The peer ended its side but may still read: its waiting gets answer now
            # (empty), as a long poll does on the other protocols.
            for scope in list(self.waits):
                scope.cancel()
        else:
            nursery.cancel_scope.cancel()  # the peer is gone: so are its waiting gets

    async def serve_turns(self, turns: Turns) -> None:
        """The connection under the reactor: the reactor reads it and runs what needs no
        wait (`run_nowait`); this task runs the rest (a login, a long poll, a put that
        makes room, a rare command) when handed a turn, and ends when told to."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            while (rest := await turns.next()) is not None:
                self.busy = True
                try:
                    if self.begun:  # (ended by the pass unless its commit could not be)
                        begun, self.begun = self.begun, []
                        with trio.CancelScope(shield=True):
                            await self._end_puts(begun)  # type: ignore[arg-type]
                    if rest:
                        await self._run(rest)
                    await self._run_batch()
                    await self._flush()
                finally:
                    self.batches += 1
                    self.busy = False
                turns.give_back()
            self._end(nursery)

    async def _receive_loop(self) -> None:
        # One scope for the whole loop (not one per receive: they cost a few us each); it
        # is only ever cancelled while the loop waits for data (not `busy`), by shutdown
        # or by its deadline: the login's, or that of a request begun but not complete.
        with trio.CancelScope() as scope:
            self.receive_scope = scope
            guard = self.guard
            while not (self.done or self.eof or self.server.closing):
                fresh = False  # the bytes to come begin a request
                if self.login_by is not None:
                    deadline: float | None = self.login_by
                elif guard is not None and self.codec.pending():
                    deadline = self.request_since + guard.request_timeout
                else:
                    deadline, fresh = None, True
                if deadline is not None:
                    scope.deadline = deadline
                    await self._receive()
                    scope.deadline = math.inf
                else:
                    await self._receive()
                self.busy = True  # no checkpoint between the receive and here
                try:
                    seen = self.requests
                    await self._run_batch()
                    await self._flush()
                    if fresh or self.requests != seen:  # what is buffered began just now
                        self.request_since = trio.current_time()
                finally:
                    self.batches += 1
                    self.busy = False
        if scope.cancelled_caught and not self.server.closing and not self.done:
            self.time_out()

    def time_out(self) -> None:
        """The login, or a request begun, took too long: count it, log it, stop."""
        if self.login_by is not None:
            self.stats.auth_failures += 1
            log.info("%s: closed: no login within auth_timeout", self.name,
                     extra={"event": "auth_timeout", "peer": self.name})
        else:
            self.stats.request_timeouts += 1
            log.info("%s: closed: a request not complete within request_timeout (%d bytes "
                     "of it buffered)", self.name, self.codec.buffered_bytes(),
                     extra={"event": "request_timeout", "peer": self.name})
        self.done = True

    async def _receive(self) -> bytes:
        data = await self.transport.receive(RECEIVE_SIZE)
        self.counters.bytes_read += len(data)
        if data:
            self.codec.receive_data(data)
        elif not self.eof:  # the end of the stream is fed once, however often it is seen
            self.eof = True
            self.codec.receive_data(b"")
        return data

    async def _flush(self) -> None:
        """Send what the replies added so far; a lost peer ends the session quietly.

        One sender at a time (the loop, or a waiting get's task): a flag, and an event
        made only when someone has to wait (a trio.Lock would yield on every send).
        """
        while self.sending:
            if self.sent is None:
                self.sent = trio.Event()
            await self.sent.wait()
        if not (self.out or self.owed):
            return
        self.sending = True  # while the owed writes settle too: one sender at a time
        try:
            while self.owed:  # more may be owed while it waits
                await self._settle()
            if not self.out:
                return
            data = bytes(self.out)
            self.out.clear()  # in place: a waiting get's task may hold a reference
            if self.lost:
                return  # nobody to answer
            self.counters.bytes_written += len(data)
            await self.transport.send(data)
        except trio.BrokenResourceError as exc:
            log.debug("%s: connection lost: %s", self.name, exc)
            self.lost = self.done = True
            if not self.busy and self.receive_scope is not None:
                self.receive_scope.cancel()  # the loop waits for data that won't come
        finally:
            self.sending = False
            if self.sent is not None:
                self.sent.set()
                self.sent = None

    def reply_after(self, ticket: Ticket) -> None:
        """See handlers.Conn.reply_after."""
        if not ticket.event.is_set() or ticket.error is not None:
            self.owing.append(ticket)

    async def _settle(self) -> None:
        """Wait until every owed write is durable (the caller is the one sender), then put
        each held-back reply in its place in `out`: the reply, or, if a write it
        acknowledges failed, `handlers.not_durable`'s error (the broker has undone its
        confirms: the client may send them again). The connection stays open."""
        owed, self.owed = self.owed, []
        if not all(t.event.is_set() for o in owed for t in o.tickets):
            self.broker.write_ready()  # the batch's confirms, in one write if no fsync
        for o in owed:
            for ticket in o.tickets:
                if not ticket.event.is_set():
                    await ticket.event.wait()
        self._place_owed(owed)

    def _place_owed(self, owed: list[Owed]) -> None:
        """Owed writes done (their tickets set): each held-back reply in its place."""
        out, start, added = self.out, 0, 0
        parts: list[bytes | bytearray] = []
        for o in owed:
            reply = o.reply
            error = next((t.error for t in o.tickets if t.error is not None), None)
            if error is not None:
                log.warning("%s: %s not made durable: %s", self.name, o.request.name, error)
                reply = not_durable(self, o.request, reply, error)
            encoded = self.codec.encode(o.request, reply)
            parts += (out[start:o.at], encoded)
            start, added = o.at, added + len(encoded)
        parts.append(out[start:])
        out[:] = b"".join(parts)  # in place: a waiting get's task may hold a reference
        for o in self.owed:  # owed while this waited: behind all of these in `out`
            o.at += added

    # -- one batch ---------------------------------------------------------------------------

    async def _run_batch(self) -> None:
        """Run every complete request buffered, in order; replies collect in `out`.

        Loops because a long poll reads ahead (see `_watching`): requests that arrived
        while it waited are run before the session waits for the network again.
        """
        while not self.done:
            if self.login_by is not None:
                if not await self._log_in():
                    return
                continue
            requests = self._parse()
            if not requests:
                return
            self.requests += len(requests)
            await self._run(requests)
            if len(self.out) >= RECEIVE_SIZE:
                await self._flush()

    def _parse(self) -> list[c.Parsed]:
        return self.codec.next_requests(MAX_BATCH)

    # -- authentication ------------------------------------------------------------------------

    async def _log_in(self) -> bool:
        """Run the next request of a connection that has not authenticated: its login,
        or the refusal of anything else (which closes). False when none is buffered."""
        parsed = self.codec.next_requests(1)
        if not parsed:
            return False
        self.requests += 1
        r = parsed[0]
        if type(r) is not c.Request:
            await self._run(parsed)  # a protocol error or the end: answered, then close
            self.done = True
            return True
        auth = self.codec.auth_of(r)
        if auth is None:
            self.stats.auth_failures += 1
            log.info("%s: %s before authenticating: closed", self.name, r.name,
                     extra={"event": "unauthenticated", "peer": self.name})
            self._answer(r, c.Failure(c.ErrorKind.UNAUTHENTICATED,
                                      "unauthenticated: log in first (see "
                                      "docs/security.md)"))
            self.done = True
            return True
        self._answer(r, await self.authenticate(auth))
        return True

    async def authenticate(self, auth: c.Auth) -> c.Reply:
        """Log this connection in as `auth.user` (again, for an Auth command later);
        wrong credentials close it."""
        login = self.login
        if login is None:  # no users: everyone may do everything
            return c.Value(True)
        grant = await login.login(auth.user, auth.password, self.name)
        if grant is None:
            self.stats.auth_failures += 1
            self.done = True
            return c.Failure(c.ErrorKind.AUTH_FAILED, "authentication failure")
        if self.login_by is not None:
            self.login_by = None
            assert self.guard is not None
            self.codec.set_limits(self.guard.limits)
        self.grant = grant
        log.debug("%s: authenticated as %r", self.name, grant.user)
        return c.Value(True)

    def _deny(self, r: c.Request, why: str) -> None:
        self.stats.permission_denied += r.count
        log.debug("%s: %s: %s", self.name, r.name, why)
        self._answer(r, c.Failure(c.ErrorKind.PERMISSION_DENIED, why))

    async def _run(self, requests: list[c.Parsed]) -> None:
        i, n = 0, len(requests)
        while i < n and not self.done:
            r = requests[i]
            grant = self.grant  # as of here: a login earlier in the batch may have changed it
            if grant is not None and type(r) is c.Request and (
                    why := grant.denied(r.command)) is not None:
                i += 1
                self._deny(r, why)
                continue
            if type(r) is c.Request and type(r.command) is c.Put:
                run: list[tuple[c.Request, c.Put]] = []
                while i < n and isinstance(ri := requests[i], c.Request) and isinstance(
                        put := ri.command, c.Put) and (
                            grant is None or grant.denied(put) is None):
                    run.append((ri, put))
                    i += 1
                await self._puts(run)
                continue
            i += 1
            if type(r) is c.Request:
                self.stats.count(r.name, r.count)
                await self._execute(r)
            else:
                self._refused(r)
            if len(self.out) >= RECEIVE_SIZE:  # replies of a long batch go out as they grow
                await self._flush()

    async def _execute(self, req: c.Request) -> None:
        try:
            reply = await HANDLERS[type(req.command)](self, req.command, req)
        except Exception as exc:  # mapped to the protocol's reply, by kind
            reply = self._failure(req, exc)
        self._reply(req, reply)

    def _reply(self, req: c.Request, reply: c.Reply | None) -> None:
        """A request's reply into `out`, or held back while the confirms and aborts it
        made are not durable (see `_settle`)."""
        if self.owing:
            owing, self.owing = self.owing, []
            if reply is not None:
                self.owed.append(Owed(len(self.out), req, reply, owing))
                if type(reply) is c.Failure and reply.kind in self.codec.closing:
                    self.done = True
        elif reply is not None:
            self.out += self.codec.encode(req, reply)
            if type(reply) is c.Failure and reply.kind in self.codec.closing:
                self.done = True

    def _answer(self, req: c.Request, reply: c.Reply) -> None:
        """Add a reply (the hot path of `_execute` does the same inline)."""
        self.out += self.codec.encode(req, reply)
        if type(reply) is c.Failure and reply.kind in self.codec.closing:
            self.done = True

    def _failure(self, req: c.Request, exc: Exception) -> c.Failure:
        failure = c.failure_of(exc)
        if failure is None:  # a bug: say where, keep the connection
            log.error("%s: %s failed", self.name, req.name, exc_info=exc)
            return c.Failure(c.ErrorKind.SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        if failure.kind is c.ErrorKind.SERVER_ERROR:
            log.warning("%s: %s failed: %s", self.name, req.name, failure.message)
        return failure

    # -- puts ------------------------------------------------------------------------------------

    async def _puts(self, requests: list[tuple[c.Request, c.Put]]) -> None:
        """Begin every put of the run, then wait for all: one write, one fsync.

        Consecutive puts to the same queue with the same expiry and flags become one journal
        append (one id range, one wake-up); if that append is refused, they are retried one
        by one (a joined request as the requests it stands for) so each gets its own
        answer. Every begun put must be ended: shielded, unless the run is one append whose
        write is already done (the common case under fsync never: nothing left to wait for,
        and a cancelled begin begins nothing; what a begin may wait for, making room, is
        shielded where it happens), as a cancel scope costs a tenth of a put.
        """
        n = sum(r.count for r, _ in requests)
        self.broker.counters.cmd_set += n
        self.stats.count(requests[0][0].name, n)  # one protocol: one put name
        groups: list[list[tuple[c.Request, c.Put]]] = []
        for entry in requests:
            put = entry[1]
            if groups and _same_append(groups[-1][0][1], put):
                groups[-1].append(entry)
            else:
                groups.append([entry])
        failed: Exception | None = None  # the one group's begin, tried unshielded
        if len(groups) == 1:
            try:
                pending = await self._begin_put(groups[0])
            except Exception as exc:
                failed = exc  # answered (or retried one by one) below, under the shield
            else:
                if pending.ticket is None or pending.ticket.event.is_set():
                    await self._end_puts([(groups[0], pending)])  # does not yield
                else:
                    with trio.CancelScope(shield=True):
                        await self._end_puts([(groups[0], pending)])
                return
        with trio.CancelScope(shield=True):
            begun: list[tuple[list[tuple[c.Request, c.Put]], PendingPut | Exception]] = []
            for group in groups:
                try:
                    if failed is not None:
                        raise failed
                    begun.append((group, await self._begin_put(group)))
                except Exception as exc:
                    if len(group) == 1 and group[0][0].count == 1:
                        begun.append((group, exc))
                        continue
                    for entry in _one_by_one(group):
                        try:
                            begun.append(([entry], await self._begin_put([entry])))
                        except Exception as exc1:
                            begun.append(([entry], exc1))
            await self._end_puts(begun)

    async def _end_puts(
        self, begun: list[tuple[list[tuple[c.Request, c.Put]], PendingPut | Exception]],
    ) -> None:
        """Wait for each begun put to be durable (in order), and answer its requests."""
        for group, pending in begun:
            if not isinstance(pending, Exception):
                try:
                    await self.broker.end_put(pending)
                except Exception as exc:
                    pending = exc
            self._answer_puts(group, pending)

    def _answer_puts(self, group: list[tuple[c.Request, c.Put]],
                     result: PendingPut | Exception | None,
                     answer: tuple[int, int, bool] | None = None) -> None:
        """A put's replies: stored (`result` ended well), or its failure. `answer` (first
        id, count, duplicate): a joined part's own, for a put with a key."""
        encode = self.codec.encode
        for r, put in group:
            if isinstance(result, Exception):
                self._answer(r, self._failure(r, result))
                continue
            if answer is None and result is not None:
                answer = result.answer  # (a put with a producer or key: alone in its group)
            if answer is not None:
                self.out += encode(r, c.ProducerStored(answer[1], answer[0], answer[2]))
            else:
                self.out += encode(r, c.Stored(len(put.items)))

    async def _begin_put(self, group: list[tuple[c.Request, c.Put]]) -> PendingPut:
        queue, items, expire_ms, flags, delay_ms, headers = self._put_of(group)
        first = group[0][1]
        return await self.broker.begin_put(queue, items, expire_ms=expire_ms, flags=flags,
                                           delay_ms=delay_ms, producer=first.producer,
                                           sequence=first.sequence, headers=headers,
                                           key=first.key)

    def _put_of(self, group: list[tuple[c.Request, c.Put]],
                ) -> tuple[str, Sequence[bytes], int | None, int, int, Sequence[bytes] | None]:
        """A group's put as the broker takes it: queue, items, expiry, flags, delay,
        headers (a block per item, or None)."""
        first = group[0][1]
        items = first.items if len(group) == 1 else [d for _, put in group for d in put.items]
        headers = first.headers
        if len(group) > 1 and any(put.headers is not None for _, put in group):
            headers = [h for _, put in group
                       for h in (put.headers or [b""] * len(put.items))]
        limit = self.max_item_size
        if items and max(map(len, items)) > limit:
            raise ItemTooLargeError(f"item over the server's max_item_size ({limit} bytes)")
        expire_ms = None if first.ttl_ms is None and first.expire_at_ms is None else (
            first.expire_ms(self.broker.clock()))
        return first.queue, items, expire_ms, first.flags, first.delay_ms, headers

    # -- gets (see handlers.Conn) --------------------------------------------------------------

    async def take(self, cmd: c.Get) -> list[Item]:
        """A get answered in place. A long poll also watches the stream, so a client that
        hangs up while waiting is noticed at once and takes no item with it; after the
        peer's end of stream a get does not wait (its reply still goes out)."""
        timeout = 0 if self.eof else cmd.timeout_ms
        item: Item | None = None
        error: Exception | None = None
        if timeout <= 0:
            if cmd.max_items > 1:  # pipelined gets joined (Request.count): each wants one
                return await self.broker.get_many(
                    cmd.queue, cmd.reader, cmd.max_items, client=self.reads, open=cmd.open,
                    open_timeout_ms=cmd.open_timeout_ms, separate=True)
            item = await self.broker.get(cmd.queue, cmd.reader, client=self.reads,
                                         open=cmd.open, peek=cmd.peek,
                                         open_timeout_ms=cmd.open_timeout_ms)
            return [] if item is None else [item]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_for_eof, nursery.cancel_scope)
            try:
                item = await self.broker.get(cmd.queue, cmd.reader, timeout_ms=timeout,
                                             client=self.reads, open=cmd.open, peek=cmd.peek,
                                             open_timeout_ms=cmd.open_timeout_ms)
            except Exception as exc:  # re-raised bare, not wrapped in an ExceptionGroup
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return [] if item is None else [item]

    async def _watch_for_eof(self, scope: trio.CancelScope) -> None:
        # Bytes that arrive meanwhile are pipelined requests: hand them to the parser
        # (its caps bound them) and stop reading once a batch's worth is buffered.
        while self.codec.buffered_bytes() < RECEIVE_SIZE:
            if not await self._receive():
                scope.cancel()
                return
        await trio.sleep_forever()

    async def get_later(self, cmd: c.Get, req: c.Request) -> c.Reply | None:
        """A get whose reply is matched by id: if it has to wait, it moves to a task of
        its own (started when it answers or begins to wait) and later requests go on."""
        if cmd.timeout_ms <= 0:
            return c.Items(await self._get_many(cmd))
        if self.waiting >= MAX_WAITING:
            return c.Failure(c.ErrorKind.BUSY,
                             f"{MAX_WAITING} gets are already waiting on this connection")
        assert self.nursery is not None
        await self.nursery.start(self._waiting_get, cmd, req)
        return None

    async def _get_many(self, cmd: c.Get,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                        ) -> list[Item]:
        return await self.broker.get_many(
            cmd.queue, cmd.reader, cmd.max_items, timeout_ms=cmd.timeout_ms,
            client=self.reads, open=cmd.open, open_timeout_ms=cmd.open_timeout_ms,
            max_bytes=cmd.max_bytes, task_status=task_status)

    async def _waiting_get(self, cmd: c.Get, req: c.Request,
                           task_status: trio.TaskStatus[None]) -> None:
        batch = self.batches
        self.waiting += 1
        reply: c.Reply
        items: list[Item] = []
        scope = trio.CancelScope()  # cancelled: answered empty (see run)
        self.waits.add(scope)
        try:
            with scope:
                items = await self._get_many(cmd, task_status)
            reply = c.Items(items)
        except Exception as exc:
            reply = self._failure(req, exc)
            with suppress(RuntimeError):  # failed before it started: report started now
                task_status.started()
        finally:
            self.waiting -= 1
            self.waits.discard(scope)
        self._answer(req, reply)
        if batch != self.batches or not self.busy:
            await self._flush()  # answered after its batch went out: send it now

    async def monitor(self, cmd: c.Monitor, req: c.Request) -> c.Reply:
        """Send items as they arrive (open reads, confirmed with `confirm`) until time is up."""
        deadline = trio.current_time() + cmd.timeout_ms / 1000
        sent = 0
        while cmd.max_items is None or sent < cmd.max_items:
            left = deadline - trio.current_time()
            if left <= 0 or self.server.closing or self.done:  # done: the peer is lost
                break
            items = await self.take(c.Get(cmd.queue, cmd.reader,
                                          timeout_ms=max(1, int(left * 1000)), open=True))
            if not items:
                break
            self.out += self.codec.encode_item(req, items[0])
            sent += 1
            await self._flush()
        return c.Done()


    # -- the reactor's pass (queued.server.reactor) ----------------------------------------

    def run_nowait(self, requests: list[c.Parsed]) -> int:
        """Run `requests` in order while each can run without waiting; the index of the
        first that cannot (len(requests): all ran). Puts are begun (`begun`), not ended:
        `end_pass` answers them after the pass's commit, and no other request of this
        connection runs before that (so it sees them ended, as on the task path). A
        request stopped at is run by `serve_turns`, or by the next pass when it only
        waits for the commit (`begun` not empty). A get whose confirm ran before its
        take had to wait is rewritten in `requests` so the confirm does not run twice.
        It also stops once `out` holds `out_cap` bytes (the reactor sends them first)."""
        i, n = 0, len(requests)
        cap = self.out_cap
        while i < n and not self.done:
            if len(self.out) >= cap:
                return i
            r = requests[i]
            if type(r) is not c.Request:
                if self.begun:
                    return i  # (its reply goes after theirs)
                i += 1
                self._refused(r)
                continue
            grant = self.grant
            cmd = r.command
            if type(cmd) is c.Put:
                run: list[tuple[c.Request, c.Put]] = []
                j = i
                while j < n and type(rj := requests[j]) is c.Request and type(
                        put := rj.command) is c.Put and (grant is None or grant.denied(put)
                                                         is None):
                    run.append((rj, put))
                    j += 1
                if not run:  # refused by the grant
                    if self.begun:
                        return i
                    i += 1
                    self._deny(r, grant.denied(cmd) or "")  # type: ignore[union-attr]
                    continue
                began = self._begin_puts_nowait(run)
                i += began
                if began < len(run):
                    return i
                continue
            if self.begun:
                return i
            if grant is not None and (why := grant.denied(cmd)) is not None:
                i += 1
                self._deny(r, why)
                continue
            t = type(cmd)
            if t is c.Get:
                if not self._get_nowait(requests, i):
                    return i
            elif t is c.Confirm or t is c.Abort or t is c.Touch:
                self.stats.count(r.name, r.count)
                try:
                    b = self.broker
                    if t is c.Confirm:
                        count = b.confirm(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                          cmd.count, cmd.ids, owe=self.reply_after)  # type: ignore[union-attr]
                    elif t is c.Abort:
                        count = b.abort(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                        ids=cmd.ids, owe=self.reply_after,  # type: ignore[union-attr]
                                        delay_ms=cmd.delay_ms)  # type: ignore[union-attr]
                    else:  # touch / extend (handlers.touch): a lease moved, nothing journaled
                        count = b.extend(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                         cmd.ids, cmd.ms)  # type: ignore[union-attr]
                    self._reply(r, c.Count(count))
                except Exception as exc:
                    self._reply(r, self._failure(r, exc))
            else:
                return i
            i += 1
        return i

    def _refused(self, r: c.Parsed) -> None:
        """A protocol error's reply, or the end of the stream."""
        if isinstance(r, RemoteProtocolError):
            log.debug("%s: %s", self.name, r)
            self.stats.protocol_errors += 1
            self.out += r.reply
            if r.close:
                self.done = True
        elif isinstance(r, ConnectionClosed):
            if r.unparsed:
                log.info("%s: closed mid-request, %d bytes dropped", self.name, r.unparsed)
            self.done = True

    def _begin_puts_nowait(self, run: list[tuple[c.Request, c.Put]]) -> int:
        """Begin the run's puts, one append per group of consecutive puts that may share
        one; the number of requests begun (fewer: the next group must wait, or is a
        joined one that failed and is retried one by one on the task path)."""
        began = 0
        b = self.broker
        n_run = len(run)
        while began < n_run:
            entry = run[began]
            first = entry[1]
            end = began + 1
            while end < n_run and _same_append(first, run[end][1]):
                end += 1
            group = run[began:end] if end - began > 1 else [entry]
            result: PendingPut | JoinedPut | Exception
            producer, key = first.producer, first.key
            alone = producer is not None  # (its mark is its own: never joined)
            if alone and any(type(p) is JoinedPut for _, p in self.begun):
                # Not begun before the joined puts sent ahead of it (begun after every
                # connection ran): it waits for the next pass, so ids keep the order sent.
                return began
            try:
                queue, items, expire_ms, flags, delay_ms, headers = self._put_of(group)
                joined = self.joined
                if not alone and joined is not None and joined.can_join(queue):
                    # (a key is checked and reserved here, in the pass: its second put
                    # in the pass, from any connection, finds it)
                    result = joined.add(queue, items, expire_ms, flags, delay_ms, headers, key)
                else:  # (a put with a producer is never joined: its mark is its own)
                    result = b.begin_put_nowait(queue, items, expire_ms=expire_ms,
                                                flags=flags, delay_ms=delay_ms,
                                                producer=producer, sequence=first.sequence,
                                                headers=headers, key=key)
            except trio.WouldBlock:
                return began
            except Exception as exc:
                if len(group) > 1 or group[0][0].count > 1:
                    return began
                result = exc
            n = sum(r.count for r, _ in group)
            b.counters.cmd_set += n
            self.stats.count(group[0][0].name, n)
            self.begun.append((group, result))
            began = end
        return began

    def _get_nowait(self, requests: list[c.Parsed], i: int) -> bool:
        """handlers.get without waiting; False (nothing done but a confirm, which is
        then rewritten out of the request) when it must wait."""
        r = requests[i]
        assert type(r) is c.Request
        cmd = r.command
        assert type(cmd) is c.Get
        if cmd.peek or cmd.reject:
            return False  # (handlers.get)
        b, reads, reader = self.broker, self.reads, cmd.reader or ""
        try:
            if cmd.abort:
                b.abort(reads, cmd.queue, reader, owe=self.reply_after, delay_ms=cmd.delay_ms)
                reply: c.Reply = c.Done()
            elif cmd.close and not cmd.open:
                b.confirm(reads, cmd.queue, reader, owe=self.reply_after)
                reply = c.Done()
            else:
                if cmd.close:
                    b.confirm(reads, cmd.queue, reader, owe=self.reply_after)
                    cmd = replace(cmd, close=False)
                    requests[i] = c.Request(cmd, r.context, r.name, r.count)
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
                assert type(ri) is c.Request
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
            reply = self._failure(r, exc)
        self.stats.count(r.name, r.count)
        self._reply(r, reply)
        return True

    def _gets_nowait(self, requests: list[c.Parsed], i: int) -> bool:
        """Pipelined plain gets of one key (a joined Get, one item each): answered as far
        as `out_cap` leaves room; the rest stay in `requests` for later (False)."""
        r = requests[i]
        assert type(r) is c.Request and type(r.command) is c.Get
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
            self._reply(r, c.Items(items))
            return True
        if later:  # the rest after the pass's commit, which brings more items
            self.after_commit = True
        if not k:
            self.deferred = r
            return False
        head = c.Request(replace(cmd, max_items=k), r.context, r.name, k)
        self.stats.count(head.name, k)
        self._reply(head, c.Items(items))
        left = cmd.max_items - k
        requests[i] = c.Request(replace(cmd, max_items=left), r.context, r.name, left)
        if later:
            self.deferred = requests[i]  # type: ignore[assignment]
        return False

    def _take_nowait(self, cmd: c.Get, defer: JoinedPuts | None) -> c.Reply:
        b = self.broker
        if not self.ordered:
            return c.Items(b.get_many_nowait(
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
        return c.Items(items)

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
        assert type(cmd) is c.Get and poll.queue_state is not None and poll.handle is not None
        b = self.broker
        try:
            it = b.end_wait(poll.queue_state, poll.handle, cmd.reader or "", poll.waiter,
                            client=self.reads if cmd.open else None,
                            open_timeout_ms=cmd.open_timeout_ms,
                            take=not self.eof)  # (a peer that left takes no item with it)
            reply = self._line_safe(cmd, [] if it is None else [it])
        except Exception as exc:
            reply = self._failure(r, exc)
        self.stats.count(r.name, r.count)
        self.owing = poll.owing
        self._reply(r, reply)
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
            assert type(cmd) is c.Get and poll.waiter is not None
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
                reply: c.Reply = c.Items(items)
            except Exception as exc:
                reply = self._failure(r, exc)
            if not self.lost:
                self._answer(r, reply)
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

    def end_pass(self) -> bool:
        """After the pass's commit (and `JoinedPuts.end_all`): answer the begun puts,
        place the replies held back for confirms and aborts. False when something is
        still not durable (a write the commit did not make): `serve_turns` then waits
        for it."""
        for _, p in self.begun:
            if type(p) is PendingPut and p.ticket is not None and not p.ticket.event.is_set():
                return False
            if type(p) is JoinedPut and not p.ended:
                return False
        if self.owed and any(not t.event.is_set() for o in self.owed for t in o.tickets):
            return False
        begun, self.begun = self.begun, []
        for group, pending in begun:
            result: PendingPut | Exception | None
            answer = None
            if type(pending) is JoinedPut:
                result = pending.error or pending.pending
                answer = pending.answer
            elif type(pending) is PendingPut:
                result = pending
                try:
                    self.broker.end_put_nowait(pending)
                except Exception as exc:
                    result = exc
            else:
                result = pending  # type: ignore[assignment]
            self._answer_puts(group, result, answer)
        if self.owed:
            owed, self.owed = self.owed, []
            self._place_owed(owed)
        return True

def _one_by_one(group: list[tuple[c.Request, c.Put]]) -> list[tuple[c.Request, c.Put]]:
    """A group of puts as single wire requests (joined requests split)."""
    out: list[tuple[c.Request, c.Put]] = []
    for r, _ in group:
        out.extend((part, part.command) for part in r.split())  # type: ignore[misc]
    return out


def _same_append(a: c.Put, b: c.Put) -> bool:
    """Puts that may share one journal append: same queue, expiry, flags and delay, and
    no producer or key (a put with a producer has its own append, its mark after its items;
    a keyed put is a part of its own in the pass's joined append, its key checked alone)."""
    return (a.queue == b.queue and a.ttl_ms == b.ttl_ms and a.expire_at_ms == b.expire_at_ms
            and a.flags == b.flags and a.delay_ms == b.delay_ms and a.producer is None
            and b.producer is None and a.key is None and b.key is None)
