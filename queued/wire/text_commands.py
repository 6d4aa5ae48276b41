"""Kestrel's line "text" protocol mapped to the protocol-neutral commands, and back.

Owns the tables: parser event -> command, (command, reply) -> reply bytes, error kind
-> reply. An item holding a newline cannot be framed here: a get leaves it queued
(`line_safe`), a peek or monitor answers an error for it. PURE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from queued.wire import commands as c
from queued.wire import text_protocol as tp
from queued.wire.commands import Item

NEWLINE_ERROR: Final = "Item contains a newline; use the memcache protocol."

COMMANDS: Final[dict[type, Callable[[Any], c.Command]]] = {
    tp.Put: lambda ev: c.Put(ev.queue, ev.items, ttl_ms=ev.expiry_ms, delay_ms=ev.delay_ms,
                             key=ev.key),
    # Taken as an open read first: an item this protocol cannot carry stays queued.
    tp.Get: lambda ev: c.Get(ev.queue, ev.reader, timeout_ms=ev.timeout_ms, open=True,
                             line_safe=True),
    tp.Peek: lambda ev: c.Get(ev.queue, ev.reader, timeout_ms=ev.timeout_ms, peek=True),
    tp.Monitor: lambda ev: c.Monitor(ev.queue, ev.reader, ev.timeout_ms, ev.max_items),
    tp.Confirm: lambda ev: c.Confirm(ev.queue, ev.reader, count=ev.count),
    tp.Flush: lambda ev: c.Flush(ev.queue, ev.reader),
    tp.Delete: lambda ev: c.Delete(ev.queue, ev.reader),
    tp.Version: lambda ev: c.Version(),
    tp.Auth: lambda ev: c.Auth(ev.user, ev.password),
    tp.Shutdown: lambda ev: c.Shutdown(),
    tp.Quit: lambda ev: c.Quit(),
    tp.Touch: lambda ev: c.Touch(ev.queue, ev.reader, ms=ev.ms),
    tp.Pause: lambda ev: c.Pause(ev.queue, ev.on),
}


def _item(reply: c.Items, deliveries: bool = False) -> bytes:
    """`:<item>`, or with `deliveries` `:<count> <item>`: how many times it has been
    delivered, this time included (its error count + 1)."""
    if not reply.items:
        return tp.empty()
    it = reply.items[0]
    if b"\n" in it.data:
        return tp.error(NEWLINE_ERROR)
    return tp.item(b"%d %s" % (it.error_count + 1, it.data) if deliveries else it.data)


#: parser event type -> the bytes of its successful reply
REPLIES: Final[dict[type, Callable[[Any, Any], bytes]]] = {
    tp.Put: lambda ev, r: tp.count(r.count),
    tp.Get: lambda ev, r: _item(r, ev.deliveries),
    tp.Peek: lambda ev, r: _item(r),
    tp.Monitor: lambda ev, r: tp.empty(),
    tp.Confirm: lambda ev, r: tp.count(r.n),
    tp.Flush: lambda ev, r: tp.count(0),
    tp.Delete: lambda ev, r: tp.count(0),
    tp.Version: lambda ev, r: tp.version(r.value),
    tp.Auth: lambda ev, r: tp.count(1),
    tp.Shutdown: lambda ev, r: b"",
    tp.Quit: lambda ev, r: b"",
    tp.Touch: lambda ev, r: tp.count(r.n),
    tp.Pause: lambda ev, r: tp.count(1),
}

#: a put refused for one of these says so with the queue's name
_REFUSALS: Final = frozenset({c.ErrorKind.QUEUE_FULL, c.ErrorKind.ITEM_TOO_LARGE,
                              c.ErrorKind.JOURNAL_FULL})


class TextCodec(c.LineCodec):
    """One text connection's parser and tables (see `queued.wire.commands.Codec`)."""

    ordered = True
    closing: frozenset[c.ErrorKind] = frozenset()
    too_many = tp.error("Too many connections.")

    def __init__(self, limits: c.Limits) -> None:
        self.commands = COMMANDS
        self.parser = tp.TextParser(max_line=limits.max_line,
                                    max_item_size=min(limits.max_item_size,
                                                      tp.DEFAULT_MAX_ITEM_SIZE))

    def set_limits(self, limits: c.Limits) -> None:
        self.parser.max_line = limits.max_line
        self.parser.max_item_size = min(limits.max_item_size, tp.DEFAULT_MAX_ITEM_SIZE)

    def encode(self, request: c.Request, reply: c.Reply) -> bytes:
        ev = request.context
        if isinstance(reply, c.Failure):
            if reply.kind is c.ErrorKind.NOT_ENCODABLE:
                return tp.error(NEWLINE_ERROR)
            if reply.kind in _REFUSALS and isinstance(ev, tp.Put):
                return tp.error(f"Queue {ev.queue} refused the items: {reply.message}")
            return tp.error(reply.message)
        return REPLIES[type(ev)](ev, reply)

    def encode_item(self, request: c.Request, item: Item) -> bytes:
        if b"\n" in item.data:
            return tp.error(f"Item {item.id} contains a newline; use the memcache protocol.")
        return tp.item(item.data)
