"""What queued's two clients share: errors, values, reply shapes (servers.py: addresses, back-off).

Pure: no sockets, no trio, no clock (callers pass the time), so `Client` and `AsyncClient`
make the same decisions. Import the public names from queued.client; the rest here is
internal to the clients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from queued.errors import QueuedError
from queued.sansio import MAX_DELAY_MS, HeaderValue, header_entries
from queued.wire.rpc_protocol import MAX_FLAGS, ErrorCode

DEFAULT_PORT: Final = 2229

ServerSpec: TypeAlias = str | tuple[str, int]
Servers: TypeAlias = ServerSpec | Sequence[ServerSpec]
Data: TypeAlias = bytes | bytearray | memoryview | str
#: An item's headers as a put takes them: string keys, bytes or string values.
Headers: TypeAlias = Mapping[str, bytes | bytearray | memoryview | str]
#: What a call runs on its params just before they are sent (Connection.call's `prepare`).
Prepare: TypeAlias = Callable[[list[Any]], None]


# -- errors -------------------------------------------------------------------------------------


class ClientError(QueuedError):
    """Base of every error the client raises."""


class ClientClosed(ClientError):
    """The client was closed (you closed it), or an AsyncClient is used outside `async with`."""


class ConnectionFailed(ClientError):
    """Cannot connect (refused, timed out), or the connection broke or closed mid-call.
    `refused`: the server turned the connection itself down (a TLS alert that it wants a
    client certificate), so no call on it was run."""

    def __init__(self, message: str, server: str | None = None, *,
                 refused: bool = False) -> None:
        super().__init__(message)
        self.server = server
        self.refused = refused


class Timeout(ClientError):
    """No reply within the read timeout; the connection was closed, its open reads returned."""

    def __init__(self, message: str, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server


class BadResponse(ClientError):
    """The server sent bytes that are not the protocol's replies (the connection is closed)."""


class RpcCallError(ClientError):
    """The server answered a call with an error `[code, message]`."""

    def __init__(self, code: ErrorCode | int, message: str, server: str | None = None) -> None:
        name = code.name if isinstance(code, ErrorCode) else f"error {code}"
        super().__init__(f"{name}: {message}" + (f" ({server})" if server else ""))
        self.code = code
        self.message = message
        self.server = server


class Malformed(RpcCallError):
    """The server could not parse our request (the server closes the connection)."""


class UnknownMethod(RpcCallError):
    pass


class BadParams(RpcCallError):
    pass


class BadQueueName(RpcCallError):
    pass


class QueueFull(RpcCallError):
    pass


class ItemTooLarge(RpcCallError):
    pass


class TooLarge(RpcCallError):
    """A frame or batch over the server's cap (the server closes the connection)."""


class TooManyOpenReads(RpcCallError):
    pass


class JournalFull(RpcCallError):
    pass


class ShuttingDown(RpcCallError):
    """The server is stopping (or the queue was deleted during the call)."""


class ServerError(RpcCallError):
    pass


class Busy(RpcCallError):
    """Too many connections to the server, or too many gets waiting on one connection."""


class Unauthenticated(RpcCallError):
    """A call before logging in, on a server with users (give user= and password=)."""


class AuthFailed(RpcCallError):
    """Wrong user or password (the server closes the connection)."""


class PermissionDenied(RpcCallError):
    """The user lacks the permission the call needs on that queue."""


class TooManyQueues(RpcCallError):
    """The server's max_queues is reached: the call would have created a queue."""


class NotOpen(RpcCallError):
    """An extend or reject named a read that is not open on its connection (confirmed,
    aborted, timed out, or never this connection's)."""
class ProducerGap(RpcCallError):
    """An idempotent put skipped ahead of its producer's next sequence: nothing stored
    (the client starts a new producer and sends it again by itself)."""


