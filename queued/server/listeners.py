"""The network shell: trio listeners and one session per connection.

Owns sockets, connection limits, shutdown and the mapping from protocol events
to broker calls and back to reply bytes. The parsers (`memcache_protocol`,
`text_protocol`) and the queues (`broker`) do the real work; a session reads a
chunk, parses every complete command in it, runs them in order (consecutive
puts share one journal write), and answers the whole batch with one send.

Shutdown (SIGTERM, SIGINT, the `shutdown` command): close the listeners, answer
waiting gets as empty, let sessions finish the batch they are running (at most
`shutdown_grace`, 5 s by default, as Docker's stop waits 10 s before SIGKILL),
return every open read to its queue, write every checkpoint, and close the
journals (fsync).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from queued import __version__
from queued.broker import Broker, PendingPut
from queued.config import ConfigError, ServerConfig, reload_queue_configs
from queued.core import memcache_protocol as mc
from queued.core import text_protocol as tp
from queued.core.errors import (
    ItemTooLargeError,
    JournalError,
    JournalFullError,
    QueueClosedError,
    QueueError,
    QueueFullError,
    ReadStateError,
)
from queued.core.open_reads import OpenReads
from queued.core.queue import Item
from queued.core.stats import ProtocolStats, command_name
from queued.server.http import Ops, serve_http
from queued.server.metrics import disk_usage
from queued.server.rpc_session import RpcSession
from queued.upkeep import open_broker

log = logging.getLogger("queued.server")

RECEIVE_SIZE = 256 * 1024
#: Commands parsed from the receive buffer before they are run (bounds the batch).
MAX_BATCH = 1024
#: memcache: exptime values below this are relative seconds, as in memcached.
RELATIVE_EXPTIME_LIMIT = 1_000_000


#: How often the data dir's free space is checked, and how often a low-space warning repeats.
DISK_CHECK_SECONDS = 10.0
DISK_WARN_REPEAT_SECONDS = 300.0

#: The listeners that speak a queue protocol (http is served apart, by queued.server.http).
PROTOCOLS = ("memcache", "text", "rpc")


@dataclass(slots=True)
class ServerCounters:
    bytes_read: int = 0
    bytes_written: int = 0


class Server:
    """Listeners and sessions over one Broker."""

    def __init__(self, broker: Broker, config: ServerConfig) -> None:
        self.broker = broker
        self.config = config
        self.counters = ServerCounters()
        self.protocols = {proto: ProtocolStats() for proto in PROTOCOLS}
        self.ports: dict[str, int] = {}
        self.closing = False
        self.shutdown_requested = trio.Event()
        self._sessions: set[_Session | RpcSession] = set()
        self._disk_warned_at: float | None = None

    def request_shutdown(self, why: str) -> None:
        if not self.shutdown_requested.is_set():
            log.info("shutting down: %s", why)
            self.shutdown_requested.set()

    async def run(
        self,
        listeners: dict[str, list[trio.SocketListener]],
        *,
        task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        for proto, ls in listeners.items():
            self.ports[proto] = ls[0].socket.getsockname()[1]
        async with trio.open_nursery() as outer:
            outer.start_soon(self._watch_disk)
            async with trio.open_nursery() as conns:
                async with trio.open_nursery() as acceptors:
                    for proto, ls in listeners.items():
                        handler = _handler(self, proto)
                        acceptors.start_soon(
                            partial(trio.serve_listeners, handler, ls, handler_nursery=conns))
                    task_status.started(self)
                    log.info("ready: %s", ", ".join(
                        f"{proto} on port {port}" for proto, port in self.ports.items()),
                        extra={"event": "ready", "ports": dict(self.ports)})
                    await self.shutdown_requested.wait()
                    acceptors.cancel_scope.cancel()
                for ls in listeners.values():
                    for listener in ls:
                        await listener.aclose()  # stop accepting
                self.closing = True
                self.broker.wake_waiters()
                for session in list(self._sessions):
                    session.stop_if_idle()
                outer.start_soon(self._deadline, conns.cancel_scope)
            outer.cancel_scope.cancel()
        log.info("all connections closed")

    async def _deadline(self, scope: trio.CancelScope) -> None:
        grace = self.config.shutdown_grace / 1000
        await trio.sleep(grace)
        log.warning("shutdown: sessions still busy after %.1f s, closing them", grace)
        scope.cancel()

    async def _watch_disk(self) -> None:
        while True:
            self.check_disk()
            await trio.sleep(DISK_CHECK_SECONDS)

    def check_disk(self) -> None:
        """Warn when the data dir's file system has less than `min_free_disk` free
        (again every DISK_WARN_REPEAT_SECONDS while it stays low), and say when it
        has room again."""
        limit = self.config.min_free_disk
        path = self.broker.datadir.path
        usage = disk_usage(path)
        if not limit or usage is None:
            return
        now = trio.current_time()
        if usage.free < limit:
            warned = self._disk_warned_at
            if warned is None or now - warned >= DISK_WARN_REPEAT_SECONDS:
                log.warning(
                    "data dir %s: disk nearly full: %s free of %s (min_free_disk %s)",
                    path, human_bytes(usage.free), human_bytes(usage.total), human_bytes(limit),
                    extra={"event": "disk_low", "free_bytes": usage.free,
                           "total_bytes": usage.total, "min_free_disk": limit})
                self._disk_warned_at = now
        elif self._disk_warned_at is not None:
            log.info("data dir %s: disk space back above min_free_disk: %s free", path,
                     human_bytes(usage.free),
                     extra={"event": "disk_ok", "free_bytes": usage.free})
            self._disk_warned_at = None

    # -- statistics --------------------------------------------------------------------

    def global_stats(self) -> list[tuple[str, object]]:
        b = self.broker
        c = b.counters
        readers = [fields for _, fields in b.queue_stats()]
        return [
            ("uptime", int(time.time() - b.start_time)),
            ("time", int(time.time())),
            ("version", __version__),
            ("curr_items", sum(f["items"] for f in readers)),
            ("total_items", c.total_items),
            ("bytes", sum(f["bytes"] for f in readers)),
            ("curr_connections", self.connections()),
            ("total_connections", sum(p.total_connections for p in self.protocols.values())),
            ("cmd_get", c.cmd_get),
            ("cmd_set", c.cmd_set),
            ("cmd_peek", c.cmd_peek),
            ("get_hits", c.get_hits),
            ("get_misses", c.get_misses),
            ("bytes_read", self.counters.bytes_read),
            ("bytes_written", self.counters.bytes_written),
            ("queue_creates", c.queue_creates),
            ("queue_deletes", c.queue_deletes),
            ("queue_expires", c.queue_expires),
        ]

    def stats(self) -> dict[str, object]:
        """The `stats` figures: {"server": {...}, "queues": {"q" or "q+reader": {...}}}."""
        return {"server": dict(self.global_stats()), "queues": dict(self.broker.queue_stats())}

    def connections(self) -> int:
        """Open client connections, every protocol together."""
        return sum(p.connections for p in self.protocols.values())

    def reload(self) -> None:
        """Re-read the config file's queue sections (Kestrel's `reload`)."""
        new = reload_queue_configs(self.config)
        self.config = new
        self.broker.reconfigure(new)


def _handler(server: Server, proto: str) -> Callable[[trio.SocketStream], Any]:
    cls = _SESSIONS[proto]
    stats = server.protocols[proto]

    async def handle(stream: trio.SocketStream) -> None:
        if server.connections() >= server.config.max_connections:
            stats.refused_connections += 1
            with trio.move_on_after(1):
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(cls.too_many())
            await stream.aclose()
            return
        session = cls(server, stream, _peer(stream))
        stats.connections += 1
        stats.total_connections += 1
        server._sessions.add(session)
        server.broker.register(session.client)
        try:
            await session.run()
        except Exception:  # one connection's failure must not take the server down
            log.exception("%s: session failed; closing the connection", session.client.name)
        finally:
            server._sessions.discard(session)
            stats.connections -= 1
            # Its open reads go back to their queues (not an error when we are stopping).
            server.broker.release(session.client, count_error=not server.closing)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    return handle


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KiB" (for log lines; config values use config.format_size)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # pragma: no cover


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


class _Session:
    """One connection: receive, parse, run a batch, send; release open reads at the end."""

    parser: mc.MemcacheParser | tp.TextParser
    protocol: str  # its listener's name in Server.protocols

    def __init__(self, server: Server, stream: trio.SocketStream, name: str) -> None:
        self.server = server
        self.broker = server.broker
        self.stream = stream
        self.client = OpenReads(name)
        self.stats = server.protocols[self.protocol]
        self.busy = False
        self.done = False
        self.eof = False
        self.scope = trio.CancelScope()
        self.out = bytearray()

    @staticmethod
    def too_many() -> bytes:
        raise NotImplementedError

    def stop_if_idle(self) -> None:
        if not self.busy:
            self.scope.cancel()

    async def run(self) -> None:
        """The connection's loop; the handler does the bookkeeping around it."""
        counters = self.server.counters
        try:
            with self.scope:
                while not (self.done or self.eof or self.server.closing):
                    try:
                        data = await self.stream.receive_some(RECEIVE_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    counters.bytes_read += len(data)
                    self.parser.receive_data(data)
                    self.eof = not data
                    self.busy = True
                    await self._run_batch()
                    if self.out:
                        await self._send()
                    self.busy = False
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("%s: connection lost: %s", self.client.name, exc)

    async def _send(self) -> None:
        data = bytes(self.out)
        self.out.clear()  # in place: callers may hold a reference to the buffer
        self.server.counters.bytes_written += len(data)
        await self.stream.send_all(data)

    async def _get(self, queue: str, reader: str | None, timeout_ms: int, *,
                   open: bool = False, peek: bool = False) -> Item | None:
        """broker.get; a long poll also watches the socket, so a client that hangs up
        while waiting is noticed at once and takes no item with it."""
        if timeout_ms <= 0:
            return await self.broker.get(queue, reader, client=self.client, open=open,
                                         peek=peek)
        item: Item | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_for_eof, nursery.cancel_scope)
            try:
                item = await self.broker.get(queue, reader, timeout_ms=timeout_ms,
                                             client=self.client, open=open, peek=peek)
            except Exception as exc:  # re-raised bare, not wrapped in an ExceptionGroup
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return item

    async def _watch_for_eof(self, scope: trio.CancelScope) -> None:
        # Bytes that arrive meanwhile are pipelined commands: hand them to the parser
        # (its caps bound them) and stop reading once a batch's worth is buffered.
        while self.parser.statistics().buffered_bytes < RECEIVE_SIZE:
            try:
                data = await self.stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            self.server.counters.bytes_read += len(data)
            self.parser.receive_data(data)
            if not data:
                self.eof = True
                scope.cancel()
                return
        await trio.sleep_forever()

    async def _run_batch(self) -> None:
        """Run every complete command buffered, in order; replies collect in `out`.

        Loops because a long poll reads ahead (see `_get`): commands that arrived
        while it waited are run before the session waits for the network again.
        """
        while not self.done:
            events = self._parse()
            if not events:
                return
            await self._run(events)
            if len(self.out) >= RECEIVE_SIZE:
                await self._send()

    def _parse(self) -> list[Any]:
        events: list[Any] = []
        while len(events) < MAX_BATCH:
            try:
                ev = self.parser.next_event()
            except mc.ProtocolError as e:
                events.append(e)
                if e.close:
                    break
                continue
            if ev is mc.NEED_DATA:
                break
            events.append(ev)
            if isinstance(ev, mc.ConnectionClosed):
                break
        return events

    async def _run(self, events: list[Any]) -> None:
        i = 0
        while i < len(events) and not self.done:
            ev = events[i]
            if self._is_put(ev):
                j = i
                while j < len(events) and self._is_put(events[j]):
                    j += 1
                await self._puts(events[i:j])
                i = j
                continue
            i += 1
            if isinstance(ev, mc.ProtocolError):
                log.debug("%s: %s", self.client.name, ev)
                self.stats.protocol_errors += 1
                self.out += ev.reply
                if ev.close:
                    self.done = True
            elif isinstance(ev, mc.ConnectionClosed):
                if ev.unparsed:
                    log.info("%s: closed mid-command, %d bytes dropped",
                             self.client.name, ev.unparsed)
                self.done = True
            else:
                self.stats.count(command_name(ev))
                await self._command(ev)
            if len(self.out) >= RECEIVE_SIZE:  # replies of a long batch go out as they grow
                await self._send()

    def _is_put(self, ev: object) -> bool:
        raise NotImplementedError

    async def _puts(self, events: list[Any]) -> None:
        """Begin every put of the run, then wait for all: one write, one fsync.

        Consecutive puts with the same `_group_key` become one journal append (one
        id range, one wake-up); if that append is refused, they are retried one by
        one so each gets its own answer.
        """
        with trio.CancelScope(shield=True):  # every begun put must be ended
            await self._puts_shielded(events)

    async def _puts_shielded(self, events: list[Any]) -> None:
        self.broker.counters.cmd_set += len(events)
        self.stats.count(command_name(events[0]), len(events))
        groups: list[list[Any]] = []
        for ev in events:
            key = self._group_key(ev)
            if groups and key is not None and self._group_key(groups[-1][0]) == key:
                groups[-1].append(ev)
            else:
                groups.append([ev])
        begun: list[tuple[list[Any], PendingPut | bytes]] = []
        for group in groups:
            try:
                begun.append((group, await self._begin_put(group)))
            except Exception as exc:  # mapped to each command's reply
                if len(group) == 1:
                    begun.append((group, self._put_error(group[0], exc)))
                    continue
                for ev in group:
                    try:
                        begun.append(([ev], await self._begin_put([ev])))
                    except Exception as exc1:
                        begun.append(([ev], self._put_error(ev, exc1)))
        for group, b in begun:
            if isinstance(b, bytes):
                for ev in group:
                    self._reply_put(ev, b)
                continue
            try:
                await self.broker.end_put(b)
            except Exception as exc:
                for ev in group:
                    self._reply_put(ev, self._put_error(ev, exc))
            else:
                for ev in group:
                    self._reply_put(ev, self._stored(ev))

    def _group_key(self, ev: Any) -> object:
        """Puts with equal keys (not None) may share one append."""
        return None

    async def _begin_put(self, group: list[Any]) -> PendingPut:
        raise NotImplementedError

    def _put_error(self, ev: Any, exc: Exception) -> bytes:
        raise NotImplementedError

    def _stored(self, ev: Any) -> bytes:
        raise NotImplementedError

    def _reply_put(self, ev: Any, reply: bytes) -> None:
        self.out += reply

    async def _command(self, ev: Any) -> None:
        raise NotImplementedError

    async def _monitor(self, queue: str, reader: str | None, seconds: float,
                       max_items: int | None, encode: Callable[[Item], bytes]) -> None:
        """Send items as they arrive (open reads, confirmed with `confirm`) until time is up."""
        deadline = trio.current_time() + seconds
        sent = 0
        while max_items is None or sent < max_items:
            left = deadline - trio.current_time()
            if left <= 0 or self.server.closing:
                break
            item = await self._get(queue, reader, max(1, int(left * 1000)), open=True)
            if item is None:
                break
            self.out += encode(item)
            sent += 1
            await self._send()


