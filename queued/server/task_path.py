"""A connection's own task: the turns the reactor hands it (`serve_turns`), the login,
and what may wait: a batch run in order (`_run`), puts that make room or wait
for their write (`_puts`), long-poll gets that watch the stream for a hang-up, `monitor`,
the send (`_flush`) and the wait for the writes that held-back replies acknowledge
(`_settle`). Also the values both paths share: the listener's `Guard`, the connection's
`ServerCounters`, a held-back reply (`Owed`), the batch limits.

A mixin of `queued.server.session.Session`, which owns the connection's state, the
replies (`reply`, `answer`, `failure`, ...) and the reactor's synchronous core
(`run_nowait`, `end_pass`). Never parses bytes itself and never touches the journal but
through the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

import trio

from queued.broker.broker import Broker, JoinedPut, PendingPut
from queued.reader.open_reads import OpenReads
from queued.reader.state import Item
from queued.server.auth import Authenticator
from queued.server.handlers import HANDLERS, ServerControl
from queued.server.transport import Transport
from queued.stats import ProtocolStats
from queued.storage.journal import Ticket
from queued.wire import commands as c
from queued.wire.access import Grant

log = logging.getLogger("queued.server")

RECEIVE_SIZE = 256 * 1024
#: Requests parsed from the receive buffer before they are run (bounds the batch).
MAX_BATCH = 1024
#: Gets waiting at once in tasks of their own (RPC) on one connection; more are refused.
MAX_WAITING = 1024


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


class TaskPath:
    """The task half of a `Session` (see the module docstring)."""

    # The session's own state (set by Session.__init__) that the task path uses.
    server: ServerControl
    broker: Broker
    codec: c.Codec
    transport: Transport
    stats: ProtocolStats
    counters: ServerCounters
    reads: OpenReads
    name: str
    ordered: bool
    max_item_size: int
    guard: Guard | None
    login: Authenticator | None
    grant: Grant | None
    login_by: float | None
    out: bytearray
    owed: list[Owed]
    begun: list[tuple[list[tuple[c.Request, c.Put]], PendingPut | JoinedPut | Exception]]
    sending: bool
    sent: trio.Event | None
    nursery: trio.Nursery | None
    busy: bool
    done: bool
    eof: bool
    lost: bool
    batches: int
    waiting: int
    waits: set[trio.CancelScope]
    requests: int

    # The session's replies, defined by queued.server.session's Session. Declared as
    # methods rather than under TYPE_CHECKING so the task path compiles with mypyc as
    # the session's base class.
    def reply(self, req: c.Request, reply: c.Reply | None) -> None:
        raise NotImplementedError

    def answer(self, req: c.Request, reply: c.Reply) -> None:
        raise NotImplementedError

    def failure(self, req: c.Request, exc: Exception) -> c.Failure:
        raise NotImplementedError

    def deny(self, r: c.Request, why: str) -> None:
        raise NotImplementedError

    def refused(self, r: c.Parsed) -> None:
        raise NotImplementedError

    def answer_puts(self, group: list[tuple[c.Request, c.Put]],
                    result: PendingPut | Exception | None,
                    answer: tuple[int, int, bool] | None = None) -> None:
        raise NotImplementedError

    def put_of(self, group: list[tuple[c.Request, c.Put]],
               ) -> tuple[str, Sequence[bytes], int | None, int, int,
                          Sequence[bytes] | None]:
        raise NotImplementedError

    def place_owed(self, owed: list[Owed]) -> None:
        raise NotImplementedError

    def reply_after(self, ticket: Ticket) -> None:
        raise NotImplementedError

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

    async def _receive(self) -> bytes | bytearray:
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
        finally:
            self.sending = False
            if self.sent is not None:
                self.sent.set()
                self.sent = None

    async def _settle(self) -> None:
        """Wait until every owed write is durable (the caller is the one sender), then put
        each held-back reply in its place in `out`: the reply, or, if a write it
        acknowledges failed, `handlers.not_durable`'s error (the broker has undone its
        confirms: the client may send them again). The connection stays open."""
        owed, self.owed = self.owed, []
        if not all(t.done for o in owed for t in o.tickets):
            self.broker.write_ready()  # the batch's confirms, in one write if no fsync
        for o in owed:
            for ticket in o.tickets:
                await ticket.wait()
        self.place_owed(owed)

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
            self.answer(r, c.Failure(c.ErrorKind.UNAUTHENTICATED,
                                      "unauthenticated: log in first (see "
                                      "docs/security.md)"))
            self.done = True
            return True
        self.answer(r, await self.authenticate(auth))
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

    async def _run(self, requests: list[c.Parsed]) -> None:
        i, n = 0, len(requests)
        while i < n and not self.done:
            r = requests[i]
            grant = self.grant  # as of here: a login earlier in the batch may have changed it
            if grant is not None and type(r) is c.Request and (
                    why := grant.denied(r.command)) is not None:
                i += 1
                self.deny(r, why)
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
                self.refused(r)
            if len(self.out) >= RECEIVE_SIZE:  # replies of a long batch go out as they grow
                await self._flush()

    async def _execute(self, req: c.Request) -> None:
        try:
            reply = await HANDLERS[type(req.command)](self, req.command, req)
        except Exception as exc:  # mapped to the protocol's reply, by kind
            reply = self.failure(req, exc)
        self.reply(req, reply)

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
            if groups and same_append(groups[-1][0][1], put):
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
                if pending.ticket is None or pending.ticket.done:
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
            self.answer_puts(group, pending)

    async def _begin_put(self, group: list[tuple[c.Request, c.Put]]) -> PendingPut:
        queue, items, expire_ms, flags, delay_ms, headers = self.put_of(group)
        first = group[0][1]
        return await self.broker.begin_put(queue, items, expire_ms=expire_ms, flags=flags,
                                           delay_ms=delay_ms, producer=first.producer,
                                           sequence=first.sequence, headers=headers,
                                           key=first.key)

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
            reply = self.failure(req, exc)
            with suppress(RuntimeError):  # failed before it started: report started now
                task_status.started()
        finally:
            self.waiting -= 1
            self.waits.discard(scope)
        self.answer(req, reply)
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


def _one_by_one(group: list[tuple[c.Request, c.Put]]) -> list[tuple[c.Request, c.Put]]:
    """A group of puts as single wire requests (joined requests split)."""
    out: list[tuple[c.Request, c.Put]] = []
    for r, _ in group:
        out.extend((part, part.command) for part in r.split())  # type: ignore[misc]
    return out


def same_append(a: c.Put, b: c.Put) -> bool:
    """Puts that may share one journal append: same queue, expiry, flags and delay, and
    no producer or key (a put with a producer has its own append, its mark after its items;
    a keyed put is a part of its own in the pass's joined append, its key checked alone)."""
    return (a.queue == b.queue and a.ttl_ms == b.ttl_ms and a.expire_at_ms == b.expire_at_ms
            and a.flags == b.flags and a.delay_ms == b.delay_ms and a.producer is None
            and b.producer is None and a.key is None and b.key is None)
