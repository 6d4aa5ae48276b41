"""Kestrel's memcache text protocol (port 22133): a sans-IO parser and the reply encoders.

Owns command framing, argument and queue-name validation, and the exact reply bytes.
PURE: no sockets, files, clocks or trio; bytes in, events and bytes out (h11's shape).
It must never allocate what a peer merely declares: every buffer has a cap.
The pieces every parser shares (receive buffer, NEED_DATA, names) are in `wire`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

from queued.errors import (
    BadCommand,
    BadDataChunk,
    LineTooLong,
    LocalProtocolError,
    TooLarge,
    UnknownCommand,
)
from queued.wire.parsing import (
    MAX_DELAY_MS,
    MAX_TIMEOUT_MS,
    NEED_DATA,
    ArgumentError,
    ConnectionClosed,
    LineOverflow,
    LineParser,
    NeedData,
    ParserStatistics,
    parse_address,
    parse_int,
    parse_name,
    parse_put_options,
    parse_queue,
)

DEFAULT_MAX_LINE: Final = 2048
DEFAULT_MAX_ITEM_SIZE: Final = 16 * 1024 * 1024
MAX_FLAGS: Final = (1 << 32) - 1
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1

# -- commands -------------------------------------------------------------------------------


@dataclass(slots=True, init=False)  # not frozen: one per item, 4x cheaper to build
class Set:
    queue: str
    flags: int
    exptime: int  # as sent: 0 never, < 1,000,000 relative seconds, else unix seconds
    data: bytes
    noreply: bool = False
    delay_ms: int = 0  # `set <queue>/delay=<ms>`: invisible that long (a sixth slot: free)
    key: bytes | None = None  # `set <queue>/key=<k>`: a deduplication key

    # (written out, as queued.journal.records.Put's is: one is made per set)
    def __init__(self, queue: str, flags: int, exptime: int, data: bytes,
                 noreply: bool = False, delay_ms: int = 0, key: bytes | None = None) -> None:
        self.queue = queue
        self.flags = flags
        self.exptime = exptime
        self.data = data
        self.noreply = noreply
        self.delay_ms = delay_ms
        self.key = key


@dataclass(frozen=True, slots=True)
class Get:
    key: str  # exactly as sent, options included: VALUE must echo it
    queue: str
    reader: str | None = None
    timeout_ms: int = 0
    open: bool = False
    close: bool = False
    abort: bool = False
    peek: bool = False
    delay_ms: int = 0  # `get <queue>/abort/delay=<ms>`: the aborted items wait that long
    reject: bool = False  # `get <queue>/reject`: the open read gives up (error_queue or drop)


@dataclass(frozen=True, slots=True)
class Delete:
    queue: str
    reader: str | None = None
    noreply: bool = False


@dataclass(frozen=True, slots=True)
class Flush:
    queue: str
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class FlushAll:
    delay_s: int = 0
    noreply: bool = False


@dataclass(frozen=True, slots=True)
class FlushExpired:
    queue: str
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class FlushAllExpired:
    pass


@dataclass(frozen=True, slots=True)
class Stats:
    args: tuple[str, ...] = ()  # `stats items` etc.; Kestrel ignores them


@dataclass(frozen=True, slots=True)
class DumpStats:
    pass


@dataclass(frozen=True, slots=True)
class Version:
    pass


@dataclass(frozen=True, slots=True)
class Reload:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Quit:
    pass


@dataclass(frozen=True, slots=True)
class Monitor:
    queue: str
    timeout_s: int
    max_items: int | None = None
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Confirm:
    queue: str
    count: int
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Touch:
    """`touch <queue> <ms> [noreply]`: memcached's command name, our queue's meaning."""

    queue: str
    ms: int
    reader: str | None = None
    noreply: bool = False


@dataclass(frozen=True, slots=True)
class Pause:
    """`pause <queue>` (on) or `resume <queue>`."""

    queue: str
    on: bool = True


Command: TypeAlias = (
    Set | Get | Delete | Flush | FlushAll | FlushExpired | FlushAllExpired | Stats | DumpStats
    | Version | Reload | Shutdown | Quit | Monitor | Confirm | Touch | Pause
)
Event: TypeAlias = Command | ConnectionClosed

# -- reply encoders -------------------------------------------------------------------------

_TOKEN_RE: Final = re.compile(r"[!-~]+")  # printable ASCII, no space: safe inside a reply line
_UNSAFE_RE: Final = re.compile(r"[^ -~]")


def _text(msg: str) -> bytes:
    # Messages may quote peer input: never let it end the line or smuggle a second reply.
    return _UNSAFE_RE.sub("?", msg).encode("ascii")


def _token(s: str, what: str) -> bytes:
    if _TOKEN_RE.fullmatch(s) is None:
        raise LocalProtocolError(f"{what} {s!r} cannot go on the wire")
    return s.encode("ascii")


def stored() -> bytes:
    return b"STORED\r\n"


def not_stored() -> bytes:
    return b"NOT_STORED\r\n"


#: keys checked for the wire, as bytes (a connection repeats its few keys; bounded)
_KEY_TOKENS: dict[str, bytes] = {}
KEY_TOKENS: Final = 1024


def value(key: str, flags: int, data: bytes, tail: bytes = b"") -> bytes:
    """One `VALUE` block without the closing END (append end() after the last one, or
    give it as `tail`)."""
    if not 0 <= flags <= MAX_FLAGS:
        raise LocalProtocolError(f"flags {flags} out of range")
    token = _KEY_TOKENS.get(key)
    if token is None:
        token = _token(key, "key")
        if len(_KEY_TOKENS) >= KEY_TOKENS:
            _KEY_TOKENS.clear()
        _KEY_TOKENS[key] = token
    return b"VALUE %s %d %d\r\n%s\r\n%s" % (token, flags, len(data), data, tail)


def end() -> bytes:
    return b"END\r\n"


def error() -> bytes:
    return b"ERROR\r\n"


def client_error(msg: str = "") -> bytes:
    return b"CLIENT_ERROR " + _text(msg) + b"\r\n" if msg else b"CLIENT_ERROR\r\n"


def server_error(msg: str = "") -> bytes:
    return b"SERVER_ERROR " + _text(msg) + b"\r\n" if msg else b"SERVER_ERROR\r\n"


def deleted() -> bytes:
    return b"DELETED\r\n"


def not_found() -> bytes:
    return b"NOT_FOUND\r\n"


def touched() -> bytes:
    return b"TOUCHED\r\n"


def ok() -> bytes:
    return b"OK\r\n"


def flushed_all() -> bytes:
    """Kestrel's reply to flush_all."""
    return b"Flushed all queues.\r\n"


