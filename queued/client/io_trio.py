"""The trio side of the clients' I/O: one stream per server, calls pipelined on it by any task.

`AsyncClient` (queued.client.aio) is written against these names; io_sync has the same
names for the generated blocking `Client`. Owns streams, the reader tasks handing each
reply to its caller by msgid, and cancellation; never chooses servers or fails over. It
never leaves a cancelled get's connection open: a late reply carrying items could be lost.
"""

from __future__ import annotations

import concurrent.futures
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import (
    AbstractContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass, field
from typing import Any

import trio

from queued.client.common import (
    BadResponse,
    ClientClosed,
    ClientError,
    ConnectionFailed,
    RpcCallError,
    Timeout,
    call_error,
)
from queued.client.credentials import TlsChannel, handshake_failure
from queued.client.framing import RECV, ClientConnection, closes
from queued.client.servers import ServerState
from queued.wire.rpc_protocol import Response

Lock = trio.Lock
#: A lock held only around a table's update, never across a wait (the heartbeats' table):
#: a thread lock in both clients (the blocking client's threads share the table).
TableLock = threading.Lock
now = trio.current_time
checkpoint = trio.lowlevel.checkpoint
sleep = trio.sleep


def call_gate() -> AbstractContextManager[Any]:
    """An AsyncClient's calls run concurrently (pipelined), so they pass an open gate."""
    return nullcontext()


async def wait_for(lookups: Collection[concurrent.futures.Future[Any]],
                   patience: float | None) -> None:
    """Until every look-up (discovery.resolve_soon) is done, or `patience` seconds (None:
    no limit) have passed; waits in a worker thread, abandoned if cancelled (the
    look-ups go on)."""
    if not all(f.done() for f in lookups):
        await trio.to_thread.run_sync(concurrent.futures.wait, lookups, patience,
                                      abandon_on_cancel=True)


@asynccontextmanager
async def repeating(interval: float, fn: Callable[..., Awaitable[None]],
                    *args: Any) -> AsyncIterator[None]:
    """Run `await fn(*args)` every `interval` seconds while the body runs (a task), at
    the multiples of `interval` on trio's clock: loops with the same interval fall due
    together (the first call comes within `interval`, not after exactly that)."""
    async def loop() -> None:
        while True:
            await trio.sleep_until((trio.current_time() // interval + 1) * interval)
            await fn(*args)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


@contextmanager
def shielded(timeout: float) -> Iterator[None]:
    """Cancellation cannot stop the body (it settles items on the way out); `timeout` can."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        yield


class Network:
    """Opens an AsyncClient's connections (TLS ones with `tls`); their reader tasks run in a
    nursery that is open while the client is in `async with`."""

    def __init__(self, tls: ssl.SSLContext | None) -> None:
        self._tls = tls
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._over = False

    async def open(self, closed: bool) -> None:
        if self._stack is not None or closed:
            raise ClientClosed("an AsyncClient can be entered once")
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())

    async def aclose(self) -> None:
        """Wait for the reader tasks: close their connections first."""
        self._over = True
        if self._stack is not None:
            # The body's own exception goes on unwrapped (not in an exception group)
            # because the nursery is not given it.
            await self._stack.__aexit__(None, None, None)

    async def connect(self, server: ServerState, timeout: float, max_frame: int,
                      max_batch: int) -> Connection:
        if self._nursery is None:
            raise ClientClosed("use the AsyncClient in `async with`")
        deadline = trio.current_time() + timeout
        try:
            with trio.fail_at(deadline):
                tcp = await trio.open_tcp_stream(server.host, server.port)
        except (OSError, trio.TooSlowError) as exc:
            raise ConnectionFailed(f"{server.address}: cannot connect: "
                                   f"{str(exc) or 'timed out'}", server.address) from exc
        stream: trio.abc.Stream | TlsStream = tcp
        if self._tls is not None:
            stream = await _handshake(tcp, self._tls, server, deadline)
        if self._over:  # the client left `async with` meanwhile: no task may start now
            tcp.socket.close()
            raise ClientClosed("the client is closed")
        conn = Connection(server.address, stream, tcp.socket, max_frame, max_batch,
                          tls=self._tls is not None)
        self._nursery.start_soon(conn.read_loop)
        return conn


async def _handshake(tcp: trio.SocketStream, context: ssl.SSLContext, server: ServerState,
                     deadline: float) -> TlsStream:
    """`tcp` after a client handshake (the connect timeout covers both); closed if it fails."""
    tls = TlsStream(tcp, context, server.tls_name or server.host)
    try:
        with trio.fail_at(deadline):
            await tls.handshake()
    except (OSError, trio.BrokenResourceError) as exc:  # ssl.SSLError, reset, end of stream
        tcp.socket.close()
        raise ConnectionFailed(handshake_failure(server.address, exc), server.address) from exc
    except trio.TooSlowError as exc:
        tcp.socket.close()
        raise ConnectionFailed(f"{server.address}: TLS handshake timed out (is the server's "
                               "port TLS?)", server.address) from exc
    except BaseException:
        tcp.socket.close()
        raise
    return tls


class TlsStream:
    """A TlsChannel on a trio socket stream, with the two stream calls `Connection` makes:
    one reader task (`receive_some`) and senders one at a time (`send_all`, under the
    connection's lock); a record the reader owes the server goes out under this stream's
    own lock, so that records leave in the order they were made."""

    def __init__(self, tcp: trio.SocketStream, context: ssl.SSLContext, host: str) -> None:
        self.tcp = tcp
        self.channel = TlsChannel(context, host)
        self.raw = bytearray(RECV)  # ciphertext, as the socket gives it
        self.send_lock = trio.Lock()

    async def handshake(self) -> None:
        while not self.channel.handshake():
            await self._send_owed()
            await self._fill()
        await self._send_owed()

    async def receive_some(self, max_bytes: int) -> bytes:
        """Everything decrypted so far (`max_bytes` is the channel's own); b"" at the end."""
        while True:
            data = self.channel.decrypt()
            await self._send_owed()
            if data is not None:
                return data
            await self._fill()

    async def send_all(self, data: bytes) -> None:
        async with self.send_lock:
            try:
                records = self.channel.encrypt(data)
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS: {exc}") from exc
            await self.tcp.send_all(records)

    async def _fill(self) -> None:
        with memoryview(self.raw) as view:
            got = await self.tcp.socket.recv_into(view)
            self.channel.feed(view[:got])

    async def _send_owed(self) -> None:
        if self.channel.outgoing.pending:
            async with self.send_lock:  # encrypt and drain under one lock: records in order
                await self.tcp.send_all(self.channel.to_send())


@dataclass(slots=True, eq=False)
class _Slot:
    event: trio.Event = field(default_factory=trio.Event)
    response: Response | None = None
    error: ClientError | None = None


class Connection(ClientConnection):
    """One trio stream (TCP, or TLS over it): calls from any task, replies dispatched by
    msgid by one reader task."""

    def __init__(self, address: str, stream: trio.abc.Stream | TlsStream,
                 sock: trio.socket.SocketType,
                 max_frame: int, max_batch: int, *, tls: bool) -> None:
        super().__init__(address, max_frame, max_batch, tls=tls)
        self.stream = stream
        self.sock = sock  # closing it ends the stream now, without a (TLS) goodbye
        self.pending: dict[int, _Slot] = {}
        self.send_lock = trio.Lock()

    @property
    def busy(self) -> bool:
        """Calls wait for replies on it (closing it now would fail them)."""
        return bool(self.pending)

    def close(self, error: ClientError) -> None:
        """End the connection now (sync, so it works in finally blocks and cancellations)."""
        self.end(error)
        self.sock.close()  # wakes the reader with ClosedResourceError
        self._fail_pending()

    def _fail_pending(self) -> None:
        error = self.error or ConnectionFailed(f"{self.address}: connection closed", self.address)
        for slot in self.pending.values():
            slot.error = error
            slot.event.set()
        self.pending.clear()

    async def read_loop(self) -> None:
        """The reader task: never raises anything but Cancelled."""
        try:
            while True:
                self.receive_data(await self.stream.receive_some(RECV))
                while (response := self.next_reply()) is not None:
                    slot = self.pending.pop(response.msgid, None)
                    if slot is not None:  # else: a call that was given up
                        slot.response = response
                        slot.event.set()
                    if closes(response):
                        raise ConnectionFailed(f"{self.address}: the server closed the "
                                               "connection after an error", self.address)
        except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            why = exc if str(exc) or exc.__cause__ is None else exc.__cause__
            self.end(self.lost(f"{self.address}: connection broke: {why}"))
        except ClientError as exc:
            self.end(exc)
        finally:
            self.end(ConnectionFailed(f"{self.address}: connection closed", self.address))
            self.sock.close()
            self._fail_pending()

    def _fresh(self, error: ClientError) -> ClientError:
        """A new exception like `error`: one shared instance would pile up tracebacks."""
        if isinstance(error, RpcCallError):
            return call_error([int(error.code), error.message], self.address)
        if isinstance(error, Timeout):
            return Timeout(str(error), self.address)
        if isinstance(error, BadResponse | ClientClosed):
            return type(error)(str(error))
        return ConnectionFailed(str(error), self.address,
                                refused=isinstance(error, ConnectionFailed) and error.refused)

    async def call(self, method: str, params: list[Any], wait: float,
                   prepare: Callable[[list[Any]], None] | None = None) -> Any:
        """The call's result. `prepare(params)` runs just before the frame is encoded,
        in the order calls are sent on this connection (an idempotent put takes its
        sequence there), or not at all when the call fails before that."""
        if self.error is not None:
            raise ConnectionFailed(f"{self.address}: connection closed ({self.error})",
                                   self.address)
        slot = _Slot()
        msgid = 0
        if prepare is None:
            msgid, frame = self.request(method, params)
            self.pending[msgid] = slot
        sent = answered = False
        try:
            async with self.send_lock:
                if prepare is not None:
                    if self.error is not None:
                        raise ConnectionFailed(f"{self.address}: connection closed "
                                               f"({self.error})", self.address)
                    prepare(params)
                    msgid, frame = self.request(method, params)
                    self.pending[msgid] = slot
                sent = True
                try:
                    await self.stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    why = exc if str(exc) or exc.__cause__ is None else exc.__cause__
                    self.close(self.lost(f"{self.address}: connection broke during {method}: "
                                         f"{why}"))
                except BaseException:  # cancelled mid-frame: the stream is out of step
                    self.close(ConnectionFailed(f"{self.address}: a send was interrupted",
                                                self.address))
                    raise
            with trio.move_on_after(wait):
                await slot.event.wait()
            if not slot.event.is_set():
                self.close(self.no_reply(method, wait))
            answered = True
        finally:
            gone = self.pending.pop(msgid, None) is not None
            if not answered and gone and sent and method == "get":
                # A get given up (cancelled) may still be answered with items: closing the
                # connection makes the server return open reads instead of losing them.
                self.close(ConnectionFailed(f"{self.address}: a get was cancelled",
                                            self.address))
        if slot.error is not None:
            raise self._fresh(slot.error)
        assert slot.response is not None
        if slot.response.error is not None:
            raise call_error(slot.response.error, self.address)
        return slot.response.result
