"""A connection's own task: the turns the reactor hands it (`serve_turns`), the login,
and what may wait: a batch run in order (`_run`), puts that make room or wait for their
write (`_puts`). The gets that wait (long polls, `monitor`) are `TaskGets`' (task_gets);
the send and the state it shares with the session, `TaskBase`'s (task_base).

A layer of `queued.server.session.Session`, which owns the connection's state, the
replies (`reply`, `answer`, `failure`, ...) and the reactor's synchronous core
(`run_nowait`, `end_pass`); the chain is `TaskBase` -> `TaskGets` -> `TaskPath` ->
`PassGets` -> `Session`. Never parses bytes itself and never touches the journal but
through the broker.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

import trio

from queued.broker.broker import PendingPut
from queued.server.handlers import HANDLERS
from queued.server.task_base import RECEIVE_SIZE
from queued.server.task_gets import TaskGets
from queued.wire import commands as c

log = logging.getLogger("queued.server")

#: Requests parsed from the receive buffer before they are run (bounds the batch).
MAX_BATCH = 1024


class Turns(Protocol):
    """How the reactor (queued.server.reactor) hands a connection to its own task."""

    async def next(self) -> list[c.Parsed] | None:
        """Wait for the reactor to hand the connection over: the requests it left to
        run (which may wait), or None: the connection ends."""

    def give_back(self) -> None:
        """This turn is done: the reactor serves the connection again."""


class TaskPath(TaskGets):
    """The task half of a `Session` (see the module docstring)."""

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
                    await self.flush()
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

    # -- one batch ---------------------------------------------------------------------------

    async def _run_batch(self) -> None:
        """Run every complete request buffered, in order; replies collect in `out`.

        Loops because a long poll reads ahead (see `TaskGets.take`): requests that arrived
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
                await self.flush()

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
                if self.broker.registry.parked:
                    for queue in {put.queue for _, put in run}:
                        await self.loaded(queue)
                await self._puts(run)
                continue
            i += 1
            if type(r) is c.Request:
                self.stats.count(r.name, r.count)
                cmd = r.command
                if type(cmd) in _OF_A_QUEUE:
                    await self.loaded(cmd.queue)  # type: ignore[union-attr]
                await self._execute(r)
            else:
                self.refused(r)
            if len(self.out) >= RECEIVE_SIZE:  # replies of a long batch go out as they grow
                await self.flush()

    async def loaded(self, queue: str) -> None:
        """Queue `queue` loaded if it was parked, its files read on a worker thread: the
        reactor's passes (every other connection) go on meanwhile, where a use in a pass
        would hold them all for the read. (A pass hands a request of a parked queue to
        its connection's task for this.)"""
        registry = self.broker.registry
        if queue in registry.parked:
            await registry.load_parked(queue)

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


#: The commands that use their queue (a request of a parked one comes to the task,
#: which loads it first on a worker thread: `TaskPath.loaded`); puts are loaded for as a
#: run. Not `Delete` (a parked queue's files go without a load) nor `Pause` (a list).
_OF_A_QUEUE: Final = frozenset({c.Get, c.Peek, c.Confirm, c.Abort, c.Touch, c.Reject,
                                c.Browse, c.Flush, c.FlushExpired, c.Monitor, c.Move})


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
