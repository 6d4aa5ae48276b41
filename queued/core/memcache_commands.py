"""Kestrel's memcache protocol mapped to the protocol-neutral commands, and back.

Owns the tables: parser event -> command, (command, reply) -> reply bytes, error kind
-> reply. PURE, like the parser it wraps; it never runs a command itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from queued.core import commands as c
from queued.core import memcache_protocol as mc
from queued.core.queue import Item
from queued.core.stats import command_name
from queued.core.wire import NEED_DATA, ConnectionClosed, NeedData

#: memcache exptime values below this are relative seconds, as in memcached.
RELATIVE_EXPTIME_LIMIT: Final = 1_000_000
END: Final = mc.end()
STORED: Final = mc.stored()
#: Distinct get keys whose commands a connection keeps (then it starts again).
GET_CACHE: Final = 256


def put_of(ev: mc.Set) -> c.Put:
    """exptime: 0 never, negative already expired (as memcached), < 1,000,000 relative
    seconds, else unix seconds."""
    e = ev.exptime
    if e == 0:
        return c.Put(ev.queue, (ev.data,))
    if e < 0:
        return c.Put(ev.queue, (ev.data,), ttl_ms=0)
    if e < RELATIVE_EXPTIME_LIMIT:
        return c.Put(ev.queue, (ev.data,), ttl_ms=e * 1000)
    return c.Put(ev.queue, (ev.data,), expire_at_ms=e * 1000)


def get_of(ev: mc.Get) -> c.Get:
    return c.Get(ev.queue, ev.reader, timeout_ms=ev.timeout_ms, open=ev.open, close=ev.close,
                 abort=ev.abort, peek=ev.peek, exclusive=True)


COMMANDS: Final[dict[type, Callable[[Any], c.Command]]] = {
    mc.Set: put_of,
    mc.Get: get_of,
    mc.Delete: lambda ev: c.Delete(ev.queue, ev.reader),
    mc.Flush: lambda ev: c.Flush(ev.queue, ev.reader),
    mc.FlushAll: lambda ev: c.FlushAll(),
    mc.FlushExpired: lambda ev: c.FlushExpired(ev.queue, ev.reader),
    mc.FlushAllExpired: lambda ev: c.FlushAllExpired(),
    mc.Stats: lambda ev: c.Stats(),
    mc.DumpStats: lambda ev: c.Stats(),
    mc.Version: lambda ev: c.Version(),
    mc.Reload: lambda ev: c.Reload(),
    mc.Shutdown: lambda ev: c.Shutdown(),
    mc.Quit: lambda ev: c.Quit(),
    mc.Monitor: lambda ev: c.Monitor(ev.queue, ev.reader, ev.timeout_s * 1000, ev.max_items),
    mc.Confirm: lambda ev: c.Confirm(ev.queue, ev.reader, count=ev.count),
}


def _values(ev: mc.Get, reply: c.Items | c.Done) -> bytes:
    """A get's reply: its VALUE blocks and END (an abort or a close alone: END)."""
    if type(reply) is not c.Items or not reply.items:
        return END
    if len(reply.items) == 1:
        return mc.value(ev.key, 0, reply.items[0].data) + END
    return b"".join(mc.value(ev.key, 0, it.data) for it in reply.items) + mc.end()


def _stats(ev: mc.Stats | mc.DumpStats, reply: c.Value) -> bytes:
    queues: dict[str, dict[str, object]] = reply.value["queues"]
    if isinstance(ev, mc.DumpStats):
        return mc.dump_stats((name, fields.items()) for name, fields in queues.items())
    pairs = list(reply.value["server"].items())
    for name, fields in queues.items():
        pairs.extend((f"queue_{name}_{k}", v) for k, v in fields.items())
    return mc.stats(pairs)


#: parser event type -> the bytes of its successful reply
REPLIES: Final[dict[type, Callable[[Any, Any], bytes]]] = {
    mc.Set: lambda ev, r: b"" if ev.noreply else STORED,
    mc.Get: _values,
    mc.Delete: lambda ev, r: b"" if ev.noreply else mc.deleted(),
    mc.Flush: lambda ev, r: mc.end(),
    mc.FlushAll: lambda ev, r: b"" if ev.noreply else mc.flushed_all(),
    mc.FlushExpired: lambda ev, r: mc.count(r.n),
    mc.FlushAllExpired: lambda ev, r: mc.count(r.n),
    mc.Stats: _stats,
    mc.DumpStats: _stats,
    mc.Version: lambda ev, r: mc.version(r.value),
    mc.Reload: lambda ev, r: mc.reloaded(),
    mc.Shutdown: lambda ev, r: b"",
    mc.Quit: lambda ev, r: b"",
    mc.Monitor: lambda ev, r: mc.end(),
    mc.Confirm: lambda ev, r: mc.end(),
}

K = c.ErrorKind
#: error kind -> its reply (NOT_STORED is Kestrel's answer to a full queue or a big item)
FAILURES: Final[dict[c.ErrorKind, Callable[[str], bytes]]] = {
    K.QUEUE_FULL: lambda msg: mc.not_stored(),
    K.ITEM_TOO_LARGE: lambda msg: mc.not_stored(),
    K.JOURNAL_FULL: lambda msg: mc.not_stored(),
    K.BAD_NAME: mc.client_error,
    K.BAD_PARAMS: mc.client_error,
    K.TOO_MANY_OPEN_READS: mc.client_error,
    K.READ_OPEN: lambda msg: mc.error(),  # Kestrel: a second open on a queue is ERROR, close
    K.NOT_ENCODABLE: mc.server_error,
    K.SHUTTING_DOWN: mc.server_error,
    K.BUSY: mc.server_error,
    K.SERVER_ERROR: mc.server_error,
}


class MemcacheCodec(c.LineCodec):
    """One memcache connection's parser and tables (see `queued.core.commands.Codec`)."""

    ordered = True
    closing = frozenset({K.READ_OPEN})
    too_many = mc.server_error("too many connections")

    def __init__(self, limits: c.Limits) -> None:
        self.commands = COMMANDS
        self.parser = mc.MemcacheParser(max_line=limits.max_line,
                                        max_item_size=limits.max_item_size)
        # A client repeats its get keys: their requests are made once (they are values;
        # the key, all a get's reply needs of its event, is the same).
        self._gets: dict[str, c.Request] = {}

    def next_request(self) -> c.Request | ConnectionClosed | NeedData | None:
        ev = self.parser.next_event()
        if type(ev) is mc.Get:
            req = self._gets.get(ev.key)
            if req is None:
                if len(self._gets) >= GET_CACHE:
                    self._gets.clear()
                req = self._gets[ev.key] = c.Request(get_of(ev), ev, "get")
            return req
        if ev is NEED_DATA or isinstance(ev, ConnectionClosed):
            return ev
        return c.Request(COMMANDS[type(ev)](ev), ev, command_name(ev))

    def encode(self, request: c.Request, reply: c.Reply) -> bytes:
        ev = request.context
        if isinstance(reply, c.Failure):
            return b"" if isinstance(ev, mc.Set) and ev.noreply else FAILURES[reply.kind](
                reply.message)
        return REPLIES[type(ev)](ev, reply)

    def encode_item(self, request: c.Request, item: Item) -> bytes:
        ev = request.context
        key = f"{ev.queue}+{ev.reader}" if ev.reader else ev.queue
        return mc.value(key, 0, item.data)
