"""The Python client of queued's MessagePack-RPC port: the blocking `Client`, and the public API.

Owns the blocking connections (one per server, one call at a time, replies matched by
msgid) and the calls' failover. Delivery is at-least-once: a call is re-sent (on a fresh
connection or another server) only after its connection broke, so a put may then be
stored twice. Re-exports the errors, values and `AsyncClient` so users import from here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from queued.client.aio import AsyncClient, AsyncConsumer
from queued.client.core import (
    CLOSING,
    DEFAULT_PORT,
    FAILOVER,
    RECV,
    SERIALS,
    BadParams,
    BadQueueName,
    BadResponse,
    Busy,
    ClientClosed,
    ClientError,
    ClientStatistics,
    ConnectionFailed,
    Data,
    Item,
    ItemTooLarge,
    JournalFull,
    Malformed,
    Msgids,
    Pool,
    QueueFull,
    QueueInfo,
    RpcCallError,
    ServerError,
    Servers,
    ServerState,
    ServerStatistics,
    ShuttingDown,
    Timeout,
    TooLarge,
    TooManyOpenReads,
    UnknownMethod,
    all_failed,
    call_error,
    check_get,
    check_timeouts,
    encode_items,
    int_result,
    lookup,
    make_parser,
    parse_servers,
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

__all__ = [
    "DEFAULT_PORT",
    "AsyncClient",
    "AsyncConsumer",
    "BadParams",
    "BadQueueName",
    "BadResponse",
    "Busy",
    "Client",
    "ClientClosed",
    "ClientError",
    "ClientStatistics",
    "ConnectionFailed",
    "Item",
    "ItemTooLarge",
    "JournalFull",
    "Malformed",
    "QueueFull",
    "QueueInfo",
    "RpcCallError",
    "ServerError",
    "ServerStatistics",
    "ShuttingDown",
    "Timeout",
    "TooLarge",
    "TooManyOpenReads",
    "UnknownMethod",
    "parse_servers",
]


class _SyncConnection:
    """One socket: one request at a time, replies matched by msgid."""

    def __init__(self, server: ServerState, connect_timeout: float, max_frame: int,
                 max_batch: int) -> None:
        self.address = server.address
        self.serial = next(SERIALS)
        try:
            self.sock = socket.create_connection((server.host, server.port), connect_timeout)
        except OSError as exc:  # refused, unreachable, timed out, name not found
            raise ConnectionFailed(f"{server.address}: cannot connect: {exc}",
                                   server.address) from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = make_parser(max_frame, max_batch)
        self.msgids = Msgids()
        self.broken = False

    def close(self) -> None:
        self.broken = True
        self.sock.close()

    def call(self, method: str, params: list[Any], wait: float) -> Any:
        if self.broken:
            raise ConnectionFailed(f"{self.address}: connection closed", self.address)
        msgid = self.msgids.next()
        deadline = time.monotonic() + wait
        try:
            self.sock.settimeout(wait)
            self.sock.sendall(encode_request(msgid, method, params))
            while True:
                response = self._next_response(deadline)
                if response.msgid == msgid:
                    break
                # Any other msgid belongs to a call nobody waits for any more.
        except TimeoutError:
            self.close()
            raise Timeout(f"{self.address}: no reply to {method} within {wait:.3g} s",
                          self.address) from None
        except OSError as exc:
            self.close()
            raise ConnectionFailed(f"{self.address}: connection broke during {method}: {exc}",
                                   self.address) from exc
        except ClientError:
            self.close()
            raise
        if response.error is not None:
            error = call_error(response.error, self.address)
            if error.code in CLOSING:
                self.close()
            raise error
        return response.result

    def _next_response(self, deadline: float) -> Response:
        while True:
            try:
                event = self.parser.next_event()
            except RpcError as exc:
                raise BadResponse(f"{self.address}: {exc}") from None
            if event is NEED_DATA:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self.sock.settimeout(remaining)
                self.parser.receive_data(self.sock.recv(RECV))
            elif isinstance(event, ConnectionClosed):
                raise ConnectionFailed(f"{self.address}: the server closed the connection",
                                       self.address)
            elif isinstance(event, Response):
                return event
            elif isinstance(event, Notification):
                if event.method == "error" and event.params:
                    raise call_error(event.params[0], self.address)
            else:
                raise BadResponse(f"{self.address}: the server sent a request")


class Client:
    """A blocking client of one or several servers (`"host:port"`, a list, or tuples).

    Timeouts are in seconds; the queue operations' `*_ms` arguments are milliseconds, as
    on the wire. A call waits for its reply at most `read_timeout` (plus a get's own
    timeout_ms). One connection per server, opened on first use. Calls are serialized by
    a lock: share a Client between threads if you like, but use one per thread for
    concurrency (a long-polling get holds the lock).

    Several servers (no cluster: the client chooses): each put goes to the next server in
    round robin; a get asks each server with timeout 0 starting at its own rotating
    cursor, then long-polls one in turn for at most `poll_slice` seconds until its timeout
    runs out. A server whose connection fails (refused, reset, timed out) or that
    answers SHUTTING_DOWN or BUSY is skipped for `backoff` seconds, doubling per failure up to
    `max_backoff`, and the call is retried on the next server; when every server fails,
    the call raises (ConnectionFailed, or the one server's own error). A call on a reused
    connection that turns out broken is first re-sent once on a fresh connection.
    peek/flush/delete/flush_all/stats ask every server and raise if any fails.
    max_frame and max_batch cap what the client accepts from a server (a get's reply,
    a stats map); keep them at least the servers' rpc_max_frame and rpc_max_batch.
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
        self._conns: dict[str, _SyncConnection] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._calls = self._connects = self._retries = self._unconfirmed = 0

    # -- plumbing

    def _connection(self, server: ServerState) -> tuple[_SyncConnection, bool]:
        """The server's connection and whether it is fresh (opened now)."""
        if self._closed:
            raise ClientClosed("the client is closed")
        conn = self._conns.get(server.address)
        if conn is not None and not conn.broken:
            return conn, False
        conn = _SyncConnection(server, self.connect_timeout, self._max_frame, self._max_batch)
        self._connects += 1
        self._conns[server.address] = conn
        return conn, True

    def _on(self, server: ServerState, method: str, params: list[Any],
            wait: float) -> tuple[int, Any]:
        """(connection serial, result) of one call on one server."""
        conn, fresh = self._connection(server)
        self._calls += 1
        try:
            return conn.serial, conn.call(method, params, wait)
        except ConnectionFailed:
            if fresh:
                raise
        self._retries += 1  # the server may have closed an idle connection: once more
        conn, _ = self._connection(server)
        self._calls += 1
        return conn.serial, conn.call(method, params, wait)

    def _failover(self, order: list[ServerState], method: str, params: list[Any],
                  wait: float) -> tuple[ServerState, int, Any]:
        errors: list[ClientError] = []
        for server in order:
            try:
                serial, result = self._on(server, method, params, wait)
            except FAILOVER as exc:
                self._pool.failed(server, time.monotonic())
                errors.append(exc)
                if len(errors) < len(order):
                    self._retries += 1
                continue
            self._pool.ok(server)
            return server, serial, result
        raise all_failed(errors)

    def _everyone(self, method: str, params: list[Any]) -> list[tuple[str, Any]]:
        answers: list[tuple[str, Any]] = []
        errors: list[ClientError] = []
        for server in self._pool.servers:
            try:
                _, result = self._on(server, method, params, self.read_timeout)
            except FAILOVER as exc:
                self._pool.failed(server, time.monotonic())
                errors.append(exc)
                continue
            self._pool.ok(server)
            answers.append((server.address, result))
        if errors:
            raise all_failed(errors)
        return answers

    # -- the protocol's methods

    def call(self, method: str, *params: Any, server: str | None = None) -> Any:
        """A raw call: the result as decoded, or the mapped RpcCallError.

        Goes to `server` ("host:port" as in `servers`) or to the next server in the put
        rotation, with failover.
        """
        with self._lock:
            order = ([lookup(self._pool, server)] if server is not None
                     else self._pool.order("put", time.monotonic()))
            return self._failover(order, method, list(params), self.read_timeout)[2]

    def put(self, queue: str, items: Data | Iterable[Data], expiration_ms: int = 0) -> int:
        """Store items (bytes, or str as UTF-8; a single one or an iterable) on one server.

        Returns how many were stored. expiration_ms is relative; 0 = never.
        """
        batch = encode_items(items)
        with self._lock:
            order = self._pool.order("put", time.monotonic())
            result = self._failover(order, "put", [queue, batch, expiration_ms],
                                    self.read_timeout)[2]
        return int_result(result, "put")

    def get(self, queue: str, max_items: int = 1, timeout_ms: int = 0,
            auto_abort_ms: int = 0) -> list[Item]:
        """Up to max_items items, waiting up to timeout_ms for the first; [] if none came.

        auto_abort_ms > 0 makes each item an open read held by this client's connection
        to its server: confirm() it, or it returns to the queue after auto_abort_ms or
        when the connection closes. 0 removes the items at once (at most once).
        """
        check_get(max_items, timeout_ms, auto_abort_ms)
        with self._lock:
            deadline = time.monotonic() + timeout_ms / 1000
            order = self._pool.order("get", time.monotonic())
            if len(order) == 1:
                return self._get_from(order, queue, max_items, timeout_ms, auto_abort_ms,
                                      first_answer=True)
            while True:
                items = self._get_from(order, queue, max_items, 0, auto_abort_ms,
                                       first_answer=False)
                left_ms = int((deadline - time.monotonic()) * 1000)
                if items or left_ms <= 0:
                    return items
                wait_ms = min(left_ms, int(self.poll_slice * 1000))
                order = self._pool.order("get", time.monotonic())  # skips any just failed
                items = self._get_from(order, queue, max_items, wait_ms, auto_abort_ms,
                                       first_answer=True)
                if items:
                    return items
                order = self._pool.order("get", time.monotonic())

    def _get_from(self, order: list[ServerState], queue: str, max_items: int, timeout_ms: int,
                  auto_abort_ms: int, *, first_answer: bool) -> list[Item]:
        """Ask the servers in order until one has items (or, first_answer, until one answers)."""
        errors: list[ClientError] = []
        wait = timeout_ms / 1000 + self.read_timeout
        for server in order:
            try:
                serial, result = self._on(server, "get",
                                          [queue, max_items, timeout_ms, auto_abort_ms], wait)
            except FAILOVER as exc:
                self._pool.failed(server, time.monotonic())
                errors.append(exc)
                continue
            self._pool.ok(server)
            items = to_items(result, queue, server.address, serial if auto_abort_ms else 0)
            if items or first_answer:
                return items
        if len(errors) == len(order):
            raise all_failed(errors)
        return []

    def confirm(self, items: Item | Iterable[Item]) -> int:
        """Confirm open reads (items from a get with auto_abort_ms); returns how many counted.

        Each item goes to the connection it came from. Items whose connection has closed
        since count 0: the server has already returned them to the queue.
        """
        return self._settle("confirm", items)

    def abort(self, items: Item | Iterable[Item]) -> int:
        """Return open reads to their queues; returns how many counted (see confirm)."""
        return self._settle("abort", items)

    def _settle(self, method: str, items: Item | Iterable[Item]) -> int:
        total = 0
        with self._lock:
            for (address, queue, serial), ids in settle_groups(items).items():
                conn = self._conns.get(address)
                if serial == 0 or conn is None or conn.serial != serial or conn.broken:
                    continue
                self._calls += 1
                total += int_result(conn.call(method, [queue, ids], self.read_timeout), method)
        return total

    def peek(self, queue: str) -> QueueInfo:
        with self._lock:
            return queue_info(queue, self._everyone("peek", [queue]))

    def flush(self, queue: str) -> int:
        """Remove every item of the queue (or of one fanout reader) on every server."""
        with self._lock:
            return sum(int_result(r, "flush") for _, r in self._everyone("flush", [queue]))

    def delete(self, queue: str) -> bool:
        """Delete the queue on every server; True if any server had it."""
        with self._lock:
            return any(r is True for _, r in self._everyone("delete", [queue]))

    def flush_all(self) -> int:
        with self._lock:
            return sum(int_result(r, "flush_all") for _, r in self._everyone("flush_all", []))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each server's `{"server": {...}, "queues": {...}}`, keyed by "host:port"."""
        with self._lock:
            return {s: r for s, r in self._everyone("stats", [])}

    def version(self) -> str:
        """The version of the first server (in put rotation) that answers."""
        result = self.call("version")
        if not isinstance(result, str):
            raise BadResponse(f"version answered {result!r}")
        return result

    # -- reliable processing

    @contextmanager
    def reserve(self, queue: str, timeout_ms: int = 0,
                auto_abort_ms: int = 60_000) -> Iterator[Item | None]:
        """Get one item as an open read; confirm it if the body ends normally, abort if it raises.

        Yields None when no item came within timeout_ms: the body always runs, so check.
        A confirm or abort that cannot reach the server (the connection is gone) is not an
        error: the server returns the item to the queue, and it will be delivered again.
        """
        if auto_abort_ms <= 0:
            raise ValueError("reserve needs auto_abort_ms > 0")
        got = self.get(queue, 1, timeout_ms, auto_abort_ms)
        item = got[0] if got else None
        try:
            yield item
        except BaseException:
            if item is not None:
                self._settle_quietly([], [item])
            raise
        if item is not None:
            self._settle_quietly([item], [])

    def consume(self, queue: str, *, batch: int = 100, timeout_ms: int = 1000,
                auto_abort_ms: int = 0, max_items: int | None = None,
                stop_when_empty: bool = False) -> Iterator[Item]:
        """Yield items, fetched `batch` at a time, until max_items or (stop_when_empty) an
        empty get; otherwise forever.

        Reliable mode (auto_abort_ms > 0): an item is confirmed once the loop asks for the
        next one after it. Confirms are sent per batch, before the next batch is fetched.
        When the loop stops early (break, or an exception in its body closes the generator)
        the items it finished are confirmed and the current one and the rest of its batch
        are aborted, so they come back. auto_abort_ms must cover a whole batch's processing.
        Plain mode (0): items are removed when fetched; stopping early loses the rest of
        the batch (use batch=1).
        """
        if batch < 1 or (max_items is not None and max_items < 0):
            raise ValueError("want batch >= 1 and max_items >= 0")
        return self._consume(queue, batch, timeout_ms, auto_abort_ms, max_items, stop_when_empty)

    def _consume(self, queue: str, batch: int, timeout_ms: int, auto_abort_ms: int,
                 max_items: int | None, stop_when_empty: bool) -> Iterator[Item]:
        got = 0
        while max_items is None or got < max_items:
            want = batch if max_items is None else min(batch, max_items - got)
            items = self.get(queue, want, timeout_ms, auto_abort_ms)
            if not items:
                if stop_when_empty:
                    return
                continue
            got += len(items)
            done = 0
            try:
                for item in items:
                    yield item
                    done += 1
            finally:
                if auto_abort_ms:
                    self._settle_quietly(items[:done], items[done:])

    def _settle_quietly(self, confirm: list[Item], abort: list[Item]) -> None:
        for method, items in (("confirm", confirm), ("abort", abort)):
            if not items:
                continue
            try:
                n = self._settle(method, items)
            except FAILOVER:
                n = 0
            if method == "confirm":
                self._unconfirmed += len(items) - n

    # -- lifetime

    def statistics(self) -> ClientStatistics:
        def connected(address: str) -> bool:
            conn = self._conns.get(address)
            return conn is not None and not conn.broken

        return ClientStatistics(self._calls, self._connects, self._retries, self._unconfirmed,
                                tuple(self._pool.statistics(connected, time.monotonic())))

    def close(self) -> None:
        """Close every connection (the servers return their open reads). Idempotent."""
        with self._lock:
            self._closed = True
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# -- the trio client ----------------------------------------------------------------------------
