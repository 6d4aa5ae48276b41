"""Kestrel's memcache protocol mapped to the protocol-neutral commands, and back.

Owns the tables: parser event -> command, (command, reply) -> reply bytes, error kind
-> reply. PURE, like the parser it wraps; it never runs a command itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from queued.errors import RemoteProtocolError
from queued.stats import command_name
from queued.wire import commands as c
from queued.wire import memcache_protocol as mc
from queued.wire.access import MAX_PASSWORD, MAX_USER_NAME

# (named directly where compiled code tests a type: `c.Stored` as a value is a look-up in the
# module at each use, `Stored` a static reference)
from queued.wire.commands import Failure, Item, Items, Stored
from queued.wire.memcache_protocol import Get as McGet
from queued.wire.memcache_protocol import Set as McSet
from queued.wire.parsing import NEED_DATA, ConnectionClosed, NeedData

#: memcache exptime values below this are relative seconds, as in memcached.
RELATIVE_EXPTIME_LIMIT: Final = 1_000_000
END: Final = mc.end()
STORED: Final = mc.stored()
#: Distinct get keys whose commands a connection keeps (then it starts again).
GET_CACHE: Final = 256
#: The most data a valid login set carries: `<user> <password>`, each at its cap, and a
#: line end some clients leave on the password.
MAX_LOGIN_DATA: Final = MAX_USER_NAME + 1 + MAX_PASSWORD + 2


def put_of(ev: mc.Set, items: Sequence[bytes] | None = None) -> c.Put:
    """exptime: 0 never, negative already expired (as memcached), < 1,000,000 relative
    seconds, else unix seconds. `items`: the Put's (a list others may join), else the
    event's data alone. The flags are kept with the items (the parser checked the range)."""
    e = ev.exptime
    items = (ev.data,) if items is None else items
    if e == 0:
        put = c.Put(ev.queue, items)
    elif e < 0:
        put = c.Put(ev.queue, items, ttl_ms=0)
    elif e < RELATIVE_EXPTIME_LIMIT:
        put = c.Put(ev.queue, items, ttl_ms=e * 1000)
    else:
        put = c.Put(ev.queue, items, expire_at_ms=e * 1000)
    if ev.flags:
        put.flags = ev.flags
    if ev.delay_ms:
        put.delay_ms = ev.delay_ms
    if ev.key is not None:
        put.key = ev.key
    return put


def credentials(data: bytes) -> c.Auth:
    """A login set's data, `<user> <password>`, as credentials (data that does not decode
    names no user anyone has: refused as such)."""
    user, _, password = data.partition(b" ")
    try:
        return c.Auth(user.decode(), password.rstrip(b"\r\n").decode())
    except UnicodeDecodeError:
        return c.Auth("", "")


def login_of(data: bytes, known: Callable[[str], bool]) -> c.Auth | None:
    """The login a set on a logged-in connection stands for, or None: it is an item.

    A set is a login when its data has the shape of a credential pair of a configured
    user: a name `known` knows, a space, then at most MAX_PASSWORD bytes of UTF-8. That
    is enough: no pair outside this shape can be valid (names and passwords are capped,
    see `queued.wire.access`), so no password can be stored as an item, and only sets of
    this shape pay for a password check (scrypt); every other set costs a length test, or
    a split and a dict lookup when short.
    """
    if len(data) > MAX_LOGIN_DATA:
        return None
    name, space, password = data.partition(b" ")
    if not space or len(name) > MAX_USER_NAME or len(password.rstrip(b"\r\n")) > MAX_PASSWORD:
        return None
    auth = credentials(data)
    return auth if auth.user and known(auth.user) else None


def get_of(ev: mc.Get) -> c.Get:
    return c.Get(ev.queue, ev.reader, timeout_ms=ev.timeout_ms, open=ev.open, close=ev.close,
                 abort=ev.abort, peek=ev.peek, exclusive=True, delay_ms=ev.delay_ms,
                 reject=ev.reject)


COMMANDS: Final[dict[type, Callable[[Any], c.Command]]] = {
    mc.Set: put_of,
    mc.Get: get_of,
    mc.Delete: lambda ev: c.Delete(ev.queue, ev.reader),
    mc.Flush: lambda ev: c.Flush(ev.queue, ev.reader),
    mc.FlushAll: lambda ev: c.FlushAll(),
    mc.FlushExpired: lambda ev: c.FlushExpired(ev.queue, ev.reader),
    mc.FlushAllExpired: lambda ev: c.FlushAllExpired(),
    mc.Stats: lambda ev: c.Stats(),
    mc.DumpStats: lambda ev: c.Stats(dump=True),
    mc.Version: lambda ev: c.Version(),
    mc.Reload: lambda ev: c.Reload(),
    mc.Shutdown: lambda ev: c.Shutdown(),
    mc.Quit: lambda ev: c.Quit(),
    mc.Monitor: lambda ev: c.Monitor(ev.queue, ev.reader, ev.timeout_s * 1000, ev.max_items),
    mc.Confirm: lambda ev: c.Confirm(ev.queue, ev.reader, count=ev.count),
    mc.Touch: lambda ev: c.Touch(ev.queue, ev.reader, ms=ev.ms),
    mc.Pause: lambda ev: c.Pause(ev.queue, ev.on),
}


