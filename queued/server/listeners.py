"""The network shell: listeners, connection limits, shutdown, the disk watch.

Owns the accept loops and one `Session` per connection (whatever its protocol: the
codec decides), the connection cap, the `stats` figures of the server, and the
order of a clean stop. Shutdown (SIGTERM, SIGINT, the `shutdown` command): close
the listeners, answer waiting gets as empty, let sessions finish the batch they are
running (at most `shutdown_grace`, 5 s by default, as Docker's stop waits 10 s before
SIGKILL), return every open read to its queue; the broker then writes every
checkpoint and the data dir closes the journals (fsync).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final

import trio

from queued import __version__
from queued.broker.broker import Broker
from queued.config import ConfigError, ServerConfig, reload_queue_configs
from queued.errors import DataDirError
from queued.server.auth import Authenticator
from queued.server.connections import ReactorTransport
from queued.server.memory import pin_mmap_threshold, trim_when_drained
from queued.server.metrics import disk_usage
from queued.server.reactor import Reactor
from queued.server.session import Session
from queued.server.task_base import Guard, ServerCounters
from queued.server.tls import ServerTls, TlsChannel, accept_channel
from queued.server.transport import peer_name
from queued.stats import ProtocolStats
from queued.storage.files import probe_writable
from queued.wire import commands as c
from queued.wire.memcache_commands import MemcacheCodec
from queued.wire.rpc_commands import RpcCodec
from queued.wire.text_commands import TextCodec

log = logging.getLogger("queued.server")

#: How often the data dir's free space is checked, and how often a low-space warning repeats.
DISK_CHECK_SECONDS = 10.0
DISK_WARN_REPEAT_SECONDS = 300.0

#: The codec of each listener that speaks a queue protocol (http is served apart).
CODECS: Final[dict[str, Callable[[c.Limits], c.Codec]]] = {
    "memcache": MemcacheCodec, "text": TextCodec, "rpc": RpcCodec,
}
PROTOCOLS: Final = tuple(CODECS)


class Server:
    """Listeners and sessions over one Broker."""

    def __init__(self, broker: Broker, config: ServerConfig, *,
                 login: Authenticator | None = None, tls: ServerTls | None = None) -> None:
        self.broker = broker
        self.config = config
        self.login = login
        self.tls = tls
        self.counters = ServerCounters()
        self.protocols = {proto: ProtocolStats() for proto in PROTOCOLS}
        self.ports: dict[str, int] = {}
        self.closing = False
        self.shutdown_requested = trio.Event()
        #: serves every queue protocol connection, plain and TLS (made in `run`)
        self.reactor: Reactor | None = None
        self._disk_warned_at: float | None = None
        #: why the data dir failed its last write probe (None: it took the probe's write)
        self.unwritable: str | None = None

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
        pin_mmap_threshold()  # (process-wide; see queued.server.memory)
        async with trio.open_nursery() as outer:
            outer.start_soon(self._watch_disk)
            self.reactor = Reactor(self.broker)
            outer.start_soon(self.reactor.run)
            outer.start_soon(partial(trim_when_drained, self.broker.held_bytes,
                                     activity=lambda: self.counters.bytes_read))
            async with trio.open_nursery() as conns:
                async with trio.open_nursery() as acceptors:
                    for proto, ls in listeners.items():
                        acceptors.start_soon(partial(
                            trio.serve_listeners, self._handler(proto), ls,
                            handler_nursery=conns))
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
                if self.reactor is not None:
                    self.reactor.shut_down()
                outer.start_soon(self._deadline, conns.cancel_scope)
            outer.cancel_scope.cancel()
        log.info("all connections closed")

    def _handler(self, proto: str) -> Callable[[trio.SocketStream], Awaitable[None]]:
        new_codec = CODECS[proto]
        stats = self.protocols[proto]
        cfg = self.config
        limits = c.Limits(cfg.max_line, cfg.max_item_size, cfg.rpc_max_frame, cfg.rpc_max_batch)
        guard = Guard(self.login, cfg.request_timeout / 1000, cfg.auth_timeout / 1000, limits)

        async def handle(stream: trio.SocketStream) -> None:
            started = trio.current_time()
            codec = new_codec(limits)
            if self.connections() >= cfg.max_connections:
                stats.refused_connections += 1
                if self.tls is None:  # (a TLS client could not read a plaintext refusal)
                    with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError):
                        await stream.send_all(codec.too_many)
                await stream.aclose()
                return
            await self._serve(stream, codec, stats, guard, started)

        return handle

    async def _serve(self, stream: trio.SocketStream, codec: c.Codec, stats: ProtocolStats,
                     guard: Guard, started: float) -> None:
        stats.connections += 1  # from the handshake on: it holds a connection slot too
        stats.total_connections += 1
        name = peer_name(stream)
        session: Session | None = None
        try:
            channel: TlsChannel | None = None
            if self.tls is not None:
                left = started + guard.auth_timeout - trio.current_time()
                channel = await accept_channel(self.tls, stream, name, left)
                if channel is None:
                    stats.tls_handshake_failures += 1
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await stream.aclose()
                    return
            reactor = self.reactor
            assert reactor is not None  # (made before the listeners start)
            transport = ReactorTransport(stream, channel)
            session = Session(self, self.broker, stream, codec, name=name,
                              max_item_size=self.config.max_item_size,
                              counters=self.counters, stats=stats, guard=guard,
                              started=started, transport=transport)
            self.broker.register(session.reads)
            await reactor.serve(session, stream, transport)
        except Exception:  # one connection's failure must not take the server down
            # (a peer that goes away is not one: the session handles broken streams itself)
            log.exception("%s: session failed; closing the connection", name)
        finally:
            stats.connections -= 1
            if session is not None:
                # Its open reads go back to their queues (not an error when we are stopping).
                self.broker.release(session.reads, count_error=not self.closing)
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await session.stream.aclose()

    async def _deadline(self, scope: trio.CancelScope) -> None:
        grace = self.config.shutdown_grace / 1000
        await trio.sleep(grace)
        log.warning("shutdown: sessions still busy after %.1f s, closing them", grace)
        scope.cancel()

    async def _watch_disk(self) -> None:
        while True:  # (start-up has just proved the data dir writable)
            self.check_disk()
            await trio.sleep(DISK_CHECK_SECONDS)
            await self.probe_data_dir()

    async def probe_data_dir(self) -> None:
        """Write, fsync and remove a probe file in the data dir (as start-up does; a mode
        bit proves nothing to root), off the event loop; `unwritable` says why it failed,
        logged once when it starts failing and once when it works again."""
        path = self.broker.datadir.path
        try:
            await trio.to_thread.run_sync(probe_writable, path)
        except DataDirError as exc:
            if self.unwritable is None:
                log.error("%s", exc, extra={"event": "data_dir_unwritable"})
            self.unwritable = str(exc)
        else:
            if self.unwritable is not None:
                log.info("data dir %s takes writes again", path,
                         extra={"event": "data_dir_writable"})
            self.unwritable = None

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

    # -- statistics ----------------------------------------------------------------------

    def global_stats(self) -> list[tuple[str, object]]:
        """The server's own figures, under Kestrel's names."""
        b = self.broker
        counters = b.counters
        readers = [fields for _, fields in b.queue_stats()]
        return [
            ("uptime", int(time.time() - b.start_time)),
            ("time", int(time.time())),
            ("version", __version__),
            ("curr_items", sum(f["items"] for f in readers)),
            ("total_items", counters.total_items),
            ("bytes", sum(f["bytes"] for f in readers)),
            ("curr_connections", self.connections()),
            ("total_connections", sum(p.total_connections for p in self.protocols.values())),
            ("cmd_get", counters.cmd_get),
            ("cmd_set", counters.cmd_set),
            ("cmd_peek", counters.cmd_peek),
            ("get_hits", counters.get_hits),
            ("get_misses", counters.get_misses),
            ("bytes_read", self.counters.bytes_read),
            ("bytes_written", self.counters.bytes_written),
            ("queue_creates", counters.queue_creates),
            ("queue_deletes", counters.queue_deletes),
            ("queue_expires", counters.queue_expires),
        ]

    def stats(self) -> dict[str, object]:
        """The `stats` figures: {"server": {...}, "queues": {"q" or "q+reader": {...}}}."""
        return {"server": dict(self.global_stats()), "queues": dict(self.broker.queue_stats())}

    def connections(self) -> int:
        """Open client connections, every protocol together."""
        return sum(p.connections for p in self.protocols.values())

    def reload(self) -> None:
        """Re-read the config file's queue sections (Kestrel's `reload`), the users file
        and the TLS certificate files. Each that cannot be read keeps what it had; the
        first failure is raised (as a ConfigError) after the others were tried."""
        errors: list[str] = []
        try:
            new = reload_queue_configs(self.config)
            self.config = new
            self.broker.reconfigure(new)
        except ConfigError as exc:
            errors.append(str(exc))
        for part in (self.login, self.tls):
            if part is not None:
                try:
                    part.reload()
                except Exception as exc:  # UsersError, TlsError: named in the message
                    errors.append(str(exc))
        if errors:
            raise ConfigError("; ".join(errors))


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KiB" (for log lines; config values use config.format_size)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # pragma: no cover

