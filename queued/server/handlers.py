"""What each protocol-neutral command does to the broker: one function per command type.

Owns the meaning of a command, whatever protocol it came in on; returns a Reply (or
None when the session answers later, for a get that waits in a task of its own). It
never touches sockets or bytes: the session runs these and the codec encodes replies.
Puts are not here: the session groups them (one append, one fsync per batch).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from queued import __version__
from queued.config import ConfigError
from queued.wire import commands as c
from queued.wire.access import visible

if TYPE_CHECKING:
    from queued.broker.broker import Broker
    from queued.reader.open_reads import OpenReads
    from queued.reader.state import Item
    from queued.storage.journal import Ticket
    from queued.wire.access import Grant

log = logging.getLogger("queued.server")


class ServerControl(Protocol):
    """What a session needs of the server it belongs to."""

    @property
    def closing(self) -> bool: ...

    def stats(self) -> dict[str, object]: ...

    def reload(self) -> None: ...

    def request_shutdown(self, why: str) -> None: ...


class Conn(Protocol):
    """What a handler needs of the session running it."""

    broker: Broker
    server: ServerControl
    reads: OpenReads
    name: str
    done: bool
    #: what the connection may do (None: everything, a server without users)
    grant: Grant | None
    #: replies go out in request order (memcache, text); else matched by id (RPC)
    ordered: bool

    async def take(self, cmd: c.Get) -> list[Item]:
        """Items for a get that answers in place (watching for a hang-up while it waits)."""

    async def get_later(self, cmd: c.Get, request: c.Request) -> c.Reply | None:
        """A get whose reply is matched by id: it may wait in a task of its own (None)."""

    async def monitor(self, cmd: c.Monitor, request: c.Request) -> c.Reply: ...

    async def authenticate(self, auth: c.Auth) -> c.Reply:
        """Log in (again) as auth.user; wrong credentials close the connection."""

    def reply_after(self, ticket: Ticket) -> None:
        """The replies from here on go out only once `ticket` is set (a confirm or an
        abort's error count durable); if it fails, they never do."""


async def get(conn: Conn, cmd: c.Get, req: c.Request) -> c.Reply | None:
    b, reads, reader = conn.broker, conn.reads, cmd.reader or ""
    if cmd.reject:
        b.reject(reads, cmd.queue, reader, None, owe=conn.reply_after)
        return c.Done()
    if cmd.abort:
        b.abort(reads, cmd.queue, reader, owe=conn.reply_after, delay_ms=cmd.delay_ms)
        return c.Done()
    if cmd.close:
        b.confirm(reads, cmd.queue, reader, owe=conn.reply_after)
        if not cmd.open:
            return c.Done()
    if cmd.exclusive and not cmd.peek and reads.open_ids(cmd.queue, reader):
        # Kestrel: a second open, or a plain get, while a read is open: ERROR, close.
        log.warning("%s: get %s with a read already open on it", conn.name, cmd.queue)
        return c.Failure(c.ErrorKind.READ_OPEN, "a read is already open on this queue")
    if not conn.ordered:
        return await conn.get_later(cmd, req)
    items = await conn.take(cmd)
    if cmd.line_safe and items:
        it = items[0]
        if b"\n" in it.data:
            b.abort(reads, cmd.queue, cmd.reader, ids=[it.id], count_error=False)
            return c.Failure(c.ErrorKind.NOT_ENCODABLE, "item contains a newline")
        b.confirm(reads, cmd.queue, cmd.reader, ids=[it.id], journal=False)  # a plain get
    return c.Items(items)


async def peek(conn: Conn, cmd: c.Peek, req: c.Request) -> c.Reply:
    item = await conn.broker.get(cmd.queue, cmd.reader, peek=True)
    return c.Peeked(item, conn.broker.reader_info(cmd.queue, cmd.reader))


async def confirm(conn: Conn, cmd: c.Confirm, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.confirm(conn.reads, cmd.queue, cmd.reader, cmd.count, cmd.ids,
                                       owe=conn.reply_after))


async def abort(conn: Conn, cmd: c.Abort, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.abort(conn.reads, cmd.queue, cmd.reader, ids=cmd.ids,
                                     owe=conn.reply_after, delay_ms=cmd.delay_ms))


async def touch(conn: Conn, cmd: c.Touch, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.extend(conn.reads, cmd.queue, cmd.reader, cmd.ids, cmd.ms))


async def reject(conn: Conn, cmd: c.Reject, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.reject(conn.reads, cmd.queue, cmd.reader, cmd.ids,
                                      owe=conn.reply_after))


async def pause(conn: Conn, cmd: c.Pause, req: c.Request) -> c.Reply:
    await conn.broker.set_paused(cmd.queue, cmd.on)
    return c.Done()


async def move(conn: Conn, cmd: c.Move, req: c.Request) -> c.Reply:
    return c.Count(await conn.broker.move(cmd.queue, cmd.reader, cmd.destination,
                                          cmd.max_items, cmd.rate))


async def browse(conn: Conn, cmd: c.Browse, req: c.Request) -> c.Reply:
    return c.Items(await conn.broker.browse(cmd.queue, cmd.reader, cmd.after_id, cmd.n))


async def flush(conn: Conn, cmd: c.Flush, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.flush(cmd.queue, cmd.reader))


async def flush_all(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    return c.Count(await conn.broker.flush_all())


async def flush_expired(conn: Conn, cmd: c.FlushExpired, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.flush_expired(cmd.queue, cmd.reader))


async def flush_all_expired(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    return c.Count(conn.broker.flush_all_expired())


async def delete(conn: Conn, cmd: c.Delete, req: c.Request) -> c.Reply:
    return c.Deleted(await conn.broker.delete(cmd.queue, cmd.reader))


async def stats(conn: Conn, cmd: c.Stats, req: c.Request) -> c.Reply:
    return c.Value(visible(conn.server.stats(), conn.grant))  # only the queues it may use


async def auth(conn: Conn, cmd: c.Auth, req: c.Request) -> c.Reply:
    return await conn.authenticate(cmd)


async def version(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    return c.Value(__version__)


async def reload(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    try:
        conn.server.reload()
    except ConfigError as exc:
        log.error("reload failed, keeping the old config: %s", exc)
        return c.Failure(c.ErrorKind.SERVER_ERROR, f"reload failed: {exc}")
    return c.Done()


async def shutdown(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    conn.server.request_shutdown(f"shutdown command from {conn.name}")
    conn.done = True
    return c.Done()


async def quit(conn: Conn, cmd: object, req: c.Request) -> c.Reply:
    conn.done = True
    return c.Done()


async def monitor(conn: Conn, cmd: c.Monitor, req: c.Request) -> c.Reply:
    return await conn.monitor(cmd, req)


def not_durable(conn: Conn, req: c.Request, reply: c.Reply, error: BaseException) -> c.Failure:
    """What a request answers, instead of `reply`, when a confirm or abort it made could
    not be made durable (its ticket failed with `error`): the error a put the journal
    refused gets (SERVER_ERROR, "... No space left on device"). The broker has already
    undone its confirms (their reads are open again on this connection); an item the same
    request opened (memcache `/close/open`) goes back, since its reply is not sent. An
    abort's item stays back in the queue: only its error count or delay may be lost."""
    cmd = req.command
    if type(cmd) is c.Get and cmd.open and type(reply) is c.Items and reply.items:
        conn.broker.abort(conn.reads, cmd.queue, cmd.reader, ids=[it.id for it in reply.items],
                          count_error=False)
    failure = c.failure_of(error) or c.Failure(c.ErrorKind.SERVER_ERROR, str(error))
    if type(cmd) is c.Abort or (type(cmd) is c.Get and cmd.abort):
        what = "abort not durable (the item is back in the queue, its error count or delay " \
               "held in memory only)"
    else:
        what = "confirm not durable (the read is still open)"
    return c.Failure(failure.kind, f"{what}: {failure.message}")


#: (session, the command, its request) -> the reply, or None if the session answers later
Handler = Callable[[Conn, Any, c.Request], Awaitable[c.Reply | None]]

#: command type -> what it does (c.Put is the session's: it groups puts)
HANDLERS: Final[dict[type, Handler]] = {
    c.Get: get,
    c.Peek: peek,
    c.Confirm: confirm,
    c.Abort: abort,
    c.Flush: flush,
    c.FlushAll: flush_all,
    c.FlushExpired: flush_expired,
    c.FlushAllExpired: flush_all_expired,
    c.Delete: delete,
    c.Stats: stats,
    c.Version: version,
    c.Reload: reload,
    c.Shutdown: shutdown,
    c.Quit: quit,
    c.Monitor: monitor,
    c.Auth: auth,
    c.Touch: touch,
    c.Reject: reject,
    c.Pause: pause,
    c.Move: move,
    c.Browse: browse,
}