def reloaded() -> bytes:
    return b"Reloaded config.\r\n"


def count(n: int) -> bytes:
    """A bare number line: Kestrel's reply to flush_expired and flush_all_expired."""
    return b"%d\r\n" % n


def version(v: str) -> bytes:
    return b"VERSION " + _token(v, "version") + b"\r\n"


def stat(name: str, val: object) -> bytes:
    return b"STAT " + _token(name, "stat name") + b" " + _text(str(val)) + b"\r\n"


def stats(pairs: Iterable[tuple[str, object]]) -> bytes:
    """`STAT name value` lines then END."""
    return b"".join(stat(k, v) for k, v in pairs) + end()


def queue_stats(server: Iterable[tuple[str, object]],
                queues: Iterable[tuple[str, Iterable[tuple[str, object]]]]) -> bytes:
    """`stats`: the server's lines, then `queue_<name>_<field>` lines, then END.

    One chunk per queue, so a reply for thousands of queues never holds a small object
    per line at once: a burst of millions of them would leave the allocator's arenas
    pinned by whatever long-lived objects were made meanwhile (RSS that does not come
    back)."""
    chunks = [b"".join(stat(k, v) for k, v in server)]
    for name, fields in queues:
        prefix = "queue_" + name + "_"
        chunks.append(b"".join(stat(prefix + k, v) for k, v in fields))
    chunks.append(end())
    return b"".join(chunks)


