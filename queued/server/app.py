"""The server process: prove the data dir writable, bind every port, recover, serve, stop.

Owns the order of start-up (a real write and fsync in the data dir before anything
else, so a server that could not store a put never opens a port; then the listeners,
so a busy port fails fast; the operations port answers while recovery runs; `ready`
only after a second probe once recovery is done) and the signals that stop it.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import time

import trio

from queued.broker.upkeep import open_broker
from queued.config import ConfigError, ServerConfig, env_var
from queued.config.users import UsersError
from queued.server.auth import Authenticator
from queued.server.http import Ops, serve_http
from queued.server.listeners import Server
from queued.server.tls import ServerTls, TlsError
from queued.storage.files import probe_writable

log = logging.getLogger("queued.server")


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # it will fail to bind anyway, with its own message
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).partition("%")[0]).is_loopback for info in infos)


def check_exposure(config: ServerConfig) -> None:
    """Refuse to listen beyond loopback with no users: anyone who can reach the ports
    could read, change or delete every queue, or stop the server."""
    if config.users_file is not None or config.allow_anonymous or is_loopback(config.host):
        return
    raise ConfigError(
        f"host {config.host!r} listens beyond this machine, and no users_file is set: anyone "
        "who reaches the ports could read, change or delete every queue. Either set "
        f"users_file ({env_var('users_file')}, --users-file; see "
        f"docs/security.md), or set allow_anonymous = true ({env_var('allow_anonymous')}=1, "
        "--allow-anonymous) to accept the risk.")


def open_security(config: ServerConfig) -> tuple[Authenticator | None, ServerTls | None]:
    """The users and the TLS context the config names, loaded now (a bad file stops the
    start with its name, before any port is opened)."""
    check_exposure(config)
    login = tls = None
    try:
        if config.users_file is not None:
            login = Authenticator(config.users_file)
            log.info("users file %s: %d users; every connection authenticates first",
                     config.users_file, len(login.users))
        if config.tls_cert is not None and config.tls_key is not None:
            tls = ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca)
            log.info("TLS on every listener (certificate %s%s)", config.tls_cert,
                     ", client certificates required" if config.tls_client_ca else "")
    except (UsersError, TlsError) as exc:
        raise ConfigError(str(exc)) from None
    return login, tls

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
    login, tls = open_security(config)
    ops = Ops(config, login=login, tls=tls)
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
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    self.reload()
                elif self.ops.server is not None:
                    self.ops.server.request_shutdown(name)
                elif self.pending is None:
                    log.info("%s during recovery: stopping once recovery has finished", name)
                    self.pending = name

    def reload(self) -> None:
        """SIGHUP: what the `reload` command does (queue configs, users, certificates)."""
        server = self.ops.server
        if server is None:
            log.warning("SIGHUP during recovery: ignored (send it again once ready)")
            return
        try:
            server.reload()
        except ConfigError as exc:
            log.error("reload (SIGHUP) failed, keeping the old settings: %s", exc)
        else:
            log.info("reloaded (SIGHUP)")


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
        # The console's charts go on from where the last clean stop left them.
        await trio.to_thread.run_sync(ops.history.load, config.data_dir, time.time(),
                                      frozenset(name for name, _ in broker.queue_stats()))
        server = Server(broker, config, login=ops.login, tls=ops.tls)
        server.ports["http"] = http_port
        ops.server = server
        if stop.pending is not None:
            server.request_shutdown(stop.pending)
        await server.run(listeners, task_status=task_status)
        ops.history.sample(time.time(), broker.queue_stats())  # the last point
        try:
            await trio.to_thread.run_sync(ops.history.save, config.data_dir)
        except OSError as exc:  # the charts start empty next time; nothing else is lost
            log.warning("console: chart history not saved: %s", exc)
