"""The server process: prove the data dir writable, bind every port, recover, serve, stop.

Owns the order of start-up (a real write and fsync in the data dir before anything
else, so a server that could not store a put never opens a port; then the listeners,
so a busy port fails fast; the operations port answers while recovery runs; `ready`
only after a second probe once recovery is done) and the signals that stop it.
"""

from __future__ import annotations

import logging
import signal
import time

import trio

from queued.broker.upkeep import open_broker
from queued.config import ConfigError, ServerConfig
from queued.server.http import Ops, serve_http
from queued.server.listeners import Server
from queued.storage.files import probe_writable

log = logging.getLogger("queued.server")

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
    """Probe the data dir, listen, recover, serve until shutdown, then close cleanly.

    A data dir that cannot be written raises DataDirError before any port is opened; a
    stop that could not save everything raises NotSavedError (saying what) instead of
    logging "stopped cleanly".

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
                await trio.to_thread.run_sync(probe_writable, config.data_dir)
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
        # Recovery can take long: the file system may have gone read-only meanwhile.
        await trio.to_thread.run_sync(probe_writable, config.data_dir)
        server = Server(broker, config)
        server.ports["http"] = http_port
        ops.server = server
        if stop.pending is not None:
            server.request_shutdown(stop.pending)
        await server.run(listeners, task_status=task_status)
