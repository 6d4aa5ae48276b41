"""Protocol-neutral commands and replies: what a session runs and what it answers.

Each protocol maps its wire events to these commands and these replies back to
bytes with tables (`memcache_commands`, `text_commands`, `rpc_commands`); the one
session runs them against the broker. PURE: values and tables only, no I/O.
The one error-kind enum lives here too: every refusal the broker or the session
can give becomes one `ErrorKind`, and each protocol's table says how it looks.

Commands and replies are values, never changed once made, but not `frozen`: they are
made for every request, and a frozen dataclass costs about 4x as much to build
(0.34 against 0.09 us for four fields, measured here).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from queued.errors import (
    BadNameError,
    ItemTooLargeError,
    JournalClosedError,
    JournalError,
    JournalFullError,
    NotOpenError,
    ProducerGapError,
    QueueClosedError,
    QueueError,
    QueueFullError,
    ReadStateError,
    RemoteProtocolError,
    TooManyQueuesError,
)
from queued.journal import records
from queued.stats import command_name
from queued.wire.parsing import NEED_DATA, ConnectionClosed, NeedData

#: An item as a get returns it: the journal's PUT record (id, data, times, error count, flags).
Item = records.Put


# -- commands -----------------------------------------------------------------------------------


@dataclass(slots=True, init=False)
class Put:
    """Journal `items`; expiry relative (`ttl_ms`) or absolute (`expire_at_ms`, unix ms);
    `flags`: every item's memcache flags (u32, kept with the item, 0 for most)."""

    queue: str
    items: Sequence[bytes]
    ttl_ms: int | None = None
    expire_at_ms: int | None = None
    flags: int = 0
    delay_ms: int = 0  # > 0: the items stay invisible that long (delayed delivery)
    #: exactly-once puts (RPC): the producer id and this put's sequence (from 1)
    producer: bytes | None = None
    sequence: int = 0
    #: item headers (RPC): one block per item (queued.journal.headers; b"": none), or
    #: None when no item has any
    headers: Sequence[bytes] | None = None
    #: a deduplication key (memcache, text, RPC): stored once within the queue's window
    key: bytes | None = None

    # (written out, as queued.journal.records.Put's is: compiled, one made per request)
    def __init__(self, queue: str, items: Sequence[bytes], ttl_ms: int | None = None,
                 expire_at_ms: int | None = None, flags: int = 0, delay_ms: int = 0,
                 producer: bytes | None = None, sequence: int = 0,
                 headers: Sequence[bytes] | None = None, key: bytes | None = None) -> None:
        self.queue = queue
        self.items = items
        self.ttl_ms = ttl_ms
        self.expire_at_ms = expire_at_ms
        self.flags = flags
        self.delay_ms = delay_ms
        self.producer = producer
        self.sequence = sequence
        self.headers = headers
        self.key = key

    def expire_ms(self, now_ms: int) -> int | None:
        if self.expire_at_ms is not None:
            return self.expire_at_ms
        return None if self.ttl_ms is None else now_ms + self.ttl_ms


@dataclass(slots=True, init=False)
class Get:
    """Kestrel's get: up to `max_items`, waiting `timeout_ms` for the first.

    `close` confirms the connection's open reads on the queue first, `abort` returns
    them (and takes nothing); `open` takes the items as reliable reads (returned after
    `open_timeout_ms`, None = the queue's setting), `peek` leaves them in place.
    `exclusive`: a get while the connection holds an open read on the queue is refused
    (Kestrel's memcache rule). `line_safe`: an item the protocol cannot frame (it holds
    a newline) stays queued and the reply is NOT_ENCODABLE; what is taken is consumed.
    """

    queue: str
    reader: str | None = None
    max_items: int = 1
    timeout_ms: int = 0
    open: bool = False
    close: bool = False
    abort: bool = False
    peek: bool = False
    open_timeout_ms: int | None = None
    exclusive: bool = False
    line_safe: bool = False
    max_bytes: int = 0  # stop adding items past this much data (0: no cap; one at least)
    delay_ms: int = 0  # with `abort`: the returned items wait that long (retry back-off)
    reject: bool = False  # the open reads on the queue give up now (see Reject); takes nothing

    # (written out, as Put's is)
    def __init__(self, queue: str, reader: str | None = None, max_items: int = 1,
                 timeout_ms: int = 0, open: bool = False,
                 close: bool = False, abort: bool = False, peek: bool = False,
                 open_timeout_ms: int | None = None, exclusive: bool = False,
                 line_safe: bool = False, max_bytes: int = 0, delay_ms: int = 0,
                 reject: bool = False) -> None:
        self.queue = queue
        self.reader = reader
        self.max_items = max_items
        self.timeout_ms = timeout_ms
        self.open = open
        self.close = close
        self.abort = abort
        self.peek = peek
        self.open_timeout_ms = open_timeout_ms
        self.exclusive = exclusive
        self.line_safe = line_safe
        self.max_bytes = max_bytes
        self.delay_ms = delay_ms
        self.reject = reject

    def copy(self) -> Get:
        """A copy to change (a parser hands out one Get per line it has cached, so a
        get's is never changed in place). `dataclasses.replace` runs the standard
        library's Python: some 3 us a call, paid by every `get q/close/open`."""
        return Get(self.queue, self.reader, self.max_items, self.timeout_ms, self.open,
                   self.close, self.abort, self.peek, self.open_timeout_ms, self.exclusive,
                   self.line_safe, self.max_bytes, self.delay_ms, self.reject)


