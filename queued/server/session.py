"""One connection, whatever its protocol: its state, its replies, and the reactor's
synchronous core.

The reactor (queued.server.reactor) feeds a connection's bytes (plain or decrypted) and
runs what needs no wait through the synchronous core (`run_nowait`, `end_pass`), handing
the rest to the connection's task (`serve_turns`). That task path is the chain of bases
`TaskBase` (queued.server.task_base: the send, the wait for owed writes) -> `TaskGets`
(queued.server.task_gets: long-poll gets with hang-up detection, monitor) -> `TaskPath`
(queued.server.task_path: the turns, the login, batches in order, puts that wait); the
pass's gets and long polls are `PassGets` (queued.server.pass_gets), the last base.
This module owns the connection's state and open-read ledger, the core (puts, confirms,
the answers after the commit), and the replies: a codec (`queued.wire.*_commands`) turns
bytes into protocol-neutral requests and replies into bytes; `handlers` says what each
command does. Replies go out only once the confirms and
aborts they acknowledge are durable (one wait per batch, the writer's round shared by
all); one that could not be made durable is answered with an error instead
(`handlers.not_durable`). Never parses bytes itself and never touches the journal but
through the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from queued.broker.broker import (
    Broker,
    JoinedPut,
    JoinedPuts,
    PendingPut,
)
from queued.errors import ItemTooLargeError, RemoteProtocolError
from queued.reader.open_reads import OpenReads
from queued.server.handlers import ServerControl, not_durable
from queued.server.pass_gets import LongPoll, PassGets
from queued.server.task_base import RECEIVE_SIZE, Guard, Owed, ServerCounters
from queued.server.task_path import same_append
from queued.server.transport import Transport
from queued.stats import ProtocolStats
from queued.storage.journal import Ticket
from queued.wire import commands as c
from queued.wire.access import Grant

# (named directly where compiled code tests a type: `c.Put` as a value is a look-up in the
# module at each use, `Put` a static reference)
from queued.wire.commands import (
    Abort,
    Confirm,
    Failure,
    Get,
    ProducerStored,
    Put,
    Request,
    Stored,
    Touch,
)
from queued.wire.parsing import ConnectionClosed

log = logging.getLogger("queued.server")

#: The caps of a connection's parser until it has authenticated (credentials are short:
#: a stranger cannot make the server buffer a large item or frame).
LOGIN_LIMITS = c.Limits(max_line=1024, max_item_size=1024, max_frame=4096, max_batch=4)


class Session(PassGets):
    """A connection's loop; the listener's handler does the bookkeeping around it."""

    def __init__(self, server: ServerControl, broker: Broker, stream: trio.abc.Stream,
                 codec: c.Codec, *, name: str, max_item_size: int, counters: ServerCounters,
                 stats: ProtocolStats, guard: Guard | None = None,
                 transport: Transport, started: float | None = None) -> None:
        self.server = server
        self.broker = broker
        self.max_item_size = max_item_size
        self.counters = counters
        self.stream = stream
        self.transport = transport
        self.codec = codec
        self.ordered = codec.ordered
        self.name = name
        self.stats = stats
        self.reads = OpenReads(name)
        self.out = bytearray()
        self.sending = False  # a send is under way (see flush)
        self.sent: trio.Event | None = None  # set when it ends, if anyone waits
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

    def reply_after(self, ticket: Ticket) -> None:
        """See handlers.Conn.reply_after."""
        if not ticket.done or ticket.error is not None:
            self.owing.append(ticket)

    def place_owed(self, owed: list[Owed]) -> None:
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

    def deny(self, r: c.Request, why: str) -> None:
        self.stats.permission_denied += r.count
        log.debug("%s: %s: %s", self.name, r.name, why)
        self.answer(r, c.Failure(c.ErrorKind.PERMISSION_DENIED, why))

    def reply(self, req: c.Request, reply: c.Reply | None) -> None:
        """A request's reply into `out`, or held back while the confirms and aborts it
        made are not durable (see `_settle`)."""
        if self.owing:
            owing, self.owing = self.owing, []
            if reply is not None:
                self.owed.append(Owed(len(self.out), req, reply, owing))
                if type(reply) is Failure and reply.kind in self.codec.closing:
                    self.done = True
        elif reply is not None:
            self.out += self.codec.encode(req, reply)
            if type(reply) is Failure and reply.kind in self.codec.closing:
                self.done = True

    def answer(self, req: c.Request, reply: c.Reply) -> None:
        """Add a reply (the hot path of `_execute` does the same inline)."""
        self.out += self.codec.encode(req, reply)
        if type(reply) is Failure and reply.kind in self.codec.closing:
            self.done = True

    def failure(self, req: c.Request, exc: Exception) -> c.Failure:
        failure = c.failure_of(exc)
        if failure is None:  # a bug: say where, keep the connection
            log.error("%s: %s failed", self.name, req.name, exc_info=exc)
            return c.Failure(c.ErrorKind.SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        if failure.kind is c.ErrorKind.SERVER_ERROR:
            log.warning("%s: %s failed: %s", self.name, req.name, failure.message)
        return failure

    # -- puts ------------------------------------------------------------------------------------

    def answer_puts(self, group: list[tuple[c.Request, c.Put]],
                     result: PendingPut | Exception | None,
                     answer: tuple[int, int, bool] | None = None) -> None:
        """A put's replies: stored (`result` ended well), or its failure. `answer` (first
        id, count, duplicate): a joined part's own, for a put with a key."""
        if isinstance(result, Exception):  # (tested once a group: compiled, a look-up)
            for r, _ in group:
                self.answer(r, self.failure(r, result))
            return
        encode = self.codec.encode
        if answer is None and result is not None:
            answer = result.answer  # (a put with a producer or key: alone in its group)
        for r, put in group:
            if answer is not None:
                self.out += encode(r, ProducerStored(answer[1], answer[0], answer[2]))
            else:
                self.out += encode(r, Stored(len(put.items)))

    def put_of(self, group: list[tuple[c.Request, c.Put]],
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
        for d in items:  # (a loop: compiled, `max(map(len, ...))` looks up three builtins)
            if len(d) > limit:
                raise ItemTooLargeError(f"item over the server's max_item_size ({limit} bytes)")
        expire_ms = None if first.ttl_ms is None and first.expire_at_ms is None else (
            first.expire_ms(self.broker.clock()))
        return first.queue, items, expire_ms, first.flags, first.delay_ms, headers


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
        parked = self.broker.registry.parked  # (a request of a parked queue: to the task)
        while i < n and not self.done:
            if len(self.out) >= cap:
                return i
            r = requests[i]
            if type(r) is not Request:
                if self.begun:
                    return i  # (its reply goes after theirs)
                i += 1
                self.refused(r)
                continue
            grant = self.grant
            cmd = r.command
            if type(cmd) is Put:
                run: list[tuple[c.Request, c.Put]] = []
                j = i
                while j < n and type(rj := requests[j]) is Request and type(
                        put := rj.command) is Put and (grant is None or grant.denied(put)
                                                         is None):
                    run.append((rj, put))
                    j += 1
                if not run:  # refused by the grant
                    if self.begun:
                        return i
                    i += 1
                    self.deny(r, grant.denied(cmd) or "")  # type: ignore[union-attr]
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
                self.deny(r, why)
                continue
            t = type(cmd)
            if parked and (t is Get or t is Confirm or t is Abort or t is Touch) and (
                    cmd.queue in parked):  # type: ignore[union-attr]
                return i  # (its task loads it on a worker thread: `TaskPath.loaded`)
            if t is Get:
                if not self.get_nowait(requests, i):
                    return i
            elif t is Confirm or t is Abort or t is Touch:
                self.stats.count(r.name, r.count)
                try:
                    b = self.broker
                    if t is Confirm:
                        count = b.confirm(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                          cmd.count, cmd.ids, owe=self.reply_after)  # type: ignore[union-attr]
                    elif t is Abort:
                        count = b.abort(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                        ids=cmd.ids, owe=self.reply_after,  # type: ignore[union-attr]
                                        delay_ms=cmd.delay_ms)  # type: ignore[union-attr]
                    else:  # touch / extend (handlers.touch): a lease moved, nothing journaled
                        count = b.extend(self.reads, cmd.queue, cmd.reader,  # type: ignore[union-attr]
                                         cmd.ids, cmd.ms)  # type: ignore[union-attr]
                    self.reply(r, c.Count(count))
                except Exception as exc:
                    self.reply(r, self.failure(r, exc))
            else:
                return i
            i += 1
        return i

    def refused(self, r: c.Parsed) -> None:
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
        parked = b.registry.parked
        n_run = len(run)
        while began < n_run:
            entry = run[began]
            first = entry[1]
            if parked and first.queue in parked:
                return began  # (its task loads it on a worker thread: `TaskPath.loaded`)
            end = began + 1
            while end < n_run and same_append(first, run[end][1]):
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
                queue, items, expire_ms, flags, delay_ms, headers = self.put_of(group)
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

    def end_pass(self) -> bool:
        """After the pass's commit (and `JoinedPuts.end_all`): answer the begun puts,
        place the replies held back for confirms and aborts. False when something is
        still not durable (a write the commit did not make): `serve_turns` then waits
        for it."""
        for _, p in self.begun:
            if type(p) is PendingPut and p.ticket is not None and not p.ticket.done:
                return False
            if type(p) is JoinedPut and not p.ended:
                return False
        if self.owed and any(not t.done for o in self.owed for t in o.tickets):
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
            self.answer_puts(group, result, answer)
        if self.owed:
            owed, self.owed = self.owed, []
            self.place_owed(owed)
        return True


