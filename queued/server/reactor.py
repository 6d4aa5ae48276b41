"""The reactor: one task serves every ready connection, one pass per wake-up.

Owns an epoll over the queue protocols' connections, plain and TLS, and the pass: read
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
import errno
import heapq
import logging
import math
import os
import select
import ssl
from dataclasses import dataclass
from itertools import count

import trio

from queued.broker.broker import Broker, JoinedPuts
from queued.server.session import Session
from queued.server.tls import TlsChannel
from queued.server.transport import SocketTransport
from queued.wire import commands as c

log = logging.getLogger("queued.server")

#: Bytes read from one connection per pass (a larger read costs more than it saves:
#: glibc maps fresh memory for each big bytes object).
RECEIVE_SIZE = 64 * 1024
#: Requests run for one connection per pass; more wait for the next pass.
PASS_REQUESTS = 1024
#: A connection with this much unsent output is not read until it drains (nor one
#: with complete requests left for the next pass).
BUFFER_CAP = 256 * 1024
#: Passes in a row without going through trio's scheduler.
YIELD_EVERY = 8

_GONE = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT,
                   errno.EBADF, errno.ESHUTDOWN, errno.ECONNABORTED})
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT


@dataclass(frozen=True, slots=True)
class ReactorStatistics:
    passes: int  # wake-ups that looked for work (since start)
    requests: int  # requests taken from the codecs by passes
    connections: int  # connections it serves now (plain and TLS)


class Link:
    """One connection as the reactor holds it (see `Turns` in queued.server.session)."""

    __slots__ = ("closing", "deadline", "drained", "fd", "fresh", "handed", "in_task",
                 "mask", "poll_due", "reactor", "rest", "seen", "session", "tls", "turn",
                 "unsent", "unsent_since", "waiting_since", "wants_task")

    def __init__(self, reactor: Reactor, session: Session, fd: int,
                 tls: TlsChannel | None) -> None:
        self.reactor = reactor
        self.session = session
        self.fd = fd
        self.tls = tls  # the TLS session (None: plaintext)
        self.unsent = bytearray()
        self.unsent_since = 0.0
        self.mask = 0  # the events registered in the epoll
        self.in_task = False  # the connection's task has it (the reactor neither reads nor runs it)
        self.wants_task = False  # `rest` must wait: hand it over after the commit
        self.closing = False
        self.rest: list[c.Parsed] | None = None  # requests left over by run_nowait
        self.handed: list[c.Parsed] | None = None  # what the task is to run
        self.turn: trio.Event | None = None  # set when the task has a turn
        self.drained: trio.Event | None = None  # set when `unsent` empties
        self.deadline = 0.0  # the login's or a begun request's (trio time); 0: none
        self.waiting_since = -1.0  # when the request now arriving began to (-1: none)
        self.seen = 0  # the session's request count at the last look
        self.poll_due = 0.0  # the earliest deadline of its RPC gets in line, as last pushed
        self.fresh = False  # read in this pass

    async def next(self) -> list[c.Parsed] | None:
        """Turns.next: the task waits here while the reactor serves the connection."""
        while not self.in_task:
            if self.closing:
                return None
            self.turn = trio.Event()
            await self.turn.wait()
        if self.closing and not self.handed:
            return None
        handed, self.handed = self.handed, None
        return handed or []

    def give_back(self) -> None:
        """Turns.give_back: the reactor serves the connection again."""
        self.in_task = False
        self.reactor.returned(self)


class ReactorTransport(SocketTransport):
    """The session's transport under the reactor: sends go through the link (one
    order, whoever sends: the pass or a task answering a waiting get; over TLS the
    link encrypts); receives (in the task's turn only) are the socket's own, or over
    TLS what `channel` decrypts of them."""

    def __init__(self, stream: trio.SocketStream, channel: TlsChannel | None = None) -> None:
        super().__init__(stream)
        self.link: Link | None = None
        self.channel = channel

    async def receive(self, max_bytes: int) -> bytes | bytearray:
        channel = self.channel
        if channel is None:
            return await super().receive(max_bytes)
        link = self.link
        assert link is not None
        while True:
            data = channel.decrypt(max_bytes)
            owed = channel.to_send()
            if owed:
                link.reactor.send_raw(link, owed)
            if data:
                return data
            if channel.ended:
                return b""
            # Into the reactor's buffer: no checkpoint from the read to the feed.
            got = await self.receive_into(link.reactor.view)
            if not got:
                return b""
            channel.feed(link.reactor.view[:got])

    async def send(self, data: bytes) -> None:
        link = self.link
        assert link is not None
        if not link.reactor.write(link, data):
            raise trio.BrokenResourceError("socket gone")
        while len(link.unsent) > BUFFER_CAP:
            link.drained = trio.Event()
            await link.drained.wait()
            if link.session.lost:
                raise trio.BrokenResourceError("socket gone")


class Reactor:
    """See the module docstring."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.epoll = select.epoll()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.wake_fd, select.EPOLLIN)
        self.links: dict[int, Link] = {}
        #: links to run in the next pass without reading (handed back, over budget,
        #: or waiting for a commit), in order
        self.again: dict[Link, None] = {}
        self.buffer = bytearray(RECEIVE_SIZE)
        self.view = memoryview(self.buffer)
        self.joined = JoinedPuts(broker)  # the pass's puts, one append per queue
        self.timers: list[tuple[float, int, Link]] = []
        #: deadlines of RPC gets waiting in line (a link may have several)
        self.poll_timers: list[tuple[float, int, Link]] = []
        self._seq = count()
        self.closing = False
        self.in_pass = False
        self.passes = 0
        self.requests = 0

    # -- connections (called from each connection's task) -----------------------------------

    async def serve(self, session: Session, stream: trio.SocketStream,
                    transport: ReactorTransport) -> None:
        """Serve `session` until it ends (called in the connection's task)."""
        fd = stream.socket.fileno()
        link = Link(self, session, fd, transport.channel)
        transport.link = link
        session.notify = lambda: self._ready(link)
        session.joined = self.joined
        self.links[fd] = link
        self._set_mask(link)
        self._watch(link, trio.current_time())
        if self.closing:
            self._end(link)  # (its handshake ended after the server began to stop)
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
            self._forget(link)

    def _ready(self, link: Link) -> None:
        """The link's long poll can be answered (woken by a put, a deletion...)."""
        self.again[link] = None
        if not self.in_pass:
            self.wake()

    def _forget(self, link: Link) -> None:
        link.session.cancel_long_poll()
        if self.epoll.closed:
            self.links.pop(link.fd, None)
            return
        if self.links.get(link.fd) is link:
            del self.links[link.fd]
            if link.mask:
                with contextlib.suppress(OSError):
                    self.epoll.unregister(link.fd)
                link.mask = 0
        self.again.pop(link, None)

    def returned(self, link: Link) -> None:
        """A task gave its connection back: run what may be buffered, watch it again."""
        if self.links.get(link.fd) is not link:
            return
        self.again[link] = None
        self._set_mask(link)
        self.wake()

    def wake(self) -> None:
        """Make the reactor look (from any task)."""
        if self.epoll.closed:
            return
        with contextlib.suppress(BlockingIOError):  # (the counter is full: it will look)
            os.eventfd_write(self.wake_fd, 1)

    def shut_down(self) -> None:
        """The server stops: every connection ends once its running turn is done."""
        self.closing = True
        self.wake()

    def statistics(self) -> ReactorStatistics:
        return ReactorStatistics(self.passes, self.requests, len(self.links))

    def close(self) -> None:
        self.epoll.close()
        os.close(self.wake_fd)

    # -- sending ----------------------------------------------------------------------------

    def write(self, link: Link, data: bytes | bytearray) -> bool:
        """Send `data` (encrypted, over TLS) after whatever is unsent; what the socket
        does not take now waits for EPOLLOUT. False once the peer is gone."""
        session = link.session
        if session.lost:
            return False
        session.counters.bytes_written += len(data)
        if link.tls is not None:
            try:
                data = link.tls.encrypt(data)
            except ssl.SSLError as exc:
                self._lost(link, exc)
                return False
        return self.send_raw(link, data)

    def send_raw(self, link: Link, data: bytes | bytearray) -> bool:
        """`write` for bytes as they go on the wire (over TLS: records)."""
        session = link.session
        if session.lost:
            return False
        if link.unsent:
            link.unsent += data
            return True
        try:
            sent = os.write(link.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            if exc.errno in _GONE:
                self._lost(link, exc)
                return False
            raise
        if sent < len(data):
            link.unsent += memoryview(data)[sent:]
            link.unsent_since = now = trio.current_time()
            self._set_mask(link)
            guard = session.guard
            if guard is not None:  # (a task's replies too: it may wait on them forever)
                heapq.heappush(self.timers, (now + guard.request_timeout, next(self._seq),
                                             link))
                if not self.in_pass:
                    self.wake()  # (it may sleep past the new deadline)
        return True

    def _flush_unsent(self, link: Link) -> None:
        try:
            sent = os.write(link.fd, link.unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in _GONE:
                self._lost(link, exc)
                return
            raise
        del link.unsent[:sent]
        if len(link.unsent) < BUFFER_CAP and link.rest is not None and not (
                link.in_task or link.closing or link.session.long_poll is not None):
            self.again[link] = None  # it stopped for its replies to drain: go on
        if not link.unsent:
            if link.drained is not None:
                link.drained.set()
                link.drained = None
            self._set_mask(link)

    def _lost(self, link: Link, exc: BaseException) -> None:
        log.debug("%s: connection lost: %s", link.session.name, exc)
        session = link.session
        session.lost = session.done = True
        link.unsent.clear()
        if link.drained is not None:
            link.drained.set()
            link.drained = None
        self._end(link)

    # -- the epoll mask, deadlines ------------------------------------------------------------

    def _set_mask(self, link: Link) -> None:
        if self.links.get(link.fd) is not link or self.epoll.closed:
            return
        mask = 0
        if link.unsent:
            mask |= _OUT
        session = link.session
        if not (link.in_task or link.closing or session.eof or len(link.unsent) > BUFFER_CAP
                ) and (link.rest is None or (session.long_poll is not None and
                                             session.codec.buffered_bytes() < BUFFER_CAP)):
            mask |= _IN
        if mask == link.mask:
            return
        try:
            if not link.mask:
                self.epoll.register(link.fd, mask)
            elif not mask:
                self.epoll.unregister(link.fd)
            else:
                self.epoll.modify(link.fd, mask)
        except OSError as exc:  # closed under us: the peer is gone
            self._lost(link, exc)
            return
        link.mask = mask

    @staticmethod
    def _request_timeout(link: Link) -> float:
        guard = link.session.guard
        return guard.request_timeout if guard is not None else float("inf")

    @staticmethod
    def _due(link: Link) -> float:
        """When the link must have made progress (trio time); 0: never."""
        session = link.session
        if session.long_poll is not None:
            return session.long_poll.deadline
        if session.login_by is not None:
            return session.login_by
        guard = session.guard
        if guard is None:
            return 0.0
        if link.waiting_since >= 0:
            return link.waiting_since + guard.request_timeout
        return 0.0  # (unread replies have timers of their own: see `write`)

    def _watch(self, link: Link, now: float) -> None:
        """After the link's part of a pass: when its begun request (or its unread
        replies) started to wait, and the deadline that follows."""
        session = link.session
        if session.codec.pending():
            if session.requests != link.seen or link.waiting_since < 0:
                link.waiting_since = now  # a new request began to arrive
        else:
            link.waiting_since = -1.0
        link.seen = session.requests
        if session.polls:
            when = session.next_poll_deadline()
            if when != link.poll_due:  # (a stale entry costs one look, no more)
                link.poll_due = when
                heapq.heappush(self.poll_timers, (when, next(self._seq), link))
        due = self._due(link)
        if due and due != link.deadline:
            link.deadline = due
            heapq.heappush(self.timers, (due, next(self._seq), link))

    def _expire(self, now: float) -> None:
        polls = self.poll_timers
        while polls and polls[0][0] <= now:
            _, _, link = heapq.heappop(polls)
            if link.session.polls and not (link.in_task or link.closing):
                self.again[link] = None  # (those past their time answer empty)
        timers = self.timers
        while timers and timers[0][0] <= now:
            when, _, link = heapq.heappop(timers)
            if link.closing:
                continue
            if link.unsent and now - link.unsent_since >= self._request_timeout(link):
                session = link.session
                session.stats.request_timeouts += 1
                log.info("%s: closed: %d bytes of replies unread within request_timeout",
                         session.name, len(link.unsent),
                         extra={"event": "request_timeout", "peer": session.name})
                self._lost(link, TimeoutError("replies unread"))
                continue
            if link.deadline != when or link.in_task:
                continue
            due = self._due(link)
            if not due or due > now:
                if due and due != when:
                    link.deadline = due
                    heapq.heappush(timers, (due, next(self._seq), link))
                continue
            session = link.session
            if session.long_poll is not None:
                self.again[link] = None  # its time is up: answered empty
                continue
            session.time_out()
            self._end(link)

    # -- ending and handing over ------------------------------------------------------------

    def _end(self, link: Link) -> None:
        """The connection ends: its task finishes it (open reads, the socket)."""
        link.closing = True
        self._set_mask(link)
        self.again.pop(link, None)
        if not link.in_task:
            self._hand(link, None)

    def _hand(self, link: Link, rest: list[c.Parsed] | None) -> None:
        link.in_task = True
        link.handed = rest
        link.rest = None
        link.wants_task = False
        self.again.pop(link, None)
        self._set_mask(link)
        if link.turn is not None:
            link.turn.set()
            link.turn = None

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
                    self._expire(now)
                if self.closing:
                    for link in list(self.links.values()):
                        if not link.in_task and not link.closing:
                            self._end(link)
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
            if ev & _OUT and link.unsent:
                self._flush_unsent(link)
            if not ev & (_IN | select.EPOLLHUP | select.EPOLLERR) or link.in_task or (
                    link.closing or not link.mask & select.EPOLLIN):
                continue
            session = link.session
            try:
                n = os.readv(fd, (view,))
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                n = 0
            if n and link.tls is not None:
                link.tls.feed(view[:n])
                if not self._decrypted(link):
                    continue  # (part of a record)
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
            self._set_mask(link)
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
                self._end(link)

    def _finish(self, link: Link, now: float) -> None:
        """After the pass's commit: answer, send, and decide what comes next for it."""
        session = link.session
        if not session.end_pass():
            self._hand(link, link.rest)  # it waits for what the commit could not make
            return
        if session.out:
            self.write(link, session.out)  # (what the socket does not take is copied)
            session.out.clear()
        if link.closing:
            return
        if session.done or session.eof or self.closing:
            if link.rest:
                self._hand(link, link.rest)  # (it ends after them)
            else:
                self._end(link)
        elif link.wants_task:
            self._hand(link, link.rest)
        else:
            if link.rest is not None and session.long_poll is None and (
                    len(link.unsent) < BUFFER_CAP):
                self.again[link] = None  # it waited for this commit, or sent its replies
            self._watch(link, now)
            self._set_mask(link)

    def _run(self, link: Link) -> None:
        """Run what the link has buffered, within the pass's budget."""
        session = link.session
        if session.login_by is not None:
            if link.fresh:  # (else its task just ran all it could of the login)
                link.wants_task = True  # (the login: in the task, scrypt runs in a thread)
                link.rest = []
            return
        if len(link.unsent) >= BUFFER_CAP:
            return  # its replies drain first (`_flush_unsent` brings it back)
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
