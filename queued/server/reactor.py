"""The reactor: one task serves every ready connection, one pass per wake-up.

Runs the passes over the queue protocols' connections, plain and TLS (their links, the
epoll, sending and deadlines are `queued.server.connections`'): read
every ready connection once (a plain one with `os.read` of at most 64 KiB, into the
bytes its codec takes; a TLS connection's ciphertext into one reused 64 KiB buffer,
decrypted there, and what it is sent encrypted on the way out), run every
complete request of all of them that needs no wait through the session's synchronous
core (`Session.run_nowait`), commit once for the whole pass (`Broker.commit_now`: one
write per touched file, then each file's fsync policy, on this thread: under `always`
the replies go out once the pass's data is durable), answer (`Session.end_pass`), and
send every reply. A request that must wait (a login, a long poll with nothing to take,
a put that makes room, a rare command) is handed to the connection's own task
(`Session.serve_turns`), which gives the connection back when it is done. Never blocks
inside a pass but for the commit's fsyncs; every few passes it yields to trio. Between
passes it may wait for the next requests outside trio's scheduler for a millisecond,
while trio has nothing to do (`Reactor._linger`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import trio

from queued.broker.broker import Broker, JoinedPuts
from queued.server.connections import (
    BUFFER_CAP,
    EPOLLIN,
    GONE_ERRORS,
    OUT_EVENTS,
    READ_EVENTS,
    RECEIVE_SIZE,
    Connections,
    Link,
    ReactorTransport,
)
from queued.server.session import Session
from queued.stats import Histogram, HistogramSnapshot
from queued.wire import commands as c

log = logging.getLogger("queued.server")
#: (C statics compiled: no look-up in `os` or in the module's globals per read)
_read_fd: Final = os.read
_readv_fd: Final = os.readv
_perf_counter: Final = time.perf_counter

#: Requests run for one connection per pass; more wait for the next pass.
PASS_REQUESTS: Final = 1024
#: Passes in a row without going through trio's scheduler.
YIELD_EVERY: Final = 8
#: After a pass, how long (seconds) the reactor may wait for the next requests outside
#: trio's scheduler (see `_linger`): a client with one request in flight sends its next
#: one within this, and a wake-up through the scheduler costs some 15 us of CPU, more
#: than a one-request pass's own Python. (One millisecond: epoll's unit.)
LINGER = 0.001
#: ... and only if the wait ends within this of the scheduler's last run: the bound on
#: how late a task that trio made runnable along with the reactor's may start.
LINGER_BUDGET = 0.002
#: Passes after a linger that timed out before the reactor lingers again: nothing came
#: within LINGER (an idle client, or one that was waiting to run in trio's batch along
#: with the reactor: a task of this process's), so the next passes wait through trio.
LINGER_BACKOFF: Final = 32
#: Bucket bounds (seconds) of the time a pass takes, from its reads to its last send:
#: every connection it did not serve waits that long (`queued_reactor_pass_seconds`).
PASS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1.0)
#: A pass longer than this (seconds) is logged: every other connection waited for it.
SLOW_PASS = 1.0


class TrioLoop:
    """What the reactor reads of trio's run loop to linger (see `Reactor._linger`):
    its epoll, where it waits for everything its tasks wait on (sockets, its wake-up
    socket for signals and threads); its run queue and its queue of callbacks from
    other threads; its next deadline. Private attributes of trio's, read defensively
    (`find`); `trio.lowlevel.current_statistics` has all but the epoll at several
    times the cost. Without them the reactor does not linger (a test says which)."""

    def __init__(self, epoll: select.epoll, runner: Any) -> None:
        self.epoll = epoll
        self.runq: Any = runner.runq
        self.entries: Any = runner.entry_queue
        self.deadlines: Any = runner.deadlines

    @staticmethod
    def find() -> TrioLoop | None:
        """The running trio loop's (None outside a run, or where trio keeps them
        elsewhere)."""
        try:  # (imported here: a trio that moved it still starts the server)
            from trio._core._run import GLOBAL_RUN_CONTEXT
        except ImportError:
            return None
        runner = getattr(GLOBAL_RUN_CONTEXT, "runner", None)
        epoll = getattr(getattr(runner, "io_manager", None), "_epoll", None)
        entries = getattr(runner, "entry_queue", None)
        if not (isinstance(epoll, select.epoll) and not epoll.closed
                and isinstance(getattr(runner, "runq", None), collections.deque)
                and hasattr(entries, "queue") and hasattr(entries, "idempotent_queue")
                and callable(getattr(getattr(runner, "deadlines", None), "next_deadline",
                                     None))):
            return None
        return TrioLoop(epoll, runner)

    def busy(self) -> bool:
        """Whether a task is runnable, or a callback waits to run."""
        return bool(self.runq or self.entries.queue or self.entries.idempotent_queue)

    def next_deadline(self) -> float:
        return float(self.deadlines.next_deadline())


@dataclass(frozen=True, slots=True)
class ReactorStatistics:
    passes: int  # wake-ups that looked for work (since start)
    requests: int  # requests taken from the codecs by passes
    connections: int  # connections it serves now (plain and TLS)
    lingers: int  # waits for the next requests outside trio's scheduler (`_linger`)
    lingered: int  # of those, the ones that ended with a connection to read
    gave_way: int  # ... and the ones that ended as trio had something (the rest timed out)
    pass_seconds: HistogramSnapshot  # how long the passes that ran requests took


class Reactor(Connections):
    """See the module docstring."""

    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self.broker = broker
        self.joined = JoinedPuts(broker)  # the pass's puts, one append per queue
        self.passes = 0
        self.requests = 0
        #: the reactor's epoll and trio's together (made when it runs): readable when a
        #: connection or anything trio waits for is; None: it does not linger
        self.linger_poll: select.epoll | None = None
        self.trio_loop: TrioLoop | None = None
        self.lingers = 0
        self.lingered = 0
        self.gave_way = 0
        self.linger_after = 0  # (passes) no linger before this many, after a timeout
        self.pass_seconds = Histogram(PASS_BUCKETS)
        #: trio's clock (`trio.current_time` without its two calls on the way), once run
        self.clock: Callable[[], float] = trio.current_time

    async def serve(self, session: Session, stream: trio.SocketStream,
                    transport: ReactorTransport) -> None:
        """Serve `session` until it ends (called in the connection's task)."""
        fd = stream.socket.fileno()
        link = Link(self, session, fd, transport.channel)
        transport.link = link
        session.notify = lambda: self.ready(link)
        session.joined = self.joined
        self.links[fd] = link
        self.set_mask(link)
        self.watch(link, trio.current_time())
        if self.closing:
            self.end(link)  # (its handshake ended after the server began to stop)
        elif link.tls is not None and link.tls.has_input():
            self.again[link] = None  # (a request sent along with the handshake's end)
        self.wake()  # (it may sleep past the new connection's login deadline)
        try:
            await session.serve_turns(link)
            # Its last replies go out before the socket closes (at most a second).
            with trio.move_on_after(1):
                while link.unsent and not session.lost:
                    link.drained = trio.Event()
                    await link.drained.wait()
        finally:
            self.forget(link)

    def statistics(self) -> ReactorStatistics:
        return ReactorStatistics(self.passes, self.requests, len(self.links), self.lingers,
                                 self.lingered, self.gave_way, self.pass_seconds.snapshot())

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve passes until cancelled. After a pass that did work it polls again at
        once (the next requests are often there already), going through trio's
        scheduler at least every YIELD_EVERY passes."""
        streak = 0
        self.clock = clock = trio.lowlevel.current_clock().current_time
        turn = clock()  # when trio's scheduler last ran
        self.trio_loop = TrioLoop.find()
        if self.trio_loop is not None:
            self.linger_poll = select.epoll()
            self.linger_poll.register(self.epoll.fileno(), select.EPOLLIN)
            self.linger_poll.register(self.trio_loop.epoll.fileno(), select.EPOLLIN)
        # (bound once: a compiled loop looks up a method of a module or of an object
        # of a class it does not compile at every call)
        poll = self.epoll.poll
        epoll_fd = self.epoll.fileno()
        wait_readable = trio.lowlevel.wait_readable
        try:
            while True:
                if not (self.again or streak):
                    deadline = min(self.timers[0][0] if self.timers else math.inf,
                                   self.poll_timers[0][0] if self.poll_timers else math.inf)
                    if deadline == math.inf:  # (a cancel scope costs more than a pass's reply)
                        await wait_readable(epoll_fd)
                    else:
                        with trio.move_on_at(deadline):
                            await wait_readable(epoll_fd)
                    turn = clock()
                elif streak >= YIELD_EVERY:
                    streak = 0
                    await trio.lowlevel.checkpoint()
                    turn = clock()
                self.passes += 1
                events = poll(0)
                if not events and streak and not self.again and self._linger(turn):
                    events = poll(0)
                began = _perf_counter()
                touched = self._read(events)
                if touched:
                    await self._run_pass(touched)
                    self._took(_perf_counter() - began, len(touched))
                    streak += 1
                else:
                    streak = 0
                now = clock()
                if (self.timers and self.timers[0][0] <= now) or (
                        self.poll_timers and self.poll_timers[0][0] <= now):
                    self.expire(now)
                if self.closing:
                    for link in list(self.links.values()):
                        if not link.in_task and not link.closing:
                            self.end(link)
        finally:
            if self.linger_poll is not None:
                self.linger_poll.close()
            self.close()

    def _took(self, seconds: float, links: int) -> None:
        """A pass that ran requests took `seconds` (from its reads to its sends)."""
        self.pass_seconds.observe(seconds)
        if seconds > SLOW_PASS:
            log.warning("a pass over %d connection(s) took %.0f ms: every other connection "
                        "waited for it", links, seconds * 1000)

    def _linger(self, turn: float) -> bool:
        """After a pass that found work, with none waiting now: wait for the next
        requests here rather than through trio's scheduler, whose wake-up costs more
        CPU than a short pass. True when a connection may have something.

        It waits on `linger_poll`, so it stops as soon as anything trio waits for is
        ready (another task's socket, a signal, a thread's result), and only while
        trio has nothing runnable: for LINGER at most, and only if that ends within
        LINGER_BUDGET of the scheduler's last run at `turn` and before any deadline
        of trio's or the reactor's. A task trio woke in the same batch as the reactor,
        which no statistic shows, waits LINGER_BUDGET at most; and after a linger that
        timed out the next LINGER_BACKOFF passes do not linger."""
        poll, loop = self.linger_poll, self.trio_loop
        if poll is None or loop is None or self.passes < self.linger_after or loop.busy():
            return False
        end = self.clock() + LINGER  # (a whole millisecond: epoll's unit)
        if (end > turn + LINGER_BUDGET or end > loop.next_deadline()
                or (self.timers and end > self.timers[0][0])
                or (self.poll_timers and end > self.poll_timers[0][0])):
            return False
        self.lingers += 1
        ready = poll.poll(LINGER)
        # Anything of trio's: its scheduler runs first (the reactor's wait through it
        # ends at once if a connection has something too).
        if len(ready) == 1 and ready[0][0] == self.epoll.fileno():
            self.lingered += 1
            return True
        if ready:
            self.gave_way += 1
        else:
            self.linger_after = self.passes + LINGER_BACKOFF
        return False

    def _read(self, events: list[tuple[int, int]]) -> list[Link]:
        touched: dict[Link, None] = {}
        if self.again:
            touched.update(self.again)
            self.again.clear()
        for old in touched:
            old.fresh = False
            tls = old.tls
            if tls is not None and tls.has_input() and not (old.in_task or old.closing):
                old.fresh = self._decrypted(old)  # (read by its task, or the handshake)
        links = self.links
        view = self.view
        for fd, ev in events:
            link = links.get(fd)
            if link is None:
                if fd == self.wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self.wake_fd)
                continue
            if ev & OUT_EVENTS and link.unsent:
                self.flush_unsent(link)
            if not ev & READ_EVENTS or link.in_task or (
                    link.closing or not link.mask & EPOLLIN):
                continue
            session = link.session
            data = b""
            try:
                if link.tls is None:
                    # (the bytes the codec takes, read at once: callgrind, ~1,000
                    # instructions fewer a read than into the buffer and copied out)
                    data = _read_fd(fd, RECEIVE_SIZE)
                    n = len(data)
                else:
                    n = _readv_fd(fd, (view,))
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in GONE_ERRORS:
                    raise
                n = 0
            if n and link.tls is not None:
                link.tls.feed(view[:n])
                if not self._decrypted(link):
                    # Part of a record (a request has begun), or a record that holds no
                    # data (a key update, an alert) after one: the deadline follows.
                    self.watch(link, trio.current_time())
                    continue
            elif n:
                session.counters.bytes_read += n
                session.codec.receive_data(data)
            elif not session.eof:
                session.eof = True
                session.codec.receive_data(b"")
            else:
                continue
            link.fresh = True
            touched[link] = None
        return list(touched)

    def _decrypted(self, link: Link) -> bool:
        """Hand the link's codec what its TLS session decrypts of the ciphertext fed to
        it (all of it: the reads that fed it are bounded); send what the session owes.
        False if nothing came of it (part of a record)."""
        tls = link.tls
        assert tls is not None
        session = link.session
        try:
            data = tls.decrypt(1 << 62)
        except Exception:  # one connection's failure must not stop the others
            log.exception("%s: decrypting failed; closing the connection", session.name)
            data = bytearray()
            tls.ended = True
        owed = tls.to_send()
        if owed:  # (unasked: a key update's answer; its reads stop too past the cap)
            self.send_raw(link, owed)
            self.set_mask(link)
        if data:
            session.counters.bytes_read += len(data)
            session.codec.receive_data(data)
        if tls.ended and not session.eof:
            session.eof = True  # (close_notify, or bytes that are not TLS)
            session.codec.receive_data(b"")
            return True
        return bool(data)

    async def _run_pass(self, touched: list[Link]) -> None:
        broker = self.broker
        broker.defer_writes(True)
        self.in_pass = True
        try:
            for link in touched:
                if not (link.in_task or link.closing):
                    try:
                        self._run(link)
                    except Exception:  # one connection's failure must not stop the others
                        log.exception("%s: a request failed; closing the connection",
                                      link.session.name)
                        link.session.done = True
            self.joined.begin_all()
        finally:
            broker.defer_writes(False)
            self.in_pass = False
        while not broker.commit_now():
            await broker.wait_round()  # (a checkpoint's round, say: rare)
        self.joined.end_all()
        now = self.clock()
        for link in touched:
            if link.in_task or link.closing:
                continue
            try:
                self._finish(link, now)
            except Exception:  # one connection's failure must not stop the others
                log.exception("%s: answering a pass failed; closing the connection",
                              link.session.name)
                link.session.done = True
                self.end(link)

    def _finish(self, link: Link, now: float) -> None:
        """After the pass's commit: answer, send, and decide what comes next for it."""
        session = link.session
        if not session.end_pass():
            self.hand(link, link.rest)  # it waits for what the commit could not make
            return
        if session.out:
            self.write(link, session.out)  # (what the socket does not take is copied)
            session.out.clear()
        if link.closing:
            return
        if session.done or session.eof or self.closing:
            if link.rest:
                self.hand(link, link.rest)  # (it ends after them)
            else:
                self.end(link)
        elif link.wants_task:
            self.hand(link, link.rest)
        else:
            if link.rest is not None and session.long_poll is None and (
                    len(link.unsent) < BUFFER_CAP):
                self.again[link] = None  # it waited for this commit, or sent its replies
            self.watch(link, now)
            self.set_mask(link)

    def _run(self, link: Link) -> None:
        """Run what the link has buffered, within the pass's budget."""
        session = link.session
        if session.login_by is not None:
            if link.fresh:  # (else its task just ran all it could of the login)
                link.wants_task = True  # (the login: in the task, scrypt runs in a thread)
                link.rest = []
            return
        if len(link.unsent) >= BUFFER_CAP:
            return  # its replies drain first (`flush_unsent` brings it back)
        session.after_commit = False
        budget = PASS_REQUESTS
        rest = link.rest
        if session.polls:
            session.end_polls(self.clock())
        if session.long_poll is not None:
            if not session.end_long_poll(self.clock()):
                return  # it waits on (what arrived meanwhile waits behind it)
            assert rest
            rest = rest[1:]  # (the long poll was the first)
        link.rest = None
        if rest:
            i = session.run_nowait(rest)
            budget -= i
            if i < len(rest):
                self._stopped(link, rest[i:])
                return
        codec = session.codec
        while budget > 0 and not session.done:
            parsed = codec.next_requests(min(budget, PASS_REQUESTS))
            if not parsed:
                break
            session.requests += len(parsed)
            self.requests += len(parsed)
            i = session.run_nowait(parsed)
            budget -= len(parsed)
            if i < len(parsed):
                self._stopped(link, parsed[i:])
                return
        if budget <= 0 and not session.done:
            link.rest = []  # more may be buffered: the next pass goes on

    @staticmethod
    def _stopped(link: Link, rest: list[c.Parsed]) -> None:
        """`run_nowait` stopped at rest[0]: it waits for the commit (begun puts), in its
        reader's line (a long poll), or for the connection's task (anything else)."""
        session = link.session
        link.rest = rest
        link.wants_task = not (session.begun or session.long_poll is not None
                               or session.after_commit or len(session.out) >= session.out_cap)
