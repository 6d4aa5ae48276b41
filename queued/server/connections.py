"""The reactor's connections: a `Link` per connection, its transport, and what the
reactor does to one connection outside a pass's run of requests.

`Connections` owns the epoll and every link in it: sending (plain, or encrypted by the
connection's `TlsChannel`; what the socket does not take waits for EPOLLOUT, and a
connection with more than BUFFER_CAP waiting is not read), the epoll mask, the
deadlines (the login's, a begun request's, unread replies', long polls') on two timer
heaps, and a connection's end or hand-over to its own task. `queued.server.reactor`'s
`Reactor` builds the passes on it.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import os
import select
import ssl
from itertools import count
from typing import Final

import trio

from queued.server.session import Session
from queued.server.tls import TlsChannel
from queued.server.transport import SocketTransport
from queued.wire import commands as c

log = logging.getLogger("queued.server")

#: Bytes read from one connection per pass (a larger read costs more than it saves:
#: glibc maps fresh memory for each bytes object over 128 KiB, and unmaps it).
RECEIVE_SIZE: Final = 64 * 1024
#: A connection with this much unsent output is not read until it drains (nor one
#: with complete requests left for the next pass).
BUFFER_CAP: Final = 256 * 1024

#: errno values of a peer that went away (or a socket closed under us).
GONE_ERRORS: Final = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN,
                                errno.ETIMEDOUT, errno.EBADF, errno.ESHUTDOWN,
                                errno.ECONNABORTED})
#: The epoll events of a connection to read, and of one whose replies wait to be sent
#: (Final: compiled, a C static each, not a look-up in `select` at each use).
IN_EVENTS: Final = select.EPOLLIN | select.EPOLLRDHUP
OUT_EVENTS: Final = select.EPOLLOUT
#: what a ready connection is read for: input, a hang-up or an error
READ_EVENTS: Final = IN_EVENTS | select.EPOLLHUP | select.EPOLLERR
EPOLLIN: Final = select.EPOLLIN


class Link:
    """One connection as the reactor holds it (see `Turns` in queued.server.task_path)."""

    __slots__ = ("closing", "deadline", "drained", "fd", "fresh", "handed", "in_task",
                 "mask", "poll_due", "reactor", "rest", "seen", "session", "tls", "turn",
                 "unsent", "unsent_since", "waiting_since", "wants_task")

    def __init__(self, reactor: Connections, session: Session, fd: int,
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


class Connections:
    """See the module docstring."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.wake_fd, select.EPOLLIN)
        self.links: dict[int, Link] = {}
        #: links to run in the next pass without reading (handed back, over budget,
        #: or waiting for a commit), in order
        self.again: dict[Link, None] = {}
        self.buffer = bytearray(RECEIVE_SIZE)
        self.view = memoryview(self.buffer)
        self.timers: list[tuple[float, int, Link]] = []
        #: deadlines of RPC gets waiting in line (a link may have several)
        self.poll_timers: list[tuple[float, int, Link]] = []
        self._seq = count()
        self.closing = False
        self.in_pass = False

    # -- connections (called from each connection's task) -----------------------------------

    def ready(self, link: Link) -> None:
        """The link's long poll can be answered (woken by a put, a deletion...)."""
        self.again[link] = None
        if not self.in_pass:
            self.wake()

    def forget(self, link: Link) -> None:
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
        self.set_mask(link)
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
            if exc.errno in GONE_ERRORS:
                self._lost(link, exc)
                return False
            raise
        if sent < len(data):
            link.unsent += memoryview(data)[sent:]
            link.unsent_since = now = trio.current_time()
            self.set_mask(link)
            guard = session.guard
            if guard is not None:  # (a task's replies too: it may wait on them forever)
                heapq.heappush(self.timers, (now + guard.request_timeout, next(self._seq),
                                             link))
                if not self.in_pass:
                    self.wake()  # (it may sleep past the new deadline)
        return True

    def flush_unsent(self, link: Link) -> None:
        try:
            sent = os.write(link.fd, link.unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in GONE_ERRORS:
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
            self.set_mask(link)

    def _lost(self, link: Link, exc: BaseException) -> None:
        log.debug("%s: connection lost: %s", link.session.name, exc)
        session = link.session
        session.lost = session.done = True
        link.unsent.clear()
        if link.drained is not None:
            link.drained.set()
            link.drained = None
        self.end(link)

    # -- the epoll mask, deadlines ------------------------------------------------------------

    def set_mask(self, link: Link) -> None:
        if self.links.get(link.fd) is not link or self.epoll.closed:
            return
        mask = 0
        if link.unsent:
            mask |= OUT_EVENTS
        session = link.session
        if not (link.in_task or link.closing or session.eof or len(link.unsent) > BUFFER_CAP
                ) and (link.rest is None or (session.long_poll is not None and
                                             session.codec.buffered_bytes() < BUFFER_CAP)):
            mask |= IN_EVENTS
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

    def watch(self, link: Link, now: float) -> None:
        """After the link's part of a pass: when its begun request (or its unread
        replies) started to wait, and the deadline that follows."""
        session = link.session
        if session.codec.pending() or (link.tls is not None and link.tls.mid_record()):
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

    def expire(self, now: float) -> None:
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
            self.end(link)

    # -- ending and handing over ------------------------------------------------------------

    def end(self, link: Link) -> None:
        """The connection ends: its task finishes it (open reads, the socket)."""
        link.closing = True
        self.set_mask(link)
        self.again.pop(link, None)
        if not link.in_task:
            self.hand(link, None)

    def hand(self, link: Link, rest: list[c.Parsed] | None) -> None:
        link.in_task = True
        link.handed = rest
        link.rest = None
        link.wants_task = False
        self.again.pop(link, None)
        self.set_mask(link)
        if link.turn is not None:
            link.turn.set()
            link.turn = None
