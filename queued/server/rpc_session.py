"""One MessagePack-RPC connection against the broker.

Owns the connection's loop: receive, parse (`rpc_protocol`), run each call, send
the replies. Calls run in the order they arrive; a `get` that has to wait moves to
a task of its own, so later requests are answered first (matched by msgid).
Consecutive puts are all begun before any is awaited: one write, one fsync. It
never parses bytes itself and never touches the journal but through the broker.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import trio

from queued import __version__
from queued.broker import PendingPut
from queued.core import rpc_protocol as rp
from queued.core.errors import (
    BadNameError,
    ItemTooLargeError,
    JournalClosedError,
    JournalError,
    JournalFullError,
    QueueClosedError,
    QueueFullError,
    ReadStateError,
)
from queued.core.open_reads import OpenReads
from queued.core.queue import Item

if TYPE_CHECKING:
    from queued.server.listeners import Server

log = logging.getLogger("queued.rpc")

RECEIVE_SIZE = 256 * 1024
#: Calls parsed from the receive buffer before they are run (bounds the batch).
MAX_CALLS = 1024
#: Gets waiting at once on one connection; more are refused (BUSY).
MAX_WAITING = 1024
#: Notifications are run without a reply, except these: without a reply they would
#: only lose items (get) or do nothing (peek, stats, version).
_NOTIFY_REFUSED = frozenset({"get", "peek", "stats", "version"})


def error_for(exc: BaseException) -> tuple[rp.ErrorCode, str]:
    """The wire error of an exception a call raised."""
    E = rp.ErrorCode
    if isinstance(exc, rp.RpcError):
        return exc.code, exc.message
    if isinstance(exc, BadNameError):
        return E.BAD_QUEUE_NAME, str(exc)
    if isinstance(exc, QueueFullError):
        return E.QUEUE_FULL, str(exc)
    if isinstance(exc, ItemTooLargeError):
        return E.ITEM_TOO_LARGE, str(exc)
    if isinstance(exc, JournalFullError):
        return E.JOURNAL_FULL, str(exc)
    if isinstance(exc, ReadStateError):
        return E.TOO_MANY_OPEN_READS, str(exc)
    if isinstance(exc, (QueueClosedError, JournalClosedError)):
        return E.SHUTTING_DOWN, str(exc)
    if isinstance(exc, ValueError):
        return E.BAD_PARAMS, str(exc)
    if isinstance(exc, OSError):
        return E.SERVER_ERROR, exc.strerror or str(exc)
    if isinstance(exc, JournalError):
        return E.SERVER_ERROR, str(exc)
    return E.SERVER_ERROR, f"{type(exc).__name__}: {exc}"


class RpcSession:
    """A connection speaking MessagePack-RPC; its open reads go back when it ends."""

    protocol = "rpc"

    def __init__(self, server: Server, stream: trio.SocketStream, name: str) -> None:
        self.server = server
        self.broker = server.broker
        self.stream = stream
        self.client = OpenReads(name)
        self.stats = server.protocols[self.protocol]
        cfg = server.config
        self.max_batch = cfg.rpc_max_batch
        self.max_frame = max(64, cfg.rpc_max_frame)
        self.parser = rp.RpcParser(max_frame=self.max_frame, max_batch=self.max_batch)
        self.out = bytearray()
        self.send_lock = trio.Lock()
        self.receive_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        self.busy = False
        self.done = False  # stop reading (quit, or a closing error was answered)
        self.lost = False  # the peer is gone
        self.batches = 0  # batches run; a waiting get that answers later sends itself
        self.waiting = 0

    @staticmethod
    def too_many() -> bytes:
        return rp.RpcError(rp.ErrorCode.BUSY, "too many connections").reply

    def stop_if_idle(self) -> None:
        """Shutdown: stop reading; waiting gets (woken empty by the broker) still answer."""
        if not self.busy and self.receive_scope is not None:
            self.receive_scope.cancel()

    async def run(self) -> None:
        """The connection's loop; the server's handler does the bookkeeping around it."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._receive_loop()
            if not self.server.closing:
                nursery.cancel_scope.cancel()  # the peer is gone: so are its gets

    async def _receive_loop(self) -> None:
        counters = self.server.counters
        while not (self.done or self.server.closing):
            with trio.CancelScope() as self.receive_scope:
                try:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
            if self.receive_scope.cancelled_caught:
                return
            counters.bytes_read += len(data)
            self.parser.receive_data(data)
            self.busy = True
            try:
                await self._run_batch()
                await self._flush()
            finally:
                self.batches += 1
                self.busy = False
            if not data:
                return

    async def _flush(self) -> None:
        """Send what the replies added so far; a lost peer ends the session quietly."""
        async with self.send_lock:
            if self.out:
                data = bytes(self.out)
                self.out.clear()
                if self.lost:
                    return  # the peer is gone: nobody to answer
                self.server.counters.bytes_written += len(data)
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    log.debug("%s: connection lost: %s", self.client.name, exc)
                    self.lost = self.done = True
                    if self.receive_scope is not None:
                        self.receive_scope.cancel()

    # -- one batch -------------------------------------------------------------------------

    async def _run_batch(self) -> None:
        puts: list[tuple[rp.Put, PendingPut | None, bool]] = []
        calls = 0
        while not self.done:
            if calls >= MAX_CALLS:
                await self._end_puts(puts)
                await self._flush()
                calls = 0
            try:
                ev = self.parser.next_event()
            except rp.RpcError as exc:
                await self._end_puts(puts)
                self.stats.protocol_errors += 1
                self._refuse(exc)
                return
            if ev is rp.NEED_DATA or isinstance(ev, rp.ConnectionClosed):
                if isinstance(ev, rp.ConnectionClosed) and ev.unparsed:
                    log.info("%s: closed mid-request, %d bytes dropped", self.client.name,
                             ev.unparsed)
                break
            calls += 1
            if isinstance(ev, rp.Response):
                log.debug("%s: ignored a response (msgid %d)", self.client.name, ev.msgid)
                continue
            reply = True
            if isinstance(ev, rp.Notification):
                if ev.method in _NOTIFY_REFUSED:
                    self.stats.protocol_errors += 1
                    log.warning("%s: %s sent as a notification ignored (it needs a reply)",
                                self.client.name, ev.method)
                    continue
                ev, reply = rp.Request(0, ev.method, ev.params), False
            try:
                call = rp.parse_call(ev, self.max_batch)
            except rp.RpcError as exc:
                await self._end_puts(puts)
                self.stats.protocol_errors += 1
                if reply or exc.close:
                    self._refuse(exc)
                continue
            self.stats.count(ev.method)
            if isinstance(call, rp.Put):
                puts.append((call, await self._begin_put(call, reply), reply))
                continue
            await self._end_puts(puts)  # a later call sees the puts before it
            await self._call(call, reply)
            if len(self.out) >= RECEIVE_SIZE:
                await self._flush()
        await self._end_puts(puts)

    def _refuse(self, exc: rp.RpcError) -> None:
        log.debug("%s: %s", self.client.name, exc)
        self.out += exc.reply
        if exc.close:
            self.done = True

    def _error(self, msgid: int, exc: BaseException, reply: bool) -> None:
        code, message = error_for(exc)
        if code is rp.ErrorCode.SERVER_ERROR:
            log.warning("%s: request %d failed: %s", self.client.name, msgid, message)
        if reply:
            self.out += rp.encode_error(msgid, code, message)

    # -- puts ---------------------------------------------------------------------------------

    async def _begin_put(self, call: rp.Put, reply: bool) -> PendingPut | None:
        b = self.broker
        b.counters.cmd_set += 1
        limit = self.server.config.max_item_size
        try:
            if call.items and max(map(len, call.items)) > limit:
                raise ItemTooLargeError(f"item over the server's max_item_size ({limit} bytes)")
            expire = b.clock() + call.expiration_ms if call.expiration_ms else None
            return await b.begin_put(call.queue, call.items, expire_ms=expire)
        except Exception as exc:
            self._error(call.msgid, exc, reply)
            return None

    async def _end_puts(self, puts: list[tuple[rp.Put, PendingPut | None, bool]]) -> None:
        """Wait for every begun put (shielded: each must be ended), then answer them."""
        if not puts:
            return
        with trio.CancelScope(shield=True):
            for call, pending, reply in puts:
                if pending is None:
                    continue  # refused in begin; already answered
                try:
                    n = await self.broker.end_put(pending)
                except Exception as exc:
                    self._error(call.msgid, exc, reply)
                else:
                    if reply:
                        self.out += rp.encode_response(call.msgid, n)
        puts.clear()

    # -- everything else ------------------------------------------------------------------------

    async def _call(self, call: rp.Call, reply: bool) -> None:
        try:
            if isinstance(call, rp.Get):
                await self._get(call)
                return
            result = await self._run(call)
        except Exception as exc:
            self._error(call.msgid, exc, reply)
        else:
            if reply:
                self.out += rp.encode_response(call.msgid, result)

    async def _run(self, call: rp.Call) -> Any:
        b, client = self.broker, self.client
        if isinstance(call, rp.Confirm):
            return b.confirm(client, call.queue, call.reader, ids=call.ids)
        if isinstance(call, rp.Abort):
            return b.abort(client, call.queue, call.reader, ids=call.ids)
        if isinstance(call, rp.Peek):
            item = await b.get(call.queue, call.reader, peek=True)
            return {"head": None if item is None else [item.id, item.data],
                    **b.reader_info(call.queue, call.reader)}
        if isinstance(call, rp.Flush):
            return b.flush(call.queue, call.reader)
        if isinstance(call, rp.Delete):
            return await b.delete(call.queue, call.reader)
        if isinstance(call, rp.FlushAll):
            return b.flush_all()
        if isinstance(call, rp.Stats):
            return self.server.stats()
        if isinstance(call, rp.Version):
            return __version__
        raise AssertionError(f"unhandled call {call!r}")  # pragma: no cover

    async def _get(self, call: rp.Get) -> None:
        if call.timeout_ms <= 0:
            items = await self._get_many(call)
            self.out += _items_reply(call.msgid, items)
            return
        if self.waiting >= MAX_WAITING:
            raise rp.RpcError(rp.ErrorCode.BUSY,
                              f"{MAX_WAITING} gets are already waiting on this connection")
        assert self.nursery is not None
        # Runs inline until it answers or starts to wait; then later requests go on.
        await self.nursery.start(self._waiting_get, call)

    async def _get_many(self, call: rp.Get,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                        ) -> list[Item]:
        auto_abort = call.auto_abort_ms
        return await self.broker.get_many(
            call.queue, call.reader, call.max_items, timeout_ms=call.timeout_ms,
            client=self.client, open=auto_abort > 0, open_timeout_ms=auto_abort,
            max_bytes=self.max_frame // 2, task_status=task_status)

    async def _waiting_get(self, call: rp.Get, task_status: trio.TaskStatus[None]) -> None:
        batch = self.batches
        self.waiting += 1
        try:
            items = await self._get_many(call, task_status)
        except Exception as exc:
            self._error(call.msgid, exc, True)
            with suppress(RuntimeError):  # failed before it started: report started now
                task_status.started()
        else:
            self.out += _items_reply(call.msgid, items)
        finally:
            self.waiting -= 1
        if batch != self.batches or not self.busy:
            await self._flush()  # answered after its batch went out: send it now


def _items_reply(msgid: int, items: list[Item]) -> bytes:
    return rp.encode_response(msgid, [[it.id, it.data] for it in items])