# -- memcache ------------------------------------------------------------------------------


def exptime_to_ms(exptime: int, now_ms: int) -> int | None:
    """memcache exptime: 0 never, < 1,000,000 relative seconds, else unix seconds."""
    if exptime == 0:
        return None
    if exptime < 0:
        return now_ms  # already expired, as memcached treats a negative exptime
    if exptime < RELATIVE_EXPTIME_LIMIT:
        return now_ms + exptime * 1000
    return exptime * 1000


class MemcacheSession(_Session):
    protocol = "memcache"

    def __init__(self, server: Server, stream: trio.SocketStream, name: str) -> None:
        super().__init__(server, stream, name)
        cfg = server.config
        self.parser = mc.MemcacheParser(max_line=cfg.max_line, max_item_size=cfg.max_item_size)

    @staticmethod
    def too_many() -> bytes:
        return mc.server_error("too many connections")

    def _is_put(self, ev: object) -> bool:
        return isinstance(ev, mc.Set)

    def _group_key(self, ev: mc.Set) -> object:
        return (ev.queue, ev.exptime)

    async def _begin_put(self, group: list[mc.Set]) -> PendingPut:
        first = group[0]
        expire = exptime_to_ms(first.exptime, self.broker.clock())
        return await self.broker.begin_put(first.queue, [ev.data for ev in group],
                                           expire_ms=expire)

    def _put_error(self, ev: mc.Set, exc: Exception) -> bytes:
        if isinstance(exc, (QueueFullError, ItemTooLargeError, JournalFullError)):
            log.debug("%s: set %s refused: %s", self.client.name, ev.queue, exc)
            return mc.not_stored()
        if isinstance(exc, ValueError):
            return mc.client_error(str(exc))
        if isinstance(exc, (JournalError, QueueError)):
            log.warning("%s: set %s failed: %s", self.client.name, ev.queue, exc)
            return mc.server_error(str(exc))
        log.error("%s: set %s failed", self.client.name, ev.queue, exc_info=exc)
        return mc.server_error(f"{type(exc).__name__}: {exc}")

    def _stored(self, ev: mc.Set) -> bytes:
        return mc.stored()

    def _reply_put(self, ev: mc.Set, reply: bytes) -> None:
        if not ev.noreply:
            self.out += reply

    async def _command(self, ev: mc.Command) -> None:
        try:
            await self._dispatch(ev)
        except ReadStateError as exc:
            self.out += mc.client_error(str(exc))
        except ValueError as exc:
            self.out += mc.client_error(str(exc))
        except (QueueClosedError, JournalError, QueueError) as exc:
            self.out += mc.server_error(str(exc))
        except OSError as exc:
            log.error("%s: %s failed: %s", self.client.name, type(ev).__name__, exc)
            self.out += mc.server_error(f"{exc.strerror or exc}")

    async def _dispatch(self, ev: mc.Command) -> None:
        b, out = self.broker, self.out
        if isinstance(ev, mc.Get):
            await self._memcache_get(ev)
        elif isinstance(ev, mc.Delete):
            await b.delete(ev.queue, ev.reader)
            if not ev.noreply:
                out += mc.deleted()
        elif isinstance(ev, mc.Flush):
            b.flush(ev.queue, ev.reader)
            out += mc.end()
        elif isinstance(ev, mc.FlushAll):
            b.flush_all()
            if not ev.noreply:
                out += mc.flushed_all()
        elif isinstance(ev, mc.FlushExpired):
            out += mc.count(b.flush_expired(ev.queue, ev.reader))
        elif isinstance(ev, mc.FlushAllExpired):
            out += mc.count(b.flush_all_expired())
        elif isinstance(ev, mc.Stats):
            pairs = self.server.global_stats()
            for name, fields in b.queue_stats():
                pairs.extend((f"queue_{name}_{k}", v) for k, v in fields.items())
            out += mc.stats(pairs)
        elif isinstance(ev, mc.DumpStats):
            out += mc.dump_stats((name, fields.items()) for name, fields in b.queue_stats())
        elif isinstance(ev, mc.Version):
            out += mc.version(__version__)
        elif isinstance(ev, mc.Reload):
            try:
                self.server.reload()
            except ConfigError as exc:
                log.error("reload failed, keeping the old config: %s", exc)
                out += mc.server_error(f"reload failed: {exc}")
            else:
                out += mc.reloaded()
        elif isinstance(ev, mc.Shutdown):
            self.server.request_shutdown(f"shutdown command from {self.client.name}")
            self.done = True
        elif isinstance(ev, mc.Quit):
            self.done = True
        elif isinstance(ev, mc.Monitor):
            key = f"{ev.queue}+{ev.reader}" if ev.reader else ev.queue
            await self._monitor(ev.queue, ev.reader, ev.timeout_s, ev.max_items,
                                lambda it: mc.value(key, 0, it.data))
            out += mc.end()
        elif isinstance(ev, mc.Confirm):
            b.confirm(self.client, ev.queue, ev.reader, ev.count)
            out += mc.end()
        else:  # pragma: no cover - the parser makes no other events
            raise AssertionError(f"unhandled event {ev!r}")

    async def _memcache_get(self, ev: mc.Get) -> None:
        b, out = self.broker, self.out
        reader = ev.reader or ""
        if ev.abort:
            b.abort(self.client, ev.queue, reader)
            out += mc.end()
            return
        if ev.close:
            b.confirm(self.client, ev.queue, reader)
            if not ev.open:
                out += mc.end()
                return
        if not ev.peek and self.client.open_ids(ev.queue, reader):
            # Kestrel: a second open, or a plain get, while a read is open: ERROR, close.
            log.warning("%s: get %s with a read already open on it", self.client.name, ev.key)
            out += mc.error()
            self.done = True
            return
        item = await self._get(ev.queue, reader, ev.timeout_ms, open=ev.open, peek=ev.peek)
        if item is not None:
            out += mc.value(ev.key, 0, item.data)
        out += mc.end()


