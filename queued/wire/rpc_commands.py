"""queued's MessagePack-RPC calls mapped to the protocol-neutral commands, and back.

Owns the tables: call -> command, reply -> response, error kind -> error code; and
which notifications are refused (without a reply a get would only lose items). Replies
are matched by msgid, so a waiting get does not hold up later calls. PURE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from queued.errors import RemoteProtocolError
from queued.journal.headers import decode_headers
from queued.wire import commands as c
from queued.wire import rpc_protocol as rp
from queued.wire.commands import Item
from queued.wire.parsing import NEED_DATA, ConnectionClosed, NeedData

#: Notifications are run without a reply, except these: without a reply they would
#: only lose items (get) or do nothing (peek, stats, version).
NOTIFY_REFUSED: Final = frozenset({"get", "peek", "stats", "version", "auth", "browse"})


def _get(call: rp.Get, max_bytes: int) -> c.Get:
    auto_abort = call.auto_abort_ms
    return c.Get(call.queue, call.reader, call.max_items, call.timeout_ms, open=auto_abort > 0,
                 open_timeout_ms=auto_abort, max_bytes=max_bytes)


@dataclass(frozen=True, slots=True)
class WithFlags:
    """The context of a get that asked for its items' flags: [id, data, flags] each."""

    msgid: int


@dataclass(frozen=True, slots=True)
class WithDeliveries:
    """The context of a get that asked for delivery counts, or of a browse: [id, data,
    flags, deliveries] each; deliveries = the error count + `extra` (a get's: 1, this
    delivery; a browse's: 0, the deliveries so far)."""

    msgid: int
    extra: int


@dataclass(frozen=True, slots=True)
class WithHeaders(WithDeliveries):
    """A get or browse that asked for headers too: [id, data, flags, deliveries, headers]
    each, headers a map ({} for an item without)."""


COMMANDS: Final[dict[type, Callable[[Any], c.Command]]] = {
    rp.Put: lambda call: c.Put(call.queue, call.items, ttl_ms=call.expiration_ms or None,
                               flags=call.flags, delay_ms=call.delay_ms,
                               producer=call.producer, sequence=call.sequence,
                               headers=call.headers, key=call.key),
    rp.Confirm: lambda call: c.Confirm(call.queue, call.reader, ids=call.ids),
    rp.Abort: lambda call: c.Abort(call.queue, call.reader, ids=call.ids,
                                   delay_ms=call.delay_ms),
    rp.Peek: lambda call: c.Peek(call.queue, call.reader),
    rp.Flush: lambda call: c.Flush(call.queue, call.reader),
    rp.Delete: lambda call: c.Delete(call.queue, call.reader),
    rp.FlushAll: lambda call: c.FlushAll(),
    rp.Stats: lambda call: c.Stats(),
    rp.Version: lambda call: c.Version(),
    rp.Auth: lambda call: c.Auth(call.user, call.password),
    rp.Extend: lambda call: c.Touch(call.queue, call.reader, ms=call.ms, ids=call.ids),
    rp.Reject: lambda call: c.Reject(call.queue, call.reader, ids=call.ids),
    rp.Pause: lambda call: c.Pause(call.queue, call.on),
    rp.Move: lambda call: c.Move(call.queue, call.reader, call.destination, call.max_items,
                                 call.rate),
    rp.Browse: lambda call: c.Browse(call.queue, call.reader, call.after_id, call.n),
}


def _result(reply: c.Reply, with_flags: bool = False, extra: int | None = None,
            with_headers: bool = False) -> Any:
    if isinstance(reply, c.Items):
        if with_headers and extra is not None:
            return [[it.id, it.data, it.flags, it.error_count + extra,
                     decode_headers(it.headers) if it.headers else {}] for it in reply.items]
        if extra is not None:
            return [[it.id, it.data, it.flags, it.error_count + extra] for it in reply.items]
        if with_flags:
            return [[it.id, it.data, it.flags] for it in reply.items]
        return [[it.id, it.data] for it in reply.items]
    if isinstance(reply, c.Peeked):
        head = None if reply.item is None else [reply.item.id, reply.item.data]
        return {"head": head, **reply.info}
    if isinstance(reply, c.Stored):
        return reply.count
    if isinstance(reply, c.ProducerStored):
        return [reply.count, reply.first_id, reply.duplicate]
    if isinstance(reply, c.Count):
        return reply.n
    if isinstance(reply, c.Deleted):
        return reply.existed
    if isinstance(reply, c.Value):
        return reply.value  # (auth: true)
    if isinstance(reply, c.Done) and extra is None:
        return True  # (pause, resume)
    return None