def _values(ev: mc.Get, reply: c.Items | c.Done, gets: int = 1) -> bytes:
    """The replies of `gets` pipelined gets of one key (see `Request.count`): a VALUE
    block and END for each item, END for each get left without one (an abort or a close
    alone: END)."""
    if type(reply) is not Items or not reply.items:
        return END * gets
    items = reply.items
    if len(items) == 1:
        it = items[0]
        return mc.value(ev.key, it.flags, it.data, END if gets == 1 else END * gets)
    key = ev.key
    return b"".join([mc.value(key, it.flags, it.data) + END for it in items]) + END * (
        gets - len(items))


def _stats(ev: mc.Stats | mc.DumpStats, reply: c.Value) -> bytes:
    queues: Mapping[str, Mapping[str, object]] = reply.value["queues"]
    if isinstance(ev, mc.DumpStats):
        return mc.dump_stats((name, fields.items()) for name, fields in queues.items())
    return mc.queue_stats(reply.value["server"].items(),
                          ((name, fields.items()) for name, fields in queues.items()))


#: parser event type -> the bytes of its successful reply
REPLIES: Final[dict[type, Callable[[Any, Any], bytes]]] = {
    # (a set stored is answered by `MemcacheCodec.encode` itself; here: a Value, the set
    # that authenticated the connection)
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
    # memcached's answers: TOUCHED, or NOT_FOUND when no read is open on the queue
    mc.Touch: lambda ev, r: b"" if ev.noreply else mc.touched() if r.n else mc.not_found(),
    mc.Pause: lambda ev, r: mc.ok(),
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
    # memcached's ASCII authentication (-Y) answers these two; both close
    K.UNAUTHENTICATED: lambda msg: mc.client_error("unauthenticated"),
    K.AUTH_FAILED: lambda msg: mc.client_error("authentication failure"),
    K.PERMISSION_DENIED: mc.client_error,
    K.TOO_MANY_QUEUES: mc.server_error,
    K.NOT_OPEN: lambda msg: mc.not_found(),
    K.PRODUCER_GAP: mc.client_error,  # (memcache puts carry no producer: never given)
}


def _joins_set(a: object, b: mc.Set) -> bool:
    """May set `b` join the request whose context is `a` (one Put, one append)? Only
    with the same flags: a Put's items share them. A set with a key is a put of its own."""
    return (type(a) is McSet and a.queue == b.queue and a.exptime == b.exptime
            and a.flags == b.flags and a.delay_ms == b.delay_ms and not a.noreply
            and not b.noreply and a.key is None and b.key is None)


def _plain(ev: mc.Get) -> bool:
    """A get without options: pipelined ones may be run as one Get of many items."""
    return not (ev.timeout_ms or ev.open or ev.close or ev.abort or ev.peek or ev.reject)