# -- text ------------------------------------------------------------------------------------


class TextSession(_Session):
    protocol = "text"

    def __init__(self, server: Server, stream: trio.SocketStream, name: str) -> None:
        super().__init__(server, stream, name)
        cfg = server.config
        self.parser = tp.TextParser(max_line=cfg.max_line,
                                    max_item_size=min(cfg.max_item_size, tp.DEFAULT_MAX_ITEM_SIZE))

    @staticmethod
    def too_many() -> bytes:
        return tp.error("Too many connections.")

    def _is_put(self, ev: object) -> bool:
        return isinstance(ev, tp.Put)

    async def _begin_put(self, group: list[tp.Put]) -> PendingPut:
        (ev,) = group  # text puts carry their items already; no grouping
        expire = None if ev.expiry_ms is None else self.broker.clock() + ev.expiry_ms
        return await self.broker.begin_put(ev.queue, list(ev.items), expire_ms=expire)

    def _put_error(self, ev: tp.Put, exc: Exception) -> bytes:
        if isinstance(exc, (QueueFullError, ItemTooLargeError, JournalFullError)):
            return tp.error(f"Queue {ev.queue} refused the items: {exc}")
        if isinstance(exc, (ValueError, JournalError, QueueError)):
            return tp.error(str(exc))
        log.error("%s: put %s failed", self.client.name, ev.queue, exc_info=exc)
        return tp.error(f"{type(exc).__name__}: {exc}")

    def _stored(self, ev: tp.Put) -> bytes:
        return tp.count(len(ev.items))

    async def _command(self, ev: tp.Command) -> None:
        try:
            await self._dispatch(ev)
        except (ValueError, QueueError, JournalError) as exc:
            self.out += tp.error(str(exc))
        except OSError as exc:
            log.error("%s: %s failed: %s", self.client.name, type(ev).__name__, exc)
            self.out += tp.error(f"{exc.strerror or exc}")

    async def _dispatch(self, ev: tp.Command) -> None:
        b, out = self.broker, self.out
        if isinstance(ev, tp.Get):
            # Taken as an open read first: an item this protocol cannot carry stays queued.
            item = await self._get(ev.queue, ev.reader, ev.timeout_ms, open=True)
            if item is None:
                out += tp.empty()
            elif b"\n" in item.data:
                b.abort(self.client, ev.queue, ev.reader, ids=[item.id], count_error=False)
                out += tp.error("Item contains a newline; use the memcache protocol.")
            else:
                b.confirm(self.client, ev.queue, ev.reader, ids=[item.id])
                out += tp.item(item.data)
        elif isinstance(ev, tp.Peek):
            item = await self._get(ev.queue, ev.reader, ev.timeout_ms, peek=True)
            if item is None:
                out += tp.empty()
            elif b"\n" in item.data:
                out += tp.error("Item contains a newline; use the memcache protocol.")
            else:
                out += tp.item(item.data)
        elif isinstance(ev, tp.Monitor):
            await self._monitor(ev.queue, ev.reader, ev.timeout_ms / 1000, ev.max_items,
                                self._encode_open)
            out += tp.empty()
        elif isinstance(ev, tp.Confirm):
            out += tp.count(b.confirm(self.client, ev.queue, ev.reader, ev.count))
        elif isinstance(ev, tp.Flush):
            b.flush(ev.queue, ev.reader)
            out += tp.count(0)
        elif isinstance(ev, tp.Delete):
            await b.delete(ev.queue, ev.reader)
            out += tp.count(0)
        elif isinstance(ev, tp.Version):
            out += tp.version(__version__)
        elif isinstance(ev, tp.Shutdown):
            self.server.request_shutdown(f"shutdown command from {self.client.name}")
            self.done = True
        elif isinstance(ev, tp.Quit):
            self.done = True
        else:  # pragma: no cover
            raise AssertionError(f"unhandled event {ev!r}")

    def _encode_open(self, item: Item) -> bytes:
        if b"\n" in item.data:
            return tp.error(f"Item {item.id} contains a newline; use the memcache protocol.")
        return tp.item(item.data)