E = rp.ErrorCode
K = c.ErrorKind
CODES: Final[dict[c.ErrorKind, rp.ErrorCode]] = {
    K.BAD_NAME: E.BAD_QUEUE_NAME,
    K.BAD_PARAMS: E.BAD_PARAMS,
    K.QUEUE_FULL: E.QUEUE_FULL,
    K.ITEM_TOO_LARGE: E.ITEM_TOO_LARGE,
    K.JOURNAL_FULL: E.JOURNAL_FULL,
    K.TOO_MANY_OPEN_READS: E.TOO_MANY_OPEN_READS,
    K.READ_OPEN: E.TOO_MANY_OPEN_READS,
    K.NOT_ENCODABLE: E.SERVER_ERROR,
    K.SHUTTING_DOWN: E.SHUTTING_DOWN,
    K.BUSY: E.BUSY,
    K.SERVER_ERROR: E.SERVER_ERROR,
    K.UNAUTHENTICATED: E.UNAUTHENTICATED,
    K.AUTH_FAILED: E.AUTH_FAILED,
    K.PERMISSION_DENIED: E.PERMISSION_DENIED,
    K.TOO_MANY_QUEUES: E.TOO_MANY_QUEUES,
    K.NOT_OPEN: E.NOT_OPEN,
    K.PRODUCER_GAP: E.PRODUCER_GAP,
}


class RpcCodec:
    """One RPC connection's parser and tables (see `queued.wire.commands.Codec`).

    A request's context is its msgid, or None for a notification (no reply is sent), or
    a `WithFlags` holding the msgid of a get that asked for its items' flags.
    """

    ordered = False
    closing: frozenset[c.ErrorKind] = frozenset()
    too_many = rp.RpcError(E.BUSY, "too many connections").reply

    def __init__(self, limits: c.Limits) -> None:
        self.max_batch = limits.max_batch
        self.max_frame = max(64, limits.max_frame)
        self.parser = rp.RpcParser(max_frame=self.max_frame, max_batch=self.max_batch)

    def receive_data(self, data: bytes | bytearray) -> None:
        self.parser.receive_data(data)

    def buffered_bytes(self) -> int:
        return self.parser.buffered_bytes

    def pending(self) -> bool:
        return self.parser.buffered_bytes > 0

    def next_request(self) -> c.Request | ConnectionClosed | NeedData | None:
        ev = self.parser.next_event()
        if ev is NEED_DATA or isinstance(ev, ConnectionClosed):
            return ev
        if isinstance(ev, rp.Response):
            return None  # we send no requests: nothing to match it to
        msgid: int | None
        if isinstance(ev, rp.Notification):
            if ev.method in NOTIFY_REFUSED:
                raise RemoteProtocolError(f"{ev.method} sent as a notification ignored (it "
                                          "needs a reply)", reply=b"", close=False)
            ev, msgid = rp.Request(0, ev.method, ev.params), None
        else:
            msgid = ev.msgid
        try:
            call = rp.parse_call(ev, self.max_batch)
        except rp.RpcError as exc:
            if msgid is None and not exc.close:  # a notification's error has nobody to go to
                raise RemoteProtocolError(str(exc), reply=b"", close=False) from None
            raise
        context: int | WithFlags | WithDeliveries | None = msgid
        if isinstance(call, rp.Get):
            command: c.Command = _get(call, self.max_frame // 2)
            if call.with_headers and msgid is not None:
                context = WithHeaders(msgid, 1)
            elif call.with_deliveries and msgid is not None:
                context = WithDeliveries(msgid, 1)
            elif call.with_flags and msgid is not None:
                context = WithFlags(msgid)
        else:
            command = COMMANDS[type(call)](call)
            if type(call) is rp.Browse and msgid is not None:
                context = (WithHeaders if call.with_headers else WithDeliveries)(msgid, 0)
        return c.Request(command, context, ev.method)

    def next_requests(self, limit: int) -> list[c.Parsed]:
        return c.next_requests(self, limit)

    def auth_of(self, request: c.Request) -> c.Auth | None:
        return c.auth_of(request)

    def set_logins(self, known: Callable[[str], bool]) -> None:
        pass  # (a login of its own: auth)

    def set_limits(self, limits: c.Limits) -> None:
        self.max_batch = limits.max_batch
        self.max_frame = max(64, limits.max_frame)
        self.parser.set_limits(self.max_frame, self.max_batch)

    def encode(self, request: c.Request, reply: c.Reply) -> bytes:
        msgid = request.context
        if msgid is None:
            return b""
        with_flags = type(msgid) is WithFlags
        with_headers = type(msgid) is WithHeaders
        extra = None
        if type(msgid) is WithDeliveries or with_headers:
            extra = msgid.extra
        if with_flags or extra is not None:
            msgid = msgid.msgid
        if isinstance(reply, c.Failure):
            return rp.encode_error(msgid, CODES[reply.kind], reply.message)
        return rp.encode_response(msgid, _result(reply, with_flags, extra, with_headers))

    def encode_item(self, request: c.Request, item: Item) -> bytes:
        raise NotImplementedError("RPC has no monitor")