class MemcacheCodec(c.LineCodec):
    """One memcache connection's parser and tables (see `queued.wire.commands.Codec`)."""

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
        #: with users: whether a name is one (a set of a credential pair is a login)
        self.known: Callable[[str], bool] | None = None
        #: a chunk that was one whole plain get or set (`receive_data`'s fast path): its
        #: event, ahead of anything the parser buffers after it
        self._ready: mc.Get | mc.Set | None = None
        #: nothing received since next_requests found the parser idle (asked again, it
        #: answers at once)
        self._drained = False

    def receive_data(self, data: bytes | bytearray) -> None:
        """As the parser's; a chunk that is exactly one plain get or set (a client with
        one request in flight sends nothing else) becomes its event at once, unbuffered."""
        self._drained = False
        if self._ready is None and type(data) is bytes and data:
            ev = self.parser.take_whole(data)
            if ev is not None:
                self._ready = ev
                return
        self.parser.receive_data(data)

    def set_logins(self, known: Callable[[str], bool]) -> None:
        self.known = known

    def pending(self) -> bool:
        return not self._drained and bool(self.parser.in_request())

    def _login(self, ev: mc.Set) -> c.Request | None:
        """A set that is a login (see `login_of`), as an Auth request answered as a set."""
        if self.known is None:
            return None
        auth = login_of(ev.data, self.known)
        return None if auth is None else c.Request(auth, ev, "auth")

    def next_request(self) -> c.Request | ConnectionClosed | NeedData | None:
        # Annotated: the parser's events are wider than `_ready`'s (mypyc checks the type).
        ev: mc.Event | NeedData | None = self._ready
        if ev is not None:
            self._ready = None
        else:
            ev = self.parser.next_event()
        if type(ev) is McGet:
            return self._get(ev)
        if ev is NEED_DATA or isinstance(ev, ConnectionClosed):
            return ev
        if type(ev) is McSet and self.known is not None and (
                login := self._login(ev)) is not None:
            return login
        return c.Request(COMMANDS[type(ev)](ev), ev, command_name(ev))

    def next_requests(self, limit: int) -> list[c.Parsed]:
        """As `commands.next_requests`, joining pipelined requests (`Request.count`):
        consecutive sets to one queue with one exptime and the same flags become one Put,
        consecutive plain gets (no options) of one key one Get of as many items. One pass:
        this is the hot loop of a memcache connection."""
        out: list[c.Parsed] = []
        last: c.Request | None = None  # the request the next one may join
        run: c.Get | None = None  # the Get of `last` once it is a run of gets
        n = 0
        ready = self._ready
        if ready is not None:  # (receive_data's fast path: the first event, parsed)
            self._ready = None
            n = 1
            first: c.Request | None
            if isinstance(ready, McGet):
                first = last = self._get(ready)
            elif (first := self._login(ready)) is None:  # (never joined: it is not an item)
                first = last = c.Request(put_of(ready, [ready.data]), ready, "set")
            if self.parser.idle():
                self._drained = True
                return [first]  # (the common case: that chunk was all)
            out.append(first)
        elif self._drained:
            return out  # (asked again after that chunk: nothing to parse)
        append = out.append
        next_event = self.parser.next_event
        while n < limit:
            n += 1
            try:
                ev = next_event()
            except RemoteProtocolError as e:
                append(c.detached(e))
                last = None
                if e.close:
                    break
                continue
            if type(ev) is McSet:  # (compiled, `ev` is then read as a Set)
                if self.known is not None and (login := self._login(ev)) is not None:
                    append(login)  # never joined: it is not an item
                    last = None
                    continue
                if last is not None and _joins_set(last.context, ev):
                    last.command.items.append(ev.data)  # type: ignore[union-attr]
                    last.count += 1
                    continue
                last = c.Request(put_of(ev, [ev.data]), ev, "set")
                append(last)
            elif type(ev) is McGet:
                if last is not None and last.context is ev and _plain(ev):
                    if last.count == 1:  # the cached request of the key: a run of its own
                        run = c.Get(ev.queue, ev.reader, exclusive=True)
                        last = out[-1] = c.Request(run, ev, "get")
                    assert run is not None  # (made by the run's first get, above)
                    run.max_items += 1
                    last.count += 1
                    continue
                last = self._get(ev)
                append(last)
            elif ev is NEED_DATA:
                break
            else:
                last = None
                if isinstance(ev, ConnectionClosed):
                    append(ev)
                    break
                append(c.Request(COMMANDS[type(ev)](ev), ev, command_name(ev)))
        return out

    def auth_of(self, request: c.Request) -> c.Auth | None:
        """memcached's ASCII authentication: the first command is a set (any key) whose
        data is `<user> <password>`."""
        ev = request.context
        if type(ev) is not McSet or request.count != 1:
            return None
        return credentials(ev.data)

    def _get(self, ev: mc.Get) -> c.Request:
        req = self._gets.get(ev.key)
        if req is None:
            if len(self._gets) >= GET_CACHE:
                self._gets.clear()
            req = self._gets[ev.key] = c.Request(get_of(ev), ev, "get")
        return req

    def encode(self, request: c.Request, reply: c.Reply) -> bytes:
        ev = request.context
        if type(ev) is McSet and type(reply) is Stored:  # (the usual reply, read natively)
            return b"" if ev.noreply else STORED * reply.count
        if isinstance(reply, Failure):
            if isinstance(ev, McSet) and ev.noreply:
                return b""
            # one per joined request, but the connection closes after the first closing one
            n = 1 if reply.kind in self.closing else request.count
            return FAILURES[reply.kind](reply.message) * n
        if type(ev) is McGet:
            return _values(ev, reply, request.count)  # type: ignore[arg-type]
        return REPLIES[type(ev)](ev, reply)

    def encode_item(self, request: c.Request, item: Item) -> bytes:
        ev = request.context
        key = f"{ev.queue}+{ev.reader}" if ev.reader else ev.queue
        return mc.value(key, item.flags, item.data)