def dump_stats(queues: Iterable[tuple[str, Iterable[tuple[str, object]]]]) -> bytes:
    """Kestrel's readable grouping: `queue 'q' {`, `  field=value` lines, `}`, then END.
    One chunk per queue, as in `queue_stats`."""
    chunks = []
    for name, fields in queues:
        chunks.append(b"".join([
            b"queue '" + _token(name, "queue name") + b"' {\r\n",
            *(b"  " + _token(k, "stat name") + b"=" + _text(str(v)) + b"\r\n"
              for k, v in fields),
            b"}\r\n"]))
    chunks.append(end())
    return b"".join(chunks)


# -- parser ---------------------------------------------------------------------------------


class _State(enum.Enum):
    LINE = "line"  # waiting for a command line
    DATA = "data"  # waiting for a set's data block and its CRLF
    SKIP = "skip"  # discarding a refused data block, never buffering it
    SKIP_END = "skip_end"  # the CRLF after a discarded block


_FAST_GET: Final = re.compile(rb"get ([A-Za-z0-9_:-]{1,250})")
_FAST_SET: Final = re.compile(
    rb"set ([A-Za-z0-9_:-]{1,250}) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10})"
)
#: `set <q>/key=<k> <flags> <exptime> <bytes>`: each line differs (its key), so it is
#: matched, never cached
_FAST_KEYED_SET: Final = re.compile(
    rb"set ([A-Za-z0-9_:-]{1,250})/key=([!-.0-~]{1,64}) ([0-9]{1,10}) ([0-9]{1,10}) "
    rb"([0-9]{1,10})"
)
_TO_DATA: Final = object()  # _fast switched to the DATA state
#: Command lines remembered parsed (then the cache starts again), and the longest kept: a
#: client repeats the same few lines, and a repeated line costs one dict lookup. One cache
#: serves every parser with the same item cap (`_line_cache`): the lines repeat across
#: connections too (a producer feeding 100 queues, 64 clients of one queue), and the
#: memory is bounded per server rather than per connection (~2 MiB when full).
LINE_CACHE: Final = 4096
LINE_CACHE_MAX_LINE: Final = 280
#: item cap -> the line cache of the parsers with that cap (a parsed set's size was
#: checked against the cap; nothing else a cached line holds depends on the parser)
_LINE_CACHES: dict[int, dict[bytes, Get | tuple[str, int, int, int]]] = {}


def _line_cache(max_item_size: int) -> dict[bytes, Get | tuple[str, int, int, int]]:
    """The line cache shared by the parsers whose item cap is `max_item_size`."""
    cache = _LINE_CACHES.get(max_item_size)
    if cache is None:
        if len(_LINE_CACHES) >= 8:  # (caps come from config: a handful at most)
            _LINE_CACHES.clear()
        cache = _LINE_CACHES[max_item_size] = {}
    return cache
_STORAGE: Final = frozenset({b"set", b"add", b"replace", b"append", b"prepend", b"cas"})
_NOREPLY: Final = frozenset({b"delete", b"flush_all", b"touch"})  # besides the storage commands
_Handler: TypeAlias = Callable[["MemcacheParser", list[bytes]], Command]


