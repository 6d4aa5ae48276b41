"""One connection, whatever its protocol: receive, parse, run a batch, send.

Owns the one receive loop (over any `trio.abc.Stream`, so TLS can go under it), the
batching (every complete request in a chunk is run before one send; consecutive puts
share one journal append and one fsync), long-poll gets with hang-up detection, the
connection's open-read ledger and monitor. A codec (`queued.core.*_commands`) turns
bytes into protocol-neutral requests and replies into bytes; `handlers` says what each
command does. Replies go out only once the confirms and aborts they acknowledge are
durable (one wait per batch, the writer's round shared by all); one that could not be
made durable is answered with an error instead (`handlers.not_durable`). Never parses
bytes itself and never touches the journal but through the broker.
"""

from __future__ import annotations

import logging
import math
from contextlib import suppress
from dataclasses import dataclass

import trio

from queued.broker.broker import Broker, PendingPut
from queued.core import commands as c
from queued.core.access import Grant
from queued.core.errors import ItemTooLargeError, ProtocolError
from queued.core.open_reads import OpenReads
from queued.core.queue import Item
from queued.core.stats import ProtocolStats
from queued.core.wire import ConnectionClosed
from queued.server.auth import Authenticator
from queued.server.handlers import HANDLERS, Hub, not_durable
from queued.server.transport import Transport, transport_of
from queued.storage.journal import Ticket

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

    def __init__(self, hub: Hub, broker: Broker, stream: trio.abc.Stream, codec: c.Codec, *,
                 name: str, max_item_size: int, counters: ServerCounters,
                 stats: ProtocolStats, guard: Guard | None = None,
                 started: float | None = None, transport: Transport | None = None) -> None:
        self.hub = hub
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

    def stop_if_idle(self) -> None:
        """Shutdown: stop reading; a batch that runs finishes, waiting gets (woken empty
        by the broker) still answer."""
        if not self.busy and self.receive_scope is not None:
            self.receive_scope.cancel()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._receive_loop()
            if self.hub.closing:
                return  # the broker answers waiting gets empty; they send themselves
            if self.eof and not self.lost:
                # The peer ended its side but may still read: its waiting gets answer now
                # (empty), as a long poll does on the other protocols.
                for scope in list(self.waits):
                    scope.cancel()
            else:
                nursery.cancel_scope.cancel()  # the peer is gone: so are its waiting gets

    async def _receive_loop(self) -> None:
        # One scope for the whole loop (not one per receive: they cost a few us each); it
        # is only ever cancelled while the loop waits for data (not `busy`), by shutdown
        # or by its deadline: the login's, or that of a request begun but not complete.
        with trio.CancelScope() as scope:
            self.receive_scope = scope
            guard = self.guard
            while not (self.done or self.eof or self.hub.closing):
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
        if scope.cancelled_caught and not self.hub.closing and not self.done:
            self._timed_out()

    def _timed_out(self) -> None:
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

    def owe(self, ticket: Ticket) -> None:
        """See handlers.Conn.owe."""
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
                                      "unauthenticated: log in first (see the README's "
                                      "Security section)"))
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
            elif isinstance(r, ProtocolError):
                log.debug("%s: %s", self.name, r)
                self.stats.protocol_errors += 1
                self.out += r.reply
                if r.close:
                    self.done = True
            elif isinstance(r, ConnectionClosed):
                if r.unparsed:
                    log.info("%s: closed mid-request, %d bytes dropped", self.name, r.unparsed)
                self.done = True
            if len(self.out) >= RECEIVE_SIZE:  # replies of a long batch go out as they grow
                await self._flush()

    async def _execute(self, req: c.Request) -> None:
        try:
            reply = await HANDLERS[type(req.command)](self, req.command, req)
        except Exception as exc:  # mapped to the protocol's reply, by kind
            reply = self._failure(req, exc)
        if self.owing:  # it confirmed or aborted: its reply waits for that (see _settle)
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
        encode = self.codec.encode
        for group, pending in begun:
            if not isinstance(pending, Exception):
                try:
                    await self.broker.end_put(pending)
                except Exception as exc:
                    pending = exc
            for r, put in group:
                if isinstance(pending, Exception):
                    self._answer(r, self._failure(r, pending))
                else:
                    self.out += encode(r, c.Stored(len(put.items)))

    async def _begin_put(self, group: list[tuple[c.Request, c.Put]]) -> PendingPut:
        first = group[0][1]
        items = first.items if len(group) == 1 else [d for _, put in group for d in put.items]
        limit = self.max_item_size
        if items and max(map(len, items)) > limit:
            raise ItemTooLargeError(f"item over the server's max_item_size ({limit} bytes)")
        b = self.broker
        return await b.begin_put(first.queue, items, expire_ms=first.expire_ms(b.clock()),
                                 flags=first.flags, delay_ms=first.delay_ms)

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
            if left <= 0 or self.hub.closing or self.done:  # done: the peer is lost
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


def _same_append(a: c.Put, b: c.Put) -> bool:
    """Puts that may share one journal append: same queue, expiry, flags and delay."""
    return (a.queue == b.queue and a.ttl_ms == b.ttl_ms and a.expire_at_ms == b.expire_at_ms
            and a.flags == b.flags and a.delay_ms == b.delay_ms)