@dataclass(slots=True)
class Peek:
    """The head item and the reader's statistics, without taking anything."""

    queue: str
    reader: str | None = None


@dataclass(slots=True)
class Confirm:
    """Confirm the connection's open reads: `ids`, else the `count` oldest, else all."""

    queue: str
    reader: str | None = None
    count: int | None = None
    ids: Sequence[int] | None = None


@dataclass(slots=True)
class Abort:
    """Return the connection's open reads (`ids`, else all) to the head of the queue."""

    queue: str
    reader: str | None = None
    ids: Sequence[int] | None = None
    delay_ms: int = 0  # > 0: the returned items wait that long first (retry back-off)


@dataclass(slots=True)
class Touch:
    """Extend the connection's open reads on the queue (`ids`, else all) to `ms` from now
    (0: no timeout). Naming an id the connection does not hold open is refused."""

    queue: str
    reader: str | None = None
    ms: int = 0
    ids: Sequence[int] | None = None


@dataclass(slots=True)
class Reject:
    """Give up on the connection's open reads (`ids`, else all): each goes to the
    reader's error_queue at once, or is dropped when it has none."""

    queue: str
    reader: str | None = None
    ids: Sequence[int] | None = None


@dataclass(slots=True)
class Pause:
    """Pause (`on`) or resume a queue: while paused it takes puts, and its gets wait."""

    queue: str
    on: bool = True


@dataclass(slots=True)
class Move:
    """Move up to `max_items` (0: all there now) of `source`'s items to `destination`,
    each durable there before it leaves here, at most `rate` a second (0: no limit)."""

    queue: str  # the source
    reader: str | None
    destination: str
    max_items: int = 0
    rate: int = 0


@dataclass(slots=True)
class Browse:
    """Up to `n` items after id `after_id`, in delivery order, without taking them."""

    queue: str
    reader: str | None = None
    after_id: int = 0
    n: int = 100


@dataclass(slots=True)
class Flush:
    queue: str
    reader: str | None = None


@dataclass(slots=True)
class FlushAll:
    pass


@dataclass(slots=True)
class FlushExpired:
    queue: str
    reader: str | None = None


@dataclass(slots=True)
class FlushAllExpired:
    pass


@dataclass(slots=True)
class Delete:
    queue: str
    reader: str | None = None


@dataclass(slots=True)
class Stats:
    dump: bool = False  # memcache dump_stats (an admin command with users configured)


@dataclass(slots=True)
class Auth:
    """Authenticate the connection as `user` (text AUTH, RPC auth, memcache's first set)."""

    user: str
    password: str = field(repr=False)


@dataclass(slots=True)
class Version:
    pass


@dataclass(slots=True)
class Reload:
    pass


@dataclass(slots=True)
class Shutdown:
    """Stop the server; this connection ends at once."""


@dataclass(slots=True)
class Quit:
    """End this connection."""


@dataclass(slots=True)
class Monitor:
    """Send items as they arrive, as open reads, until `timeout_ms` or `max_items`."""

    queue: str
    reader: str | None
    timeout_ms: int
    max_items: int | None = None


Command: TypeAlias = (
    Put | Get | Peek | Confirm | Abort | Flush | FlushAll | FlushExpired | FlushAllExpired
    | Delete | Stats | Version | Reload | Shutdown | Quit | Monitor | Auth | Touch | Reject
    | Pause | Move | Browse
)

# -- replies --------------------------------------------------------------------------------


class ErrorKind(enum.Enum):
    """Why a command was refused; each protocol's table turns it into its reply."""

    BAD_NAME = "bad_name"
    BAD_PARAMS = "bad_params"
    QUEUE_FULL = "queue_full"
    ITEM_TOO_LARGE = "item_too_large"
    JOURNAL_FULL = "journal_full"
    TOO_MANY_OPEN_READS = "too_many_open_reads"
    READ_OPEN = "read_open"  # an exclusive get while a read is open on the queue
    NOT_ENCODABLE = "not_encodable"  # an item this protocol cannot frame
    SHUTTING_DOWN = "shutting_down"
    BUSY = "busy"
    SERVER_ERROR = "server_error"
    #: a command before authentication; wrong credentials (both close the connection)
    UNAUTHENTICATED = "unauthenticated"
    AUTH_FAILED = "auth_failed"
    PERMISSION_DENIED = "permission_denied"  # the connection stays usable
    TOO_MANY_QUEUES = "too_many_queues"  # max_queues reached: no new queue or reader
    NOT_OPEN = "not_open"  # a touch or reject of a read the connection does not hold
    PRODUCER_GAP = "producer_gap"  # a producer's put skipped ahead of its next sequence


