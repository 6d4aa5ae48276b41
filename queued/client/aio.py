"""The trio client of queued's MessagePack-RPC port: `AsyncClient` (import it from queued.client).

Owns the trio connections: calls from any number of tasks pipelined on one stream per
server, and one reader task per stream handing each reply to its caller by msgid. Server
choice, back-off and failover follow Client's rules (shared in client_common). It never
leaves a cancelled get's connection open: a late reply carrying items could be lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import trio

from queued.client.core import (
    CLOSING,
    DEFAULT_PORT,
    FAILOVER,
    RECV,
    SERIALS,
    BadResponse,
    ClientClosed,
    ClientError,
    ClientStatistics,
    ConnectionFailed,
    Data,
    Item,
    Msgids,
    Pool,
    QueueInfo,
    RpcCallError,
    Servers,
    ServerState,
    Timeout,
    all_failed,
    call_error,
    check_get,
    check_timeouts,
    encode_items,
    int_result,
    lookup,
    make_parser,
    queue_info,
    settle_groups,
    to_items,
)
from queued.core.rpc_protocol import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    ConnectionClosed,
    Notification,
    Response,
    RpcError,
    encode_request,
)

__all__ = ["AsyncClient", "AsyncConsumer"]


@dataclass(slots=True, eq=False)
class _Slot:
    event: trio.Event = field(default_factory=trio.Event)
    response: Response | None = None
    error: ClientError | None = None


class _AsyncConnection:
    """One trio stream: calls from any task, replies dispatched by msgid by one reader task."""

    def __init__(self, address: str, stream: trio.SocketStream, max_frame: int,
                 max_batch: int) -> None:
        self.address = address
        self.serial = next(SERIALS)
        self.stream = stream
        self.parser = make_parser(max_frame, max_batch)
        self.msgids = Msgids()
        self.pending: dict[int, _Slot] = {}
        self.send_lock = trio.Lock()
        self.error: ClientError | None = None  # set once the connection is over

    def kill(self, error: ClientError) -> None:
        """End the connection now (sync, so it works in finally blocks and cancellations)."""
        if self.error is None:
            self.error = error
        self.stream.socket.close()  # wakes the reader with ClosedResourceError
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
                data = await self.stream.receive_some(RECV)
                self.parser.receive_data(data)
                if not self._dispatch():
                    return
        except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            if self.error is None:
                self.error = ConnectionFailed(f"{self.address}: connection broke: {exc}",
                                              self.address)
        except ClientError as exc:
            if self.error is None:
                self.error = exc
        finally:
            if self.error is None:
                self.error = ConnectionFailed(f"{self.address}: connection closed", self.address)
            self.stream.socket.close()
            self._fail_pending()

    def _dispatch(self) -> bool:
        """Hand out every complete reply; False when the connection is over."""
        while True:
            try:
                event = self.parser.next_event()
            except RpcError as exc:
                raise BadResponse(f"{self.address}: {exc}") from None
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                self.error = ConnectionFailed(f"{self.address}: the server closed the "
                                              "connection", self.address)
                return False
            if isinstance(event, Response):
                slot = self.pending.pop(event.msgid, None)
                if slot is not None:  # else: a call that was given up
                    slot.response = event
                    slot.event.set()
                if event.error is not None and call_error(event.error, "").code in CLOSING:
                    self.error = ConnectionFailed(f"{self.address}: the server closed the "
                                                  "connection after an error", self.address)
                    return False
            elif isinstance(event, Notification):
                if event.method == "error" and event.params:
                    raise call_error(event.params[0], self.address)
            else:
                raise BadResponse(f"{self.address}: the server sent a request")

    def _fresh(self, error: ClientError) -> ClientError:
        """A new exception like `error`: one shared instance would pile up tracebacks."""
        if isinstance(error, RpcCallError):
            return call_error([int(error.code), error.message], self.address)
        if isinstance(error, Timeout):
            return Timeout(str(error), self.address)
        if isinstance(error, BadResponse | ClientClosed):
            return type(error)(str(error))
        return ConnectionFailed(str(error), self.address)

    async def call(self, method: str, params: list[Any], wait: float) -> Any:
        if self.error is not None:
            raise ConnectionFailed(f"{self.address}: connection closed ({self.error})",
                                   self.address)
        msgid = self.msgids.next()
        slot = _Slot()
        self.pending[msgid] = slot
        sent = answered = False
        try:
            frame = encode_request(msgid, method, params)
            async with self.send_lock:
                sent = True
                try:
                    await self.stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.kill(ConnectionFailed(f"{self.address}: connection broke during "
                                               f"{method}: {exc}", self.address))
                except BaseException:  # cancelled mid-frame: the stream is out of step
                    self.kill(ConnectionFailed(f"{self.address}: a send was interrupted",
                                               self.address))
                    raise
            with trio.move_on_after(wait):
                await slot.event.wait()
            if not slot.event.is_set():
                self.kill(Timeout(f"{self.address}: no reply to {method} within {wait:.3g} s",
                                  self.address))
            answered = True
        finally:
            gone = self.pending.pop(msgid, None) is not None
            if not answered and gone and sent and method == "get":
                # A get given up (cancelled) may still be answered with items: closing the
                # connection makes the server return open reads instead of losing them.
                self.kill(ConnectionFailed(f"{self.address}: a get was cancelled", self.address))
        if slot.error is not None:
            raise self._fresh(slot.error)
        assert slot.response is not None
        if slot.response.error is not None:
            raise call_error(slot.response.error, self.address)
        return slot.response.result


class AsyncClient:
    """The trio twin of `Client`: same methods, awaited; use it as `async with AsyncClient(...)`.

    Any number of tasks may share it: each server has one connection, requests are
    pipelined on it and a reader task hands each reply to its caller by msgid. Server
    choice, back-off and failover are Client's. Cancelling a get that is waiting closes
    its connection (other calls on it fail over or fail), because a reply carrying items
    could otherwise be lost; give get a timeout_ms instead.
    """

    def __init__(self, servers: Servers = f"127.0.0.1:{DEFAULT_PORT}", *,
                 connect_timeout: float = 5.0, read_timeout: float = 10.0,
                 backoff: float = 1.0, max_backoff: float = 30.0, poll_slice: float = 0.5,
                 max_frame: int = DEFAULT_MAX_FRAME, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        check_timeouts(connect_timeout, read_timeout, poll_slice)
        self._pool = Pool(servers, backoff, max_backoff)
        self.servers: tuple[str, ...] = tuple(s.address for s in self._pool.servers)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.poll_slice = poll_slice
        self._max_frame = max_frame
        self._max_batch = max_batch
        self._conns: dict[str, _AsyncConnection] = {}
        self._connect_locks = {s.address: trio.Lock() for s in self._pool.servers}
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._calls = self._connects = self._retries = self._unconfirmed = 0

    async def __aenter__(self) -> AsyncClient:
        if self._stack is not None or self._closed:
            raise ClientClosed("an AsyncClient can be entered once")
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._stack is not None
        try:
            self._close_all()  # sync: nothing may stop the nursery below from being exited
        finally:
            # The reader tasks end with their sockets; the body's own exception goes on
            # unwrapped (not in an exception group) because the nursery is not given it.
            await self._stack.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close every connection (the servers return their open reads). Idempotent."""
        self._close_all()
        await trio.lowlevel.checkpoint()

    def _close_all(self) -> None:
        self._closed = True
        for conn in self._conns.values():
            conn.kill(ClientClosed("the client is closed"))
        self._conns.clear()

    # -- plumbing

    async def _connection(self, server: ServerState) -> tuple[_AsyncConnection, bool]:
        if self._closed or self._nursery is None:
            raise ClientClosed("the client is closed" if self._closed
                               else "use the AsyncClient in `async with`")
        async with self._connect_locks[server.address]:
            conn = self._conns.get(server.address)
            if conn is not None and conn.error is None:
                return conn, False
            try:
                with trio.fail_after(self.connect_timeout):
                    stream = await trio.open_tcp_stream(server.host, server.port)
            except (OSError, trio.TooSlowError) as exc:
                raise ConnectionFailed(f"{server.address}: cannot connect: "
                                       f"{str(exc) or 'timed out'}", server.address) from exc
            if self._closed:
                await stream.aclose()
                raise ClientClosed("the client is closed")
            conn = _AsyncConnection(server.address, stream, self._max_frame, self._max_batch)
            self._connects += 1
            self._conns[server.address] = conn
            self._nursery.start_soon(conn.read_loop)
            return conn, True

    async def _on(self, server: ServerState, method: str, params: list[Any],
                  wait: float) -> tuple[int, Any]:
        conn, fresh = await self._connection(server)
        self._calls += 1
        try:
            return conn.serial, await conn.call(method, params, wait)
        except ConnectionFailed:
            if fresh:
                raise
        self._retries += 1
        conn, _ = await self._connection(server)
        self._calls += 1
        return conn.serial, await conn.call(method, params, wait)

    async def _failover(self, order: list[ServerState], method: str, params: list[Any],
                        wait: float) -> tuple[ServerState, int, Any]:
        errors: list[ClientError] = []
        for server in order:
            try:
                serial, result = await self._on(server, method, params, wait)
            except FAILOVER as exc:
                self._pool.failed(server, trio.current_time())
                errors.append(exc)
                if len(errors) < len(order):
                    self._retries += 1
                continue
            self._pool.ok(server)
            return server, serial, result
        raise all_failed(errors)

    async def _everyone(self, method: str, params: list[Any]) -> list[tuple[str, Any]]:
        answers: list[tuple[str, Any]] = []
        errors: list[ClientError] = []
        for server in self._pool.servers:
            try:
                _, result = await self._on(server, method, params, self.read_timeout)
            except FAILOVER as exc:
                self._pool.failed(server, trio.current_time())
                errors.append(exc)
                continue
            self._pool.ok(server)
            answers.append((server.address, result))
        if errors:
            raise all_failed(errors)
        return answers

    # -- the protocol's methods (see Client for their meaning)

    async def call(self, method: str, *params: Any, server: str | None = None) -> Any:
        order = ([lookup(self._pool, server)] if server is not None
                 else self._pool.order("put", trio.current_time()))
        return (await self._failover(order, method, list(params), self.read_timeout))[2]

    async def put(self, queue: str, items: Data | Iterable[Data], expiration_ms: int = 0) -> int:
        batch = encode_items(items)
        order = self._pool.order("put", trio.current_time())
        result = await self._failover(order, "put", [queue, batch, expiration_ms],
                                      self.read_timeout)
        return int_result(result[2], "put")

    async def get(self, queue: str, max_items: int = 1, timeout_ms: int = 0,
                  auto_abort_ms: int = 0) -> list[Item]:
        check_get(max_items, timeout_ms, auto_abort_ms)
        deadline = trio.current_time() + timeout_ms / 1000
        order = self._pool.order("get", trio.current_time())
        if len(order) == 1:
            return await self._get_from(order, queue, max_items, timeout_ms, auto_abort_ms,
                                        first_answer=True)
        while True:
            items = await self._get_from(order, queue, max_items, 0, auto_abort_ms,
                                         first_answer=False)
            left_ms = int((deadline - trio.current_time()) * 1000)
            if items or left_ms <= 0:
                return items
            wait_ms = min(left_ms, int(self.poll_slice * 1000))
            order = self._pool.order("get", trio.current_time())  # skips any just failed
            items = await self._get_from(order, queue, max_items, wait_ms, auto_abort_ms,
                                         first_answer=True)
            if items:
                return items
            order = self._pool.order("get", trio.current_time())

    async def _get_from(self, order: list[ServerState], queue: str, max_items: int,
                        timeout_ms: int, auto_abort_ms: int, *,
                        first_answer: bool) -> list[Item]:
        errors: list[ClientError] = []
        wait = timeout_ms / 1000 + self.read_timeout
        for server in order:
            try:
                serial, result = await self._on(
                    server, "get", [queue, max_items, timeout_ms, auto_abort_ms], wait)
            except FAILOVER as exc:
                self._pool.failed(server, trio.current_time())
                errors.append(exc)
                continue
            self._pool.ok(server)
            items = to_items(result, queue, server.address, serial if auto_abort_ms else 0)
            if items or first_answer:
                return items
        if len(errors) == len(order):
            raise all_failed(errors)
        return []

    async def confirm(self, items: Item | Iterable[Item]) -> int:
        return await self._settle("confirm", items)

    async def abort(self, items: Item | Iterable[Item]) -> int:
        return await self._settle("abort", items)

    async def _settle(self, method: str, items: Item | Iterable[Item]) -> int:
        total = 0
        for (address, queue, serial), ids in settle_groups(items).items():
            conn = self._conns.get(address)
            if serial == 0 or conn is None or conn.serial != serial or conn.error is not None:
                continue
            self._calls += 1
            total += int_result(await conn.call(method, [queue, ids], self.read_timeout),
                                 method)
        return total

    async def peek(self, queue: str) -> QueueInfo:
        return queue_info(queue, await self._everyone("peek", [queue]))

    async def flush(self, queue: str) -> int:
        return sum(int_result(r, "flush") for _, r in await self._everyone("flush", [queue]))

    async def delete(self, queue: str) -> bool:
        return any(r is True for _, r in await self._everyone("delete", [queue]))

    async def flush_all(self) -> int:
        answers = await self._everyone("flush_all", [])
        return sum(int_result(r, "flush_all") for _, r in answers)

    async def stats(self) -> dict[str, dict[str, Any]]:
        return {s: r for s, r in await self._everyone("stats", [])}

    async def version(self) -> str:
        result = await self.call("version")
        if not isinstance(result, str):
            raise BadResponse(f"version answered {result!r}")
        return result

    # -- reliable processing

    @asynccontextmanager
    async def reserve(self, queue: str, timeout_ms: int = 0,
                      auto_abort_ms: int = 60_000) -> AsyncIterator[Item | None]:
        """`async with client.reserve(q) as item:` as Client.reserve (item may be None)."""
        if auto_abort_ms <= 0:
            raise ValueError("reserve needs auto_abort_ms > 0")
        got = await self.get(queue, 1, timeout_ms, auto_abort_ms)
        item = got[0] if got else None
        try:
            yield item
        except BaseException:
            if item is not None:
                await self._settle_quietly([], [item])
            raise
        if item is not None:
            await self._settle_quietly([item], [])

    def consume(self, queue: str, *, batch: int = 100, timeout_ms: int = 1000,
                auto_abort_ms: int = 0, max_items: int | None = None,
                stop_when_empty: bool = False) -> AsyncConsumer:
        """`async with client.consume(q, ...) as items: async for item in items:`.

        The rules are Client.consume's. A bare `async for` works too, but stopping it
        early then leaves its batch open until auto_abort_ms or the client closes.
        """
        if batch < 1 or (max_items is not None and max_items < 0):
            raise ValueError("want batch >= 1 and max_items >= 0")
        return AsyncConsumer(self, queue, batch, timeout_ms, auto_abort_ms, max_items,
                             stop_when_empty)

    async def _settle_quietly(self, confirm: list[Item], abort: list[Item]) -> None:
        # Runs on the way out of cancelled code too: shielded, and bounded.
        with trio.CancelScope(shield=True), trio.move_on_after(self.read_timeout):
            for method, items in (("confirm", confirm), ("abort", abort)):
                if not items:
                    continue
                try:
                    n = await self._settle(method, items)
                except FAILOVER:
                    n = 0
                if method == "confirm":
                    self._unconfirmed += len(items) - n

    def statistics(self) -> ClientStatistics:
        def connected(address: str) -> bool:
            conn = self._conns.get(address)
            return conn is not None and conn.error is None

        return ClientStatistics(self._calls, self._connects, self._retries, self._unconfirmed,
                                tuple(self._pool.statistics(connected, trio.current_time())))


