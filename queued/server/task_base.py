"""What a connection's task is built on: the session's state it uses (declared here, set by
`Session.__init__`), the session's replies it calls (declared as methods, defined by
`queued.server.session.Session`), and the send: `flush` (one sender at a time) and the
wait for the writes that held-back replies acknowledge (`_settle`). Also the values the
task path and the session's synchronous core share: the listener's `Guard`, the
connection's `ServerCounters`, a held-back reply (`Owed`), the receive size.

The base of the session's one chain of classes (`TaskBase` -> `TaskGets` in task_gets ->
`TaskPath` in task_path -> `PassGets` in pass_gets -> `Session`: a compiled class has
one base only). Never parses bytes itself and never touches the journal but through the
broker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from queued.broker.broker import Broker, JoinedPut, PendingPut
from queued.reader.open_reads import OpenReads
from queued.server.auth import Authenticator
from queued.server.handlers import ServerControl
from queued.server.transport import Transport
from queued.stats import ProtocolStats
from queued.storage.journal import Ticket
from queued.wire import commands as c
from queued.wire.access import Grant

log = logging.getLogger("queued.server")

RECEIVE_SIZE = 256 * 1024


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


class TaskBase:
    """What the task path is built on (see the module docstring)."""

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

    async def flush(self) -> None:
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
