"""The operations port (2223): /metrics, /livez, /readyz, /stats.json and the web
console (`queued.server.console`) over HTTP/1.1.

h11 parses and frames the HTTP; this module only routes and logs users in. It starts
before recovery, so a probe can tell "alive but still recovering" (/livez 200, /readyz
503) from "dead". GET and HEAD, and POST for the console's actions only; keep-alive;
every read is bounded in bytes and time, and a bad request gets a 4xx and a closed
connection, never a crash. A HEAD gets what a GET would without the body, error replies
included. With users, nothing but the probes answers a stranger, and no reply names the
server or its version (no `Server` header, a realm that is not its name): what runs
where is no stranger's business. It reads the server through `OpsServer` and never
imports the listeners (they import it).
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Protocol, runtime_checkable

import h11
import trio

from queued import __version__
from queued.config import ServerConfig
from queued.server.auth import Authenticator
from queued.server.console import SECURITY_HEADERS, Console, is_console_path, wants_html
from queued.server.history import SAMPLE_S, History
from queued.server.metrics import StatsSource, render, take_snapshot
from queued.server.readiness import Probed, reasons, told
from queued.server.replies import JSON, TEXT, Reply, json_reply
from queued.server.replies import text as _text
from queued.server.tls import ServerTls
from queued.server.transport import peer_name
from queued.stats import ProtocolStats
from queued.wire.access import Grant, sees_everything, visible

log = logging.getLogger("queued.http")

RECEIVE_SIZE = 64 * 1024
#: Request line plus headers, bytes.
MAX_HEADER_BYTES = 16 * 1024
#: GETs and the console's POSTs have no business sending a body; a small one is read and
#: ignored.
MAX_BODY_BYTES = 64 * 1024
#: Time allowed for one whole request to arrive (also the keep-alive idle time).
REQUEST_TIMEOUT = 30.0
#: Open HTTP connections; more are closed at once (scrapers and probes need few).
MAX_CONNECTIONS = 64

TOO_MANY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                  b"Connection: close\r\n\r\n")
REQUEST_TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
ROUTES = ("/metrics", "/livez", "/readyz", "/stats.json")
#: Open to anyone (the probes); the others need HTTP Basic authentication when users are set.
OPEN_ROUTES = frozenset({"/livez", "/readyz"})
#: The realm names no product: a stranger learns nothing of what answers.
UNAUTHORIZED = (("Content-Type", TEXT), ("WWW-Authenticate", 'Basic realm="login", '
                                                           'charset="UTF-8"'))


@runtime_checkable
class OpsServer(StatsSource, Probed, Protocol):
    """What the operations port reads from the server: a scrape's `StatsSource`, plus
    /readyz's shutdown flags and write probe (`readiness.Probed`), and /stats.json's
    figures. `queued.server.listeners.Server` satisfies it structurally; this module
    never imports the listeners."""

    def stats(self) -> Mapping[str, object]: ...
    # Not read here: the listeners' signal watcher reaches the server through `Ops.server`.
    def request_shutdown(self, why: str) -> None: ...
    def reload(self) -> None: ...


class Ops:
    """What the operations port answers from: the server once recovery is done."""

    def __init__(self, config: ServerConfig, *, login: Authenticator | None = None,
                 tls: ServerTls | None = None) -> None:
        self.config = config
        self.login = login
        self.tls = tls
        self.server: OpsServer | None = None  # set when recovery has finished
        self.stats = ProtocolStats()  # this port's connections and refusals
        self.history = History(config.metrics_max_queues)
        self.console = Console(users=login is not None, history=self.history)
        self._render_limiter = trio.CapacityLimiter(1)

    @property
    def connections(self) -> int:
        return self.stats.connections

    async def authorized(self, headers: list[tuple[bytes, bytes]], peer: str
                         ) -> tuple[bool, Grant | None]:
        """(logged in, the user's grant): HTTP Basic credentials of a configured user
        (/metrics, /stats.json and the console show it only the queues it may use, but
        /metrics all to an admin or a metrics user), or (True, None) with no users."""
        if self.login is None:
            return True, None
        for name, value in headers:
            if name == b"authorization":
                scheme, _, encoded = value.partition(b" ")
                if scheme.lower() != b"basic":
                    break
                try:
                    user, sep, password = base64.b64decode(encoded.strip(), validate=True
                                                           ).decode().partition(":")
                except (binascii.Error, UnicodeDecodeError):
                    break
                grant = await self.login.login(user, password, peer) if sep else None
                if grant is not None:
                    return True, grant
                break
        self.stats.auth_failures += 1
        return False, None

    def problems(self) -> list[str]:
        """Why the server is not ready, in full; [] when it is."""
        return [r.detail for r in reasons(self.server)]

    async def respond(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                      peer: str = "?") -> Reply:
        path, _, query = target.decode("ascii", "replace").partition("?")
        console = is_console_path(path) or (path == "/" and wants_html(headers))
        if method not in (b"GET", b"HEAD") and not (method == b"POST" and console):
            return Reply(405, b"only GET and HEAD\n", (("Content-Type", TEXT),
                                                       ("Allow", "GET, HEAD")))
        grant = None
        if console or path not in OPEN_ROUTES:
            ok, grant = await self.authorized(headers, peer)
            if not ok:
                return Reply(401, b"authentication required: HTTP Basic, a user of the "
                                  b"users file\n", UNAUTHORIZED)
        elif self.login is not None and any(k == b"authorization" for k, _ in headers):
            grant = (await self.authorized(headers, peer))[1]  # a probe may log in, or not
        if console:
            server = self.server
            reply = await self.console.respond(
                method, path, headers, grant, None if server is None else server.broker,
                scheme="http" if self.tls is None else "https", query=query)
            assert reply is not None
            return reply
        if path == "/livez":
            return _text(200, "ok\n")
        if path == "/readyz":
            found = reasons(self.server)
            if not found:
                return _text(200, "ready\n")
            # With users, what failed is named to an admin, each user its own queues,
            # and nobody else: a probe without credentials reads only the kind of trouble.
            sees = (None if self.login is None or (grant is not None and grant.admin)
                    else (lambda _: False) if grant is None else grant.may_see)
            return _text(503, "not ready: " + "\n".join(told(found, sees)) + "\n")
        if path == "/metrics":
            return await self._metrics(headers, grant)
        if path == "/stats.json":
            if self.server is None:
                return Reply(503, b'{"error": "recovering the journals"}\n',
                             (("Content-Type", JSON),))
            return json_reply(200, visible(self.server.stats(), grant))
        if path == "/":
            return _text(200, f"queued {__version__}: " + " ".join(ROUTES)
                         + " (a browser gets the web console here)\n")
        return _text(404, f"not found; try {', '.join(ROUTES)}\n")

    async def _metrics(self, headers: list[tuple[bytes, bytes]], grant: Grant | None
                       ) -> Reply:
        accept = encoding = ""
        for name, value in headers:
            if name == b"accept":
                accept = value.decode("latin-1")
            elif name == b"accept-encoding":
                encoding = value.decode("latin-1")
        snapshot = take_snapshot(self.server, ready=not self.problems(),
                                 max_readers=self.config.metrics_max_queues,
                                 more=(("http", self.stats),),
                                 scope=None if grant is None or sees_everything(grant)
                                 else grant.may_see)
        # Formatting thousands of series is pure Python: off the event loop.
        body, extra = await trio.to_thread.run_sync(
            render, snapshot, accept, encoding, limiter=self._render_limiter)
        return Reply(200, body, tuple(extra))


# -- the connection loop ---------------------------------------------------------------------


async def serve_http(
    ops: Ops,
    listeners: list[trio.SocketListener],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the operations port until cancelled; reports the bound port when started."""
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, _handler(ops), listeners)
        nursery.start_soon(_sample_history, ops)
        task_status.started(listeners[0].socket.getsockname()[1])


