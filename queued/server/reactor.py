"""The reactor: one task serves every ready connection, one pass per wake-up.

Runs the passes over the queue protocols' connections, plain and TLS (their links, the
epoll, sending and deadlines are `queued.server.connections`'): read
every ready connection once (into one reused 64 KiB buffer; a TLS connection's
ciphertext is decrypted there, and what it is sent encrypted on the way out), run every
complete request of all of them that needs no wait through the session's synchronous
core (`Session.run_nowait`), commit once for the whole pass (`Broker.commit_now`: one
write per touched file, then each file's fsync policy, on this thread: under `always`
the replies go out once the pass's data is durable), answer (`Session.end_pass`), and
send every reply. A request that must wait (a login, a long poll with nothing to take,
a put that makes room, a rare command) is handed to the connection's own task
(`Session.serve_turns`), which gives the connection back when it is done. Never blocks
inside a pass but for the commit's fsyncs; every few passes it yields to trio.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
from dataclasses import dataclass

import trio

from queued.broker.broker import Broker, JoinedPuts
from queued.server.connections import (
    BUFFER_CAP,
    GONE_ERRORS,
    IN_EVENTS,
    OUT_EVENTS,
    Connections,
    Link,
    ReactorTransport,
)
from queued.server.session import Session
from queued.wire import commands as c

log = logging.getLogger("queued.server")

#: Requests run for one connection per pass; more wait for the next pass.
PASS_REQUESTS = 1024
#: Passes in a row without going through trio's scheduler.
YIELD_EVERY = 8


@dataclass(frozen=True, slots=True)
class ReactorStatistics:
    passes: int  # wake-ups that looked for work (since start)
    requests: int  # requests taken from the codecs by passes
    connections: int  # connections it serves now (plain and TLS)


class Reactor(Connections):
    """See the module docstring."""

    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self.broker = broker
        self.joined = JoinedPuts(broker)  # the pass's puts, one append per queue
        self.passes = 0
        self.requests = 0

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
        return ReactorStatistics(self.passes, self.requests, len(self.links))

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve passes until cancelled. After a pass that did work it polls again at
        once (the next requests are often there already), going through trio's
        scheduler at least every YIELD_EVERY passes."""
        streak = 0
        try:
            while True:
                if not (self.again or streak):
                    deadline = min(self.timers[0][0] if self.timers else math.inf,
                                   self.poll_timers[0][0] if self.poll_timers else math.inf)
                    if deadline == math.inf:  # (a cancel scope costs more than a pass's reply)
                        await trio.lowlevel.wait_readable(self.epoll.fileno())
                    else:
                        with trio.move_on_at(deadline):
                            await trio.lowlevel.wait_readable(self.epoll.fileno())
                elif streak >= YIELD_EVERY:
                    streak = 0
                    await trio.lowlevel.checkpoint()
                self.passes += 1
                touched = self._read(self.epoll.poll(0))
                if touched:
                    await self._run_pass(touched)
                    streak += 1
                else:
                    streak = 0
                now = trio.current_time()
                if (self.timers and self.timers[0][0] <= now) or (
                        self.poll_timers and self.poll_timers[0][0] <= now):
                    self.expire(now)
                if self.closing:
                    for link in list(self.links.values()):
                        if not link.in_task and not link.closing:
                            self.end(link)
        finally:
            self.close()

    def _read(self, events: list[tuple[int, int]]) -> list[Link]:
        touched = dict.fromkeys(self.again)
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
            if not ev & (IN_EVENTS | select.EPOLLHUP | select.EPOLLERR) or link.in_task or (
                    link.closing or not link.mask & select.EPOLLIN):
                continue
            session = link.session
            try:
                n = os.readv(fd, (view,))
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
                session.codec.receive_data(bytes(view[:n]))
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
        now = trio.current_time()
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
            session.end_polls(trio.current_time())
        if session.long_poll is not None:
            if not session.end_long_poll(trio.current_time()):
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