class MemcacheParser(LineParser["Command"]):
    """Bytes in (receive_data), commands out (next_event), in order, until NEED_DATA.

    Call next_event() until NEED_DATA before each receive_data(): the buffer then stays
    under max(max_line, max_item_size) plus one received chunk. receive_data(b"") means
    the peer closed; next_event() then answers ConnectionClosed.

    Choices where Kestrel and memcached differ or are silent:
    - a set over max_item_size answers NOT_STORED (Kestrel's reply to an item over its
      maxItemSize) from the header alone; the declared bytes and CRLF are then skipped
      unbuffered and the connection stays usable;
    - a storage command whose byte count cannot be read, or a data block not ending in
      CRLF, closes: past that point its payload would be parsed as commands;
    - add/replace/append/prepend/cas: data skipped, CLIENT_ERROR, connection kept;
    - noreply silences every reply that keeps the connection, errors included (as
      memcached does); a closing error is always sent;
    - `get a b`: CLIENT_ERROR, connection kept (Kestrel silently used the first key);
    - a bad get key or option set (Kestrel's rule: peek or abort with open or close,
      peek with abort; also unknown options) is CLIENT_ERROR and closes, as Kestrel;
    - unknown command or empty line: ERROR, kept (memcached; Kestrel said CLIENT_ERROR).
    """

    def __init__(
        self, *, max_line: int = DEFAULT_MAX_LINE, max_item_size: int = DEFAULT_MAX_ITEM_SIZE
    ) -> None:
        if max_line < 16 or max_item_size < 0:
            raise ValueError("max_line must be >= 16 and max_item_size >= 0")
        super().__init__()
        self.max_line = max_line
        self.max_item_size = max_item_size
        self._state = _State.LINE
        self._skip = 0
        self._pending: tuple[str, int, int, bool, int] | None = None
        self._pending_delay = 0  # the delay of the set whose data block is pending
        self._pending_key: bytes | None = None  # its deduplication key
        #: line -> its Get, or (queue, flags, exptime, size) of a plain set (shared)
        self._lines = _line_cache(max_item_size)

    def _accept(self, data: bytes | bytearray) -> None:
        if self._state is _State.SKIP and not len(self.buffer):
            n = min(self._skip, len(data))  # refused bytes never enter the buffer
            self._skip -= n
            if not self._skip:
                self._state = _State.SKIP_END
            if n:
                with memoryview(data) as view:
                    self.buffer.append(view[n:])
                return
        self.buffer.append(data)

    def in_request(self) -> bool:
        return self._state is not _State.LINE or len(self.buffer) > 0

    def idle(self) -> bool:
        """Nothing to give: no byte buffered, no state, no end of stream or failure."""
        return self._state is _State.LINE and not len(self.buffer) and not (
            self.buffer.eof or self.failure is not None)

    def statistics(self) -> ParserStatistics:
        return ParserStatistics(len(self.buffer), self._skip, self.failure is not None)

    # -- states --

    def _next(self) -> Event | NeedData:
        while True:
            if self._state is _State.LINE:
                try:
                    line = self.buffer.take_line(self.max_line)
                except LineOverflow as e:
                    raise LineTooLong(str(e), reply=client_error("line too long"),
                                      close=True) from None
                if line is None:
                    return self._starved()
                fast = self._fast(line)
                if fast is _TO_DATA:
                    continue
                if isinstance(fast, (Get, Set)):
                    return fast
                event = self._command(line)
                if event is not None:
                    return event
            elif self._state is _State.DATA:
                assert self._pending is not None
                queue, flags, exptime, noreply, size = self._pending
                if len(self.buffer) < size + 2:
                    return self._starved()
                if self.buffer.peek(size, size + 2) != b"\r\n":
                    raise BadDataChunk("data block not followed by CRLF",
                                       reply=client_error("bad data chunk"), close=True)
                data = self.buffer.take(size)
                self.buffer.skip(2)
                assert data is not None
                self._pending = None
                self._state = _State.LINE
                if self._pending_delay or self._pending_key is not None:
                    delay, self._pending_delay = self._pending_delay, 0
                    key, self._pending_key = self._pending_key, None
                    return Set(queue, flags, exptime, data, noreply, delay, key)
                return Set(queue, flags, exptime, data, noreply)
            elif self._state is _State.SKIP:
                self._skip -= self.buffer.skip(self._skip)
                if self._skip:
                    return self._starved()
                self._state = _State.SKIP_END
            else:  # SKIP_END
                crlf = self.buffer.take(2)
                if crlf is None:
                    return self._starved()
                self._state = _State.LINE
                if crlf != b"\r\n":
                    raise BadDataChunk("data block not followed by CRLF",
                                       reply=client_error("bad data chunk"), close=True)

    def take_whole(self, data: bytes) -> Get | Set | None:
        """The reactor's common chunk: nothing buffered and `data` exactly one plain
        `get <q>` or `set <q> <f> <e> <n>` with its data block. Its event, without
        buffering `data`; None (nothing consumed): feed `data` to `receive_data` as usual
        (the general path then gives every other shape, and every error, its treatment)."""
        if self._state is not _State.LINE or len(self.buffer) or self.buffer.eof or (
                self.failure is not None):
            return None
        i = data.find(b"\n", 0, self.max_line + 2)
        if i < 0:
            return None
        line = data[:i - 1] if i and data[i - 1] == 13 else data[:i]
        if len(line) > self.max_line:
            return None
        hit = self._lines.get(line)
        if hit is None:
            hit = self._fast_line(line)
            if hit is None:
                return None
            if len(line) <= LINE_CACHE_MAX_LINE:
                if len(self._lines) >= LINE_CACHE:
                    self._lines.clear()
                self._lines[line] = hit
        if type(hit) is Get:
            return hit if i + 1 == len(data) else None
        queue, flags, exptime, size = hit  # type: ignore[misc]
        end = i + 1 + size
        if len(data) != end + 2 or data[end] != 13 or data[end + 1] != 10:
            return None
        return Set(queue, flags, exptime, data[i + 1:end])

    def _fast(self, line: bytes) -> Get | Set | object | None:
        """The two hot commands in their plain form (`get <q>`, `set <q> <f> <e> <n>`):
        a line seen before is one dict lookup, a new one one regex; None sends the line
        down the general path, which gives every other form (and every error) its exact
        treatment."""
        hit = self._lines.get(line)
        if hit is None:
            hit = self._fast_line(line)
            if hit is None:
                return self._fast_keyed(line)
            if len(line) <= LINE_CACHE_MAX_LINE:
                if len(self._lines) >= LINE_CACHE:
                    self._lines.clear()
                self._lines[line] = hit
        if type(hit) is Get:
            return hit
        queue, flags, exptime, size = hit  # type: ignore[misc]
        data = self.buffer.take_block(size)
        if data is not None:
            return Set(queue, flags, exptime, data)
        self._pending = (queue, flags, exptime, False, size)
        self._state = _State.DATA  # _next's loop finishes (or waits for) the block
        return _TO_DATA

    def _fast_keyed(self, line: bytes) -> Set | object | None:
        """`set <q>/key=<k> <flags> <exptime> <bytes>` (the key already valid by the
        pattern), as `_fast` does a plain set; None: the general path."""
        m = _FAST_KEYED_SET.fullmatch(line)
        if m is None:
            return None
        flags, size = int(m[3]), int(m[5])
        if flags > MAX_FLAGS or size > self.max_item_size:
            return None
        queue, key, exptime = m[1].decode("ascii"), m[2], int(m[4])
        data = self.buffer.take_block(size)
        if data is not None:
            return Set(queue, flags, exptime, data, False, 0, key)
        self._pending = (queue, flags, exptime, False, size)
        self._pending_key = key
        self._state = _State.DATA
        return _TO_DATA

    def _fast_line(self, line: bytes) -> Get | tuple[str, int, int, int] | None:
        m = _FAST_GET.fullmatch(line)
        if m is not None:
            queue = m[1].decode("ascii")
            return Get(queue, queue)
        if line.startswith(b"get ") and b"/" in line:
            # `get <q>/<options>` (the reliable-read chain repeats `get q/close/open`): the
            # general parse once, then the cache; an error goes the general way (it closes).
            args = line.split()
            if len(args) != 2:
                return None
            try:
                return self._get(args[1:])
            except (ArgumentError, UnicodeDecodeError):
                return None
        m = _FAST_SET.fullmatch(line)
        if m is None:
            return None
        flags, size = int(m[2]), int(m[4])
        if flags > MAX_FLAGS or size > self.max_item_size:
            return None
        return m[1].decode("ascii"), flags, int(m[3]), size

    def _starved(self) -> ConnectionClosed | NeedData:
        return ConnectionClosed(len(self.buffer)) if self.buffer.eof else NEED_DATA

    def _command(self, line: bytes) -> Command | None:
        """An event, or None when a storage command switched state to read its data."""
        tokens = line.split()
        if not tokens:
            raise UnknownCommand("empty command line", reply=error(), close=False)
        name, args = tokens[0].lower(), tokens[1:]
        if name in _STORAGE:
            self._storage(name, args)
            return None
        handler = _HANDLERS.get(name)
        if handler is None:
            raise UnknownCommand(f"unknown command {name[:40]!r}", reply=error(), close=False)
        if name == b"get" and len(args) == 1:
            try:
                return handler(self, args)
            except ArgumentError as e:  # Kestrel closes on a malformed key or bad options
                raise BadCommand(str(e), reply=client_error(str(e)), close=True) from None
        noreply = name in _NOREPLY and bool(args) and args[-1] == b"noreply"
        try:
            return handler(self, args)
        except ArgumentError as e:
            reply = b"" if noreply else client_error(str(e))
            raise BadCommand(str(e), reply=reply, close=False) from None

    def _storage(self, name: bytes, args: list[bytes]) -> None:
        noreply = bool(args) and args[-1] == b"noreply"
        core = args[:-1] if noreply else args
        if len(core) != (5 if name == b"cas" else 4) or not core[3].isdigit():
            # Without a trustworthy length the data block would be parsed as commands.
            msg = "bad command line format"
            raise BadCommand(msg, reply=client_error(msg), close=True)
        size = int(core[3]) if len(core[3]) <= 30 else 1 << 100
        quiet = b"" if noreply else None
        if size > self.max_item_size:
            self._begin_skip(size)
            raise TooLarge(f"value of {size} bytes over the {self.max_item_size} byte cap",
                           reply=quiet if quiet is not None else not_stored(), close=False)
        if name != b"set":
            self._begin_skip(size)
            msg = f"{name.decode('ascii')} is not supported; queues only take set"
            raise BadCommand(msg, reply=quiet if quiet is not None else client_error(msg),
                             close=False)
        try:
            address, *options = core[0].split(b"/")
            queue = parse_queue(address)
            delay, key = parse_put_options(options, "set") if options else (0, None)
            flags = parse_int(core[1], "flags", 0, MAX_FLAGS)
            exptime = parse_int(core[2], "exptime", I64_MIN, I64_MAX)
            self._pending_delay, self._pending_key = delay, key
        except ArgumentError as e:
            self._begin_skip(size)
            raise BadCommand(str(e), reply=quiet if quiet is not None else client_error(str(e)),
                             close=False) from None
        self._pending = (queue, flags, exptime, noreply, size)
        self._state = _State.DATA

    def _begin_skip(self, size: int) -> None:
        self._skip = size
        self._state = _State.SKIP

    # -- one method per command without a data block --

    def _get(self, args: list[bytes]) -> Get:
        if len(args) != 1:  # multi-key get: queues answer one key at a time (Kestrel too)
            raise ArgumentError("get takes exactly one key")
        key = args[0]
        address, *options = key.split(b"/")
        queue, reader = parse_address(address)
        timeout_ms = delay_ms = 0
        flags = {b"open": False, b"close": False, b"abort": False, b"peek": False,
                 b"reject": False}
        for opt in options:
            if opt.startswith(b"t="):
                timeout_ms = parse_int(opt[2:], "timeout", 0, MAX_TIMEOUT_MS)
            elif opt.startswith(b"delay="):
                delay_ms = parse_int(opt[6:], "delay", 0, MAX_DELAY_MS)
            elif opt in flags:
                flags[opt] = True
            else:
                raise ArgumentError("unknown get option")
        opening, closing = flags[b"open"], flags[b"close"]
        aborting, peeking = flags[b"abort"], flags[b"peek"]
        # Kestrel's rule: peek and abort exclude each other and exclude open/close.
        if ((peeking or aborting) and (opening or closing)) or (peeking and aborting):
            raise ArgumentError("invalid combination of get options")
        if flags[b"reject"] and (len(options) != 1):
            raise ArgumentError("reject goes alone")
        if delay_ms and not aborting:
            raise ArgumentError("delay=<ms> goes only with abort")
        return Get(key.decode("ascii"), queue, reader, timeout_ms,
                   opening, closing, aborting, peeking, delay_ms, flags[b"reject"])

    def _delete(self, args: list[bytes]) -> Delete:
        noreply = _noreply(args)
        _arity(args, 1, 1, "delete <queue> [noreply]")
        queue, reader = parse_address(args[0])
        return Delete(queue, reader, noreply)

    def _flush(self, args: list[bytes]) -> Flush:
        _arity(args, 1, 1, "flush <queue>")
        return Flush(*parse_address(args[0]))

    def _flush_expired(self, args: list[bytes]) -> FlushExpired:
        _arity(args, 1, 1, "flush_expired <queue>")
        return FlushExpired(*parse_address(args[0]))

    def _flush_all(self, args: list[bytes]) -> FlushAll:
        noreply = _noreply(args)
        _arity(args, 0, 1, "flush_all [delay] [noreply]")
        delay = parse_int(args[0], "delay", 0, MAX_TIMEOUT_MS) if args else 0
        return FlushAll(delay, noreply)

    def _stats(self, args: list[bytes]) -> Stats:
        return Stats(tuple(parse_name(a, "stats argument") for a in args))

    def _monitor(self, args: list[bytes]) -> Monitor:
        _arity(args, 2, 3, "monitor <queue> <seconds> [max_items]")
        queue, reader = parse_address(args[0])
        timeout_s = parse_int(args[1], "timeout", 0, MAX_TIMEOUT_MS)
        max_items = parse_int(args[2], "max_items", 1, MAX_TIMEOUT_MS) if len(args) > 2 else None
        return Monitor(queue, timeout_s, max_items, reader)

    def _touch(self, args: list[bytes]) -> Touch:
        noreply = _noreply(args)
        _arity(args, 2, 2, "touch <queue> <ms> [noreply]")
        queue, reader = parse_address(args[0])
        return Touch(queue, parse_int(args[1], "ms", 0, MAX_TIMEOUT_MS), reader, noreply)

    def _pause(self, args: list[bytes], on: bool) -> Pause:
        _arity(args, 1, 1, f"{'pause' if on else 'resume'} <queue>")
        return Pause(parse_queue(args[0]), on)

    def _confirm(self, args: list[bytes]) -> Confirm:
        _arity(args, 2, 2, "confirm <queue> <count>")
        queue, reader = parse_address(args[0])
        return Confirm(queue, parse_int(args[1], "count", 0, MAX_TIMEOUT_MS), reader)