class AsyncConsumer:
    """AsyncClient.consume's iterator; an async context manager settles it on the way out."""

    def __init__(self, client: AsyncClient, queue: str, batch: int, timeout_ms: int,
                 auto_abort_ms: int, max_items: int | None, stop_when_empty: bool) -> None:
        self._client = client
        self._queue = queue
        self._batch = batch
        self._timeout_ms = timeout_ms
        self._auto_abort_ms = auto_abort_ms
        self._max_items = max_items
        self._stop_when_empty = stop_when_empty
        self._items: list[Item] = []
        self._handed = 0  # items of self._items returned so far
        self._got = 0
        self._done = False

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> Item:
        # Being asked for the next item means every item handed out so far is done.
        while True:
            if self._handed < len(self._items):
                self._handed += 1
                return self._items[self._handed - 1]
            if self._items:
                finished, self._items, self._handed = self._items, [], 0
                if self._auto_abort_ms:
                    await self._client._settle_quietly(finished, [])
            if self._done or (self._max_items is not None and self._got >= self._max_items):
                self._done = True
                raise StopAsyncIteration
            want = (self._batch if self._max_items is None
                    else min(self._batch, self._max_items - self._got))
            items = await self._client.get(self._queue, want, self._timeout_ms,
                                           self._auto_abort_ms)
            if not items and self._stop_when_empty:
                self._done = True
            self._items, self._handed = items, 0
            self._got += len(items)

    async def aclose(self) -> None:
        """Stop: confirm the items finished, abort the current one and the rest of its batch."""
        self._done = True
        items, self._items = self._items, []
        if items and self._auto_abort_ms:
            current = max(self._handed - 1, 0)
            await self._client._settle_quietly(items[:current], items[current:])
        elif items:
            await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