@dataclass(slots=True)
class Failure:
    kind: ErrorKind
    message: str


@dataclass(slots=True, init=False)
class Stored:
    count: int

    # (written out, as Put's is: one is made per put answered)
    def __init__(self, count: int) -> None:
        self.count = count


@dataclass(slots=True)
class ProducerStored:
    """A put with a producer id: stored (or a repeat, `duplicate`, storing nothing) as
    items first_id .. first_id + count - 1 (0, 0 for a repeat older than the last)."""

    count: int
    first_id: int
    duplicate: bool


@dataclass(slots=True, init=False)
class Items:
    items: Sequence[Item]

    # (written out: one is made per get answered)
    def __init__(self, items: Sequence[Item]) -> None:
        self.items = items


@dataclass(slots=True, init=False)
class Count:
    """How many items a confirm, abort, flush or flush_expired touched."""

    n: int

    # (written out: one is made per confirm answered)
    def __init__(self, n: int) -> None:
        self.n = n


@dataclass(slots=True)
class Deleted:
    existed: bool


@dataclass(slots=True)
class Value:
    """A structured answer: stats, the version string, a peek's head and statistics."""

    value: Any


@dataclass(slots=True)
class Done:
    """Nothing to report (reload, shutdown, quit, a monitor's end)."""


@dataclass(slots=True)
class Peeked:
    """A peek's answer: the head item (None when empty) and the reader's statistics."""

    item: Item | None
    info: dict[str, int]


Reply: TypeAlias = (Failure | Stored | ProducerStored | Items | Count | Deleted | Value | Done
                    | Peeked)

#: Exception types to error kinds, most specific first (BadNameError is also a ValueError).
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (BadNameError, ErrorKind.BAD_NAME),
    (QueueFullError, ErrorKind.QUEUE_FULL),
    (TooManyQueuesError, ErrorKind.TOO_MANY_QUEUES),
    (ItemTooLargeError, ErrorKind.ITEM_TOO_LARGE),
    (JournalFullError, ErrorKind.JOURNAL_FULL),
    (ReadStateError, ErrorKind.TOO_MANY_OPEN_READS),
    (NotOpenError, ErrorKind.NOT_OPEN),
    (QueueClosedError, ErrorKind.SHUTTING_DOWN),
    (ProducerGapError, ErrorKind.PRODUCER_GAP),
    (JournalClosedError, ErrorKind.SHUTTING_DOWN),
    (ValueError, ErrorKind.BAD_PARAMS),
    (JournalError, ErrorKind.SERVER_ERROR),
    (QueueError, ErrorKind.SERVER_ERROR),
    (OSError, ErrorKind.SERVER_ERROR),
)


def failure_of(exc: BaseException) -> Failure | None:
    """The Failure an exception from running a command stands for; None for an
    unexpected exception (a bug: the session logs it with its traceback)."""
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            if isinstance(exc, OSError):
                return Failure(kind, exc.strerror or str(exc))
            return Failure(kind, str(exc))
    return None


# -- a protocol as the session sees it -------------------------------------------------------


@dataclass(slots=True)
class Limits:
    """The caps a connection's parser is made with (from the server's config)."""

    max_line: int
    max_item_size: int
    max_frame: int
    max_batch: int


@dataclass(slots=True, init=False)
class Request:
    """One command as parsed: what to run, the wire context its replies need (a memcache
    event with its key and noreply, an RPC msgid), and its name for the metrics.

    `count` > 1: pipelined wire requests a codec joined into one command (memcache sets
    to one queue with one exptime and the same flags: a Put of `count` items; plain gets
    of one key: a Get of `count` items), each still answered on its own. A joined put that
    fails is retried one request at a time (`split`), so each gets its own answer.
    """

    command: Command
    context: Any
    name: str
    count: int = 1

    # (written out: one is made per request)
    def __init__(self, command: Command, context: Any, name: str, count: int = 1) -> None:
        self.command = command
        self.context = context
        self.name = name
        self.count = count

    def split(self) -> list[Request]:
        """A joined put as the single-item puts it stands for (else [self])."""
        cmd = self.command
        if self.count == 1 or type(cmd) is not Put:
            return [self]
        return [Request(Put(cmd.queue, (d,), cmd.ttl_ms, cmd.expire_at_ms, cmd.flags,
                            cmd.delay_ms),
                        self.context, self.name) for d in cmd.items]