#: The session class of each protocol listener (see PROTOCOLS).
_SESSIONS: dict[str, type[MemcacheSession | TextSession | RpcSession]] = {
    cls.protocol: cls for cls in (MemcacheSession, TextSession, RpcSession)}


# -- entry point ------------------------------------------------------------------------------


async def open_listeners(config: ServerConfig) -> dict[str, list[trio.SocketListener]]:
    """Bind every listener (before recovery, so a busy port fails fast)."""
    listeners: dict[str, list[trio.SocketListener]] = {}
    try:
        for proto, port in (("memcache", config.memcache_port), ("text", config.text_port),
                            ("rpc", config.rpc_port), ("http", config.http_port)):
            try:
                listeners[proto] = await trio.open_tcp_listeners(port, host=config.host)
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen for {proto} on {config.host}:{port}: {exc.strerror}"
                ) from exc
            bound = listeners[proto][0].socket.getsockname()[1]
            log.info("listening for %s on %s:%d", proto, config.host, bound)
    except BaseException:
        await _close_all(listeners)
        raise
    return listeners


async def _close_all(listeners: dict[str, list[trio.SocketListener]]) -> None:
    for ls in listeners.values():
        for listener in ls:
            with trio.CancelScope(shield=True):
                await listener.aclose()


async def serve(
    config: ServerConfig,
    *,
    handle_signals: bool = False,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen, recover, serve until shutdown, then close cleanly.

    The operations port answers from the start: /livez at once, /readyz once
    recovery has finished (see queued.server.http). A SIGTERM or SIGINT that arrives
    during recovery stops the server as soon as recovery has finished (recovery
    itself is not interrupted: it may be rewriting a segment).
    """
    ops = Ops(config)
    stop = _Stop(ops)
    listeners: dict[str, list[trio.SocketListener]] = {}
    failure: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:  # before the listeners: a signal is never the default action
                await nursery.start(stop.watch_signals)
            try:
                listeners = await open_listeners(config)
                http_port = await nursery.start(serve_http, ops, listeners["http"])
                queues = {k: v for k, v in listeners.items() if k != "http"}
                await _recover_and_run(config, queues, ops, stop, http_port,
                                       task_status=task_status)
            except Exception as exc:  # re-raised bare, not wrapped in an ExceptionGroup
                failure = exc
            nursery.cancel_scope.cancel()
    finally:
        await _close_all(listeners)
    if failure is not None:
        raise failure
    log.info("stopped cleanly")


class _Stop:
    """SIGTERM/SIGINT: shut the server down, or remember to once it exists."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.pending: str | None = None

    async def watch_signals(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.ops.server is not None:
                    self.ops.server.request_shutdown(name)
                elif self.pending is None:
                    log.info("%s during recovery: stopping once recovery has finished", name)
                    self.pending = name


async def _recover_and_run(
    config: ServerConfig,
    listeners: dict[str, list[trio.SocketListener]],
    ops: Ops,
    stop: _Stop,
    http_port: int,
    *,
    task_status: trio.TaskStatus[Server],
) -> None:
    started = time.monotonic()
    async with open_broker(config) as broker:
        report = broker.datadir.report
        stats = [fields for _, fields in broker.queue_stats()]
        log.info(
            "recovered %d queues: %d items waiting (%d bytes); journals hold %d records, "
            "%d bytes; %d bytes truncated; %.3f s",
            len(broker.queues), sum(f["items"] for f in stats),
            sum(f["bytes"] for f in stats), report.records, report.bytes,
            report.truncated_bytes, time.monotonic() - started,
            extra={"event": "recovered", "queues": len(broker.queues),
                   "truncated_bytes": report.truncated_bytes,
                   "seconds": round(time.monotonic() - started, 6)},
        )
        server = Server(broker, config)
        server.ports["http"] = http_port
        ops.server = server
        if stop.pending is not None:
            server.request_shutdown(stop.pending)
        await server.run(listeners, task_status=task_status)