def _noreply(args: list[bytes]) -> bool:
    """Pops a trailing `noreply`."""
    if args and args[-1] == b"noreply":
        args.pop()
        return True
    return False


def _arity(args: list[bytes], lo: int, hi: int, usage: str) -> None:
    if not lo <= len(args) <= hi:
        raise ArgumentError(f"usage: {usage}")


def _no_args(event: Command) -> _Handler:
    def handler(parser: MemcacheParser, args: list[bytes]) -> Command:
        if args:
            raise ArgumentError("this command takes no arguments")
        return event

    return handler


_HANDLERS: Final[dict[bytes, _Handler]] = {
    b"get": MemcacheParser._get,
    b"delete": MemcacheParser._delete,
    b"flush": MemcacheParser._flush,
    b"flush_all": MemcacheParser._flush_all,
    b"flush_expired": MemcacheParser._flush_expired,
    b"flush_all_expired": _no_args(FlushAllExpired()),
    b"stats": MemcacheParser._stats,
    b"dump_stats": _no_args(DumpStats()),
    b"version": _no_args(Version()),
    b"reload": _no_args(Reload()),
    b"shutdown": _no_args(Shutdown()),
    b"quit": _no_args(Quit()),
    b"monitor": MemcacheParser._monitor,
    b"confirm": MemcacheParser._confirm,
    b"touch": MemcacheParser._touch,
    b"pause": lambda parser, args: parser._pause(args, True),
    b"resume": lambda parser, args: parser._pause(args, False),
}