#: What a codec's next_requests gives: requests, refusals (their reply is ready), the end.
Parsed: TypeAlias = "Request | RemoteProtocolError | ConnectionClosed"


def detached(e: RemoteProtocolError) -> RemoteProtocolError:
    """`e` without its traceback and the exception it was raised from, to be kept in a
    list of parsed requests: their frames hold that list (and the parser), and such a
    cycle kept every refused connection's buffers until a full garbage collection."""
    e.__context__ = e.__cause__ = None
    return e.with_traceback(None)


def next_requests(codec: Codec, limit: int) -> list[Parsed]:
    """Up to `limit` requests parsed from what `codec` has buffered, in order, with each
    RemoteProtocolError in its place (a closing one ends the list) and ConnectionClosed last
    if the stream ended: `Codec.next_requests` for a codec that joins nothing."""
    out: list[Parsed] = []
    next_request, append = codec.next_request, out.append
    while len(out) < limit:
        try:
            r = next_request()
        except RemoteProtocolError as e:
            append(detached(e))
            if e.close:
                break
            continue
        if type(r) is Request:  # the usual case first: one check
            append(r)
        elif r is NEED_DATA:
            break
        elif r is not None:
            append(r)
            if isinstance(r, ConnectionClosed):
                break
    return out


class Codec(Protocol):
    """One connection's protocol, as the session sees it (h11's shape): bytes in,
    requests out; replies in, bytes out. Pure; one per connection.

    `ordered`: replies go out in request order, so a get that waits holds up the ones
    behind it (memcache, text); otherwise replies are matched by id and a waiting get
    runs on while later requests are answered (RPC).
    """

    ordered: bool
    #: failures after which the connection closes (the reply is sent first)
    closing: frozenset[ErrorKind]
    #: the answer to a connection over max_connections, before it is closed
    too_many: bytes

    def receive_data(self, data: bytes | bytearray) -> None: ...

    def next_request(self) -> Request | ConnectionClosed | NeedData | None:
        """The next request, the end of the stream, NEED_DATA, or None for an event
        that needs nothing (ignored); raises RemoteProtocolError (its reply, maybe close)."""

    def next_requests(self, limit: int) -> list[Parsed]:
        """Every complete request buffered, up to `limit` (see the function
        `next_requests`); a codec may join pipelined requests (`Request.count`)."""

    def encode(self, request: Request, reply: Reply) -> bytes: ...

    def encode_item(self, request: Request, item: Item) -> bytes:
        """One item of a monitor, sent as it arrives."""

    def buffered_bytes(self) -> int: ...

    def pending(self) -> bool:
        """A request has begun to arrive and is not complete (request_timeout runs)."""

    def auth_of(self, request: Request) -> Auth | None:
        """The credentials `request` carries when it is the protocol's way to
        authenticate (see `auth_of`), else None."""

    def set_limits(self, limits: Limits) -> None:
        """Parse what follows with these caps (smaller ones before authentication)."""

    def set_logins(self, known: Callable[[str], bool]) -> None:
        """The server has users (`known`: whether a name is one): a protocol whose login
        looks like another request (memcache's login set) tells them apart with it."""


def auth_of(request: Request) -> Auth | None:
    """`Codec.auth_of` of a protocol with an auth command of its own."""
    command = request.command
    return command if type(command) is Auth else None


class LineCodec:
    """What the memcache and text codecs share: a line parser whose events become
    commands through a table. Subclasses set `parser` and `commands`."""

    parser: Any
    commands: Mapping[type, Callable[[Any], Command]]

    def receive_data(self, data: bytes | bytearray) -> None:
        self.parser.receive_data(data)

    def buffered_bytes(self) -> int:
        return int(self.parser.statistics().buffered_bytes)

    def pending(self) -> bool:
        return bool(self.parser.in_request())

    def next_request(self) -> Request | ConnectionClosed | NeedData | None:
        ev = self.parser.next_event()
        if ev is NEED_DATA or isinstance(ev, ConnectionClosed):
            return ev
        return Request(self.commands[type(ev)](ev), ev, command_name(ev))

    def next_requests(self, limit: int) -> list[Parsed]:
        return next_requests(self, limit)  # type: ignore[arg-type]  # (a Codec's base)

    def auth_of(self, request: Request) -> Auth | None:
        return auth_of(request)

    def set_limits(self, limits: Limits) -> None:
        self.parser.max_line = limits.max_line
        self.parser.max_item_size = limits.max_item_size

    def set_logins(self, known: Callable[[str], bool]) -> None:
        pass  # (a login of its own: the text protocol's AUTH)