class AmbiguousPut(ClientError):
    """An idempotent put sent to `server` got no reply, and none came to its re-sends
    within delivery_timeout: it may or may not be stored (at most once, never twice)."""

    def __init__(self, message: str, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server


ERRORS: Final[Mapping[ErrorCode, type[RpcCallError]]] = {
    ErrorCode.MALFORMED: Malformed,
    ErrorCode.UNKNOWN_METHOD: UnknownMethod,
    ErrorCode.BAD_PARAMS: BadParams,
    ErrorCode.BAD_QUEUE_NAME: BadQueueName,
    ErrorCode.QUEUE_FULL: QueueFull,
    ErrorCode.ITEM_TOO_LARGE: ItemTooLarge,
    ErrorCode.TOO_LARGE: TooLarge,
    ErrorCode.TOO_MANY_OPEN_READS: TooManyOpenReads,
    ErrorCode.JOURNAL_FULL: JournalFull,
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.SERVER_ERROR: ServerError,
    ErrorCode.BUSY: Busy,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
    ErrorCode.AUTH_FAILED: AuthFailed,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.TOO_MANY_QUEUES: TooManyQueues,
    ErrorCode.NOT_OPEN: NotOpen,
    ErrorCode.PRODUCER_GAP: ProducerGap,
}
#: Errors after which the call is tried on another server (the server is skipped a while).
FAILOVER: Final = (ConnectionFailed, Timeout, ShuttingDown, Busy)
#: Replies after which the server closes the connection.
CLOSING: Final = frozenset({ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.UNAUTHENTICATED,
                            ErrorCode.AUTH_FAILED})


def call_error(error: Any, server: str) -> RpcCallError:
    if (isinstance(error, list) and len(error) == 2 and type(error[0]) is int
            and isinstance(error[1], str)):
        code, message = error
        try:
            known = ErrorCode(code)
        except ValueError:
            return RpcCallError(code, message, server)
        return ERRORS.get(known, RpcCallError)(known, message, server)
    return RpcCallError(ErrorCode.SERVER_ERROR, f"unreadable error {error!r}", server)


# -- values -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Item:
    """One item from a get. Confirm or abort it through the client that got it."""

    id: int
    data: bytes
    queue: str  #: the queue (or "queue+reader") it was read from
    server: str  #: "host:port" of the server it came from
    #: Client-local serial of the connection holding its open read; 0 for a plain get.
    connection: int = 0
    #: Its memcache flags (u32): from a memcache `set`, or a put with flags. Only a get
    #: with `with_flags=True` (or `with_deliveries=True`) reads them; 0 otherwise.
    flags: int = 0
    #: How many times it has been delivered, this time included (its error count + 1),
    #: from a get with `with_deliveries=True`; from `browse`, the deliveries so far. 0
    #: when not asked for.
    deliveries: int = 0
    #: Its headers (string keys; bytes values, or strings where they were put as strings),
    #: {} for an item put without; from a get (reserve, consume, browse) with
    #: `with_headers=True`; None when not asked for.
    headers: Mapping[str, HeaderValue] | None = None
    #: The client that got it (what `extend` goes through).
    client: Any = field(default=None, repr=False, compare=False)

    def extend(self, ms: int) -> Any:
        """Extend this open read to `ms` from now: `client.extend(item, ms)` of the client
        that got it (a coroutine from an AsyncClient: await it)."""
        if self.client is None or not self.connection:
            raise ValueError("extend needs an open read (a get with auto_abort_ms > 0)")
        return self.client.extend(self, ms)


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """peek(): one queue's numbers, summed over every server."""

    queue: str
    head: Item | None  #: the next item of the first server (in the client's order) with one
    items: int
    bytes: int
    open_transactions: int
    waiters: int
    #: Every integer field the servers sent: counts summed, ages the oldest, times the earliest.
    stats: Mapping[str, int]
    servers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    server: str
    connected: bool
    failures: int  #: connection failures, timeouts and SHUTTING_DOWN replies so far
    skips: int  #: calls that passed this server over because it was backing off
    backoff: float  #: seconds of back-off left; 0 = available


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    calls: int  #: requests sent
    connects: int  #: connections opened
    retries: int  #: calls re-sent after a broken connection (each may duplicate a put)
    unconfirmed: int  #: items reserve/consume could not confirm (they will come again)
    servers: tuple[ServerStatistics, ...]


def all_failed(errors: Sequence[ClientError]) -> ClientError:
    if len(errors) == 1:
        return errors[0]
    exc = ConnectionFailed("no server answered: " + "; ".join(str(e) for e in errors))
    exc.__cause__ = errors[-1]
    return exc


# -- request and reply shapes (pure) -------------------------------------------------------------


def encode_items(items: Data | Iterable[Data]) -> list[bytes]:
    if isinstance(items, bytes | bytearray | memoryview | str):
        items = [items]
    out: list[bytes] = []
    for it in items:
        if isinstance(it, str):
            out.append(it.encode())
        elif isinstance(it, bytes):
            out.append(it)
        elif isinstance(it, bytearray | memoryview):
            out.append(bytes(it))
        else:
            raise TypeError(f"an item must be bytes or str, not {type(it).__name__}")
    return out


def headers_param(headers: Headers | Sequence[Headers | None] | None, n: int) -> Any:
    """put's headers as sent: one map for every item, or a list of one map (or None) per
    item (of the `n`); None when no item has any. ValueError (nothing sent) when they
    break the rule: string keys, bytes or string values, at most 64 headers and 16 KiB
    of keys and values an item."""
    if headers is None:
        return None
    if isinstance(headers, Mapping):
        return _checked(headers)
    if isinstance(headers, str | bytes) or not isinstance(headers, Sequence):
        raise ValueError("headers must be a map (every item's), or a list of one map (or "
                         "None) per item")
    if len(headers) != n:
        raise ValueError(f"{len(headers)} headers maps for {n} items")
    out = [None if h is None else _checked(h) for h in headers]
    return out if any(out) else None


def _checked(headers: Any) -> dict[str, HeaderValue] | None:
    """One item's headers as sent (bytes-like values as bytes), once the rule passed."""
    header_entries(headers)
    return {k: v if type(v) is str or type(v) is bytes else bytes(v)
            for k, v in headers.items()} or None


class ProducerState:
    """This client's producer for one (server, queue): its id and next sequence. A new
    id (`renew`) whenever a sequence may have been lost: a put refused, or given up."""

    __slots__ = ("next", "producer")

    def __init__(self, producer: bytes) -> None:
        self.producer = producer
        self.next = 1

    def take(self) -> tuple[bytes, int]:
        seq = self.next
        self.next += 1
        return self.producer, seq

    def renew(self, used: tuple[bytes, int] | None, producer: bytes) -> None:
        """Start afresh as `producer`, unless that happened since `used` was taken."""
        if used is None or used[0] == self.producer:
            self.producer, self.next = producer, 1


def producer_result(result: Any, count: int) -> int:
    """An idempotent put's [count, first_id, duplicate]: how many items are stored (a
    repeat of an older put is answered [0, 0, true]: its `count` items)."""
    if (not isinstance(result, list) or len(result) != 3 or type(result[0]) is not int
            or type(result[2]) is not bool):
        raise BadResponse(f"put answered {result!r}, not [count, first_id, duplicate]")
    return count if result[2] and not result[0] else result[0]


@dataclass(frozen=True, slots=True)
class PutAnswer:
    """A put's answer under a producer id the caller chose (`put_sequenced`): how many items
    it stored, the id of the first, and whether it was a repeat (then nothing was stored
    now: `count` and `first_id` are the first time's, or 0 and 0 for a repeat of an older
    put than the producer's last)."""

    count: int
    first_id: int
    duplicate: bool


def sequenced_result(result: Any) -> PutAnswer:
    if (not isinstance(result, list) or len(result) != 3 or type(result[0]) is not int
            or type(result[1]) is not int or type(result[2]) is not bool):
        raise BadResponse(f"put answered {result!r}, not [count, first_id, duplicate]")
    return PutAnswer(result[0], result[1], result[2])


def int_result(result: Any, method: str) -> int:
    if type(result) is not int:
        raise BadResponse(f"{method} answered {result!r}, not an integer")
    return result


class _NewItem:
    """An `Item` under construction: the same slots, in the same order, as plain ones.

    A frozen dataclass's `__init__` sets each field through `object.__setattr__` (about
    1 us for Item's nine), and a get builds one per item: most of a client's CPU for a
    batch of small ones. `_item` sets the twin's slots, then gives it Item's class (the
    layouts are the same, so Python allows it): the same object a call of `Item` makes,
    at a third of the cost. tests/test_client_common.py checks the two agree."""

    __slots__ = Item.__slots__

    def __init__(self, id: int, data: bytes, queue: str, server: str, connection: int,
                 flags: int, deliveries: int, headers: Any, client: Any) -> None:
        self.id = id
        self.data = data
        self.queue = queue
        self.server = server
        self.connection = connection
        self.flags = flags
        self.deliveries = deliveries
        self.headers = headers
        self.client = client


def _item(id: int, data: bytes, queue: str, server: str, connection: int, flags: int,
          deliveries: int, headers: Any, client: Any) -> Item:
    """`Item(...)` with every field given, built as `_NewItem` says."""
    new: Any = _NewItem(id, data, queue, server, connection, flags, deliveries, headers, client)
    new.__class__ = Item
    return new  # type: ignore[no-any-return]


def to_items(result: Any, queue: str, server: str, serial: int,
             client: Any = None) -> list[Item]:
    """A get's items: [id, data] each, [id, data, flags] when it asked for flags,
    [id, data, flags, deliveries] when it asked for delivery counts (and a browse's), and
    [id, data, flags, deliveries, headers] when it asked for headers."""
    if not isinstance(result, list):
        raise BadResponse(f"get answered {type(result).__name__}, not an array")
    out: list[Item] = []
    append = out.append
    for pair in result:
        if (type(pair) is list and len(pair) == 2 and type(pair[0]) is int
                and type(pair[1]) is bytes):  # (the usual form: [id, data])
            append(_item(pair[0], pair[1], queue, server, serial, 0, 0, None, client))
            continue
        if (not isinstance(pair, list) or not 2 <= len(pair) <= 5 or type(pair[0]) is not int
                or not isinstance(pair[1], bytes | str)
                or (len(pair) >= 3 and (type(pair[2]) is not int
                                        or not 0 <= pair[2] <= MAX_FLAGS))
                or (len(pair) >= 4 and (type(pair[3]) is not int or pair[3] < 0))
                or (len(pair) == 5 and not _headers_ok(pair[4]))):
            raise BadResponse(f"get answered an item {pair!r:.80}, not [id, data(, flags"
                              "(, deliveries(, headers)))]")
        data = pair[1].encode() if isinstance(pair[1], str) else pair[1]
        append(_item(pair[0], data, queue, server, serial, pair[2] if len(pair) >= 3 else 0,
                     pair[3] if len(pair) >= 4 else 0, pair[4] if len(pair) == 5 else None,
                     client))
    return out


def _headers_ok(headers: Any) -> bool:
    return isinstance(headers, dict) and all(
        type(k) is str and isinstance(v, bytes | str) for k, v in headers.items())


def check_delay(delay_ms: int) -> None:
    if type(delay_ms) is not int or not 0 <= delay_ms <= MAX_DELAY_MS:
        raise ValueError(f"delay_ms must be an integer in [0, {MAX_DELAY_MS}], not {delay_ms!r}")


def check_flags(flags: int) -> None:
    if type(flags) is not int or not 0 <= flags <= MAX_FLAGS:
        raise ValueError(f"flags must be an integer in [0, {MAX_FLAGS}], not {flags!r}")


def _sum(a: int, b: int) -> int:
    return a + b


#: How peek merges a field over servers: ages take the oldest, times the earliest, the rest add.
_PEEK_MERGE: Final[Mapping[str, Callable[[int, int], int]]] = {
    "age": max, "age_msec": max, "create_time": min,
}


def queue_info(queue: str, answers: list[tuple[str, Any]]) -> QueueInfo:
    head: Item | None = None
    totals: dict[str, int] = {}
    for server, result in answers:
        if not isinstance(result, dict):
            raise BadResponse(f"peek answered {type(result).__name__}, not a map")
        for key, value in result.items():
            if key == "head":
                if value is not None and head is None:
                    head = to_items([value], queue, server, 0)[0]
            elif type(value) is int:
                merge = _PEEK_MERGE.get(key, _sum)
                totals[key] = merge(totals[key], value) if key in totals else value
    return QueueInfo(queue, head, totals.get("items", 0), totals.get("bytes", 0),
                     totals.get("open_transactions", 0), totals.get("waiters", 0), totals,
                     tuple(s for s, _ in answers))


def check_timeouts(connect_timeout: float, read_timeout: float, poll_slice: float) -> None:
    if min(connect_timeout, read_timeout, poll_slice) <= 0:
        raise ValueError("connect_timeout, read_timeout and poll_slice must be > 0 seconds")


def check_get(max_items: int, timeout_ms: int, auto_abort_ms: int) -> None:
    if max_items < 1 or timeout_ms < 0 or auto_abort_ms < 0:
        raise ValueError("want max_items >= 1, timeout_ms >= 0 and auto_abort_ms >= 0")


def settle_groups(items: Item | Iterable[Item]) -> dict[tuple[str, str, int], list[int]]:
    """The ids of `items` by (server, queue, connection), each group in the items' order.
    (A run of items of one group, a get's batch, looks its group up once.)"""
    groups: dict[tuple[str, str, int], list[int]] = {}
    server = queue = ""
    connection = -1
    ids: list[int] = []
    for it in [items] if isinstance(items, Item) else items:
        if it.connection != connection or it.queue != queue or it.server != server:
            server, queue, connection = it.server, it.queue, it.connection
            ids = groups.setdefault((server, queue, connection), [])
        ids.append(it.id)
    return groups