async def _sample_history(ops: Ops) -> None:
    """The console charts' samples: every SAMPLE_S once recovery has finished."""
    while True:
        server = ops.server
        if server is not None:
            ops.history.sample(time.time(), server.broker.queue_stats())
        await trio.sleep(SAMPLE_S)


def _handler(ops: Ops) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def handle(stream: trio.SocketStream) -> None:
        stats = ops.stats
        if stats.connections >= MAX_CONNECTIONS:
            log.warning("http: %d connections open, refusing a new one", stats.connections)
            stats.refused_connections += 1
            if ops.tls is None:
                await _refuse(stream)
            else:
                await stream.aclose()
            return
        stats.connections += 1
        stats.total_connections += 1
        peer = peer_name(stream)
        conn: trio.abc.Stream = stream
        try:
            if ops.tls is not None:
                tls = await ops.tls.accept(stream, peer, ops.config.auth_timeout / 1000)
                if tls is None:
                    stats.tls_handshake_failures += 1
                    return
                conn = tls
            await _connection(ops, conn, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("http: request failed; closing the connection")
        finally:
            stats.connections -= 1
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await conn.aclose()

    return handle



async def _refuse(stream: trio.SocketStream) -> None:
    """503 without reading the request; then drain a little so the close is not a reset."""
    with trio.move_on_after(1):
        try:
            await stream.send_all(TOO_MANY_REPLY)
            await stream.send_eof()
            while await stream.receive_some(RECEIVE_SIZE):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await stream.aclose()


async def _connection(ops: Ops, stream: trio.abc.Stream, peer: str) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    while True:
        try:
            with trio.move_on_after(REQUEST_TIMEOUT) as timer:
                request = await _read_request(conn, stream)
            if timer.cancelled_caught:
                if conn.trailing_data[0] or conn.their_state is not h11.IDLE:
                    # Stalled mid-request (h11 has no state to answer from: plain bytes).
                    with trio.move_on_after(1):
                        await stream.send_all(REQUEST_TIMEOUT_REPLY)
                return
        except _BadRequest as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _send(conn, stream, exc.reply, head=exc.head, close=True,
                            named=ops.login is None)
            return
        if request is None:
            return  # the client closed the connection
        reply = await ops.respond(request.method, request.target, list(request.headers), peer)
        log.debug("http: %s %s -> %d", request.method.decode(), request.target.decode(
            "ascii", "replace"), reply.status)
        await _send(conn, stream, reply, head=request.method == b"HEAD",
                    named=ops.login is None)
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            return


class _BadRequest(Exception):
    """A request answered with an error status, after which the connection closes.

    `head`: the request was a HEAD, so the reply must carry no body (RFC 9110 9.3.2),
    whether or not h11 got far enough to know the method.
    """

    def __init__(self, status: int, text: str, *, head: bool) -> None:
        super().__init__(text)
        self.reply = _text(status, text)
        self.head = head


_HEAD = b"HEAD "


async def _read_request(conn: h11.Connection, stream: trio.abc.Stream) -> h11.Request | None:
    """The next request, its body (if any) read and dropped; None at a clean close.

    Raises _BadRequest for a request to refuse.
    """
    # The request's first bytes, kept to tell a HEAD that h11 refuses before it has
    # parsed the method: its buffer may have dropped them by then. A pipelined
    # request's start is already in that buffer.
    start = conn.trailing_data[0][:len(_HEAD)]
    request: h11.Request | None = None
    body = 0
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(RECEIVE_SIZE)
                start += data[:len(_HEAD) - len(start)]
                conn.receive_data(bytes(data))  # b"" tells h11 the peer closed
            elif isinstance(event, h11.Request):
                request = event
                # h11 bounds only what it buffers of an incomplete request: a whole
                # one that arrived in a single read is checked here.
                size = len(request.target) + sum(len(k) + len(v) + 4
                                                 for k, v in request.headers)
                if size > MAX_HEADER_BYTES:
                    raise _BadRequest(431, "request header fields too large\n",
                                      head=_is_head(request, start))
            elif isinstance(event, h11.Data):
                body += len(event.data)
                if body > MAX_BODY_BYTES:
                    raise _BadRequest(413, "a request body is not expected\n",
                                      head=_is_head(request, start))
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None
    except h11.RemoteProtocolError as exc:
        raise _BadRequest(exc.error_status_hint, f"bad request: {exc}\n",
                          head=_is_head(request, start)) from exc


def _is_head(request: h11.Request | None, start: bytes) -> bool:
    if request is not None:
        return request.method == b"HEAD"
    return start == _HEAD


async def _send(conn: h11.Connection, stream: trio.abc.Stream, reply: Reply, *,
                head: bool = False, close: bool = False, named: bool = True) -> None:
    """`reply` through h11. A HEAD gets the headers GET would, without the body; `named`:
    with a `Server` header (not with users: a stranger learns no name or version).

    A reply that closes the connection ends with the close: h11 is not asked for an
    EndOfMessage, which it would refuse after a HEAD it never parsed (it would still
    expect the declared body).
    """
    headers = [
        ("Date", email.utils.formatdate(usegmt=True)),
        *((("Server", f"queued/{__version__}"),) if named else ()),
        ("Cache-Control", "no-store"),
        ("Content-Length", str(len(reply.body))),
        *reply.headers,
        *SECURITY_HEADERS,
    ]
    if close:
        headers.append(("Connection", "close"))
    events: list[h11.Response | h11.Data | h11.EndOfMessage] = [
        h11.Response(status_code=reply.status, headers=headers,
                     reason=HTTPStatus(reply.status).phrase)]
    if not head:
        events.append(h11.Data(data=reply.body))
    if not close:
        events.append(h11.EndOfMessage())
    out = b"".join(conn.send(ev) or b"" for ev in events)
    with trio.move_on_after(REQUEST_TIMEOUT):
        await stream.send_all(out)
