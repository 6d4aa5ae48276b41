"""What queued's two clients share: errors, values, server addresses, back-off, reply shapes.

Pure: no sockets, no trio, no clock (callers pass the time), so `Client` and `AsyncClient`
make the same decisions. Import the public names from queued.client; the rest here is
internal to the clients.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from queued.core.errors import QueuedError
from queued.core.rpc_protocol import MAX_FLAGS, ErrorCode
from queued.core.wire import MAX_DELAY_MS

DEFAULT_PORT: Final = 2229

ServerSpec: TypeAlias = str | tuple[str, int]
Servers: TypeAlias = ServerSpec | Sequence[ServerSpec]
Data: TypeAlias = bytes | bytearray | memoryview | str


# -- errors -------------------------------------------------------------------------------------


class ClientError(QueuedError):
    """Base of every error the client raises."""


class ClientClosed(ClientError):
    """The client was closed (you closed it), or an AsyncClient is used outside `async with`."""


class ConnectionFailed(ClientError):
    """Cannot connect (refused, timed out), or the connection broke or closed mid-call."""

    def __init__(self, message: str, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server


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
    #: with `with_flags=True` reads them; 0 otherwise.
    flags: int = 0


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


# -- servers, discovery and back-off (pure: the caller passes the time and the answers) ----------

#: How often a `dns://` name is resolved again unless its address says `?refresh=`.
DEFAULT_REFRESH: Final = 30.0
_DNS_SCHEMES: Final = ("dns://", "dns+srv://")


@dataclass(frozen=True, slots=True)
class Discovery:
    """A server address that names a DNS name: every address it resolves to is a server.

    `dns://NAME:PORT` (A and AAAA records, as a Kubernetes headless Service answers; port
    2229 if left out) or `dns+srv://_service._proto.NAME` (SRV records: their targets and
    ports). Query options: `refresh=SECONDS` (default 30), `nameserver=HOST[:PORT]`
    (repeatable; default: the system's resolver).
    """

    spec: str  #: the address normalized (what `servers` and parse_servers show)
    name: str
    port: int  #: 0 for SRV, whose records carry the ports
    srv: bool
    nameservers: tuple[tuple[str, int], ...]
    refresh: float


def _discovery(text: str) -> Discovery:
    srv = text.startswith("dns+srv://")
    rest = text.split("://", 1)[1]
    where, _, query = rest.partition("?")
    refresh = DEFAULT_REFRESH
    nameservers: list[tuple[str, int]] = []
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        if key == "refresh":
            try:
                refresh = float(value)
            except ValueError:
                refresh = -1.0
            if not 0 < refresh < 86_400 * 365:
                raise ValueError(f"bad refresh in {text!r} (want seconds > 0)")
        elif key == "nameserver":
            nameservers.append(_one_server(value, default_port=53))
        else:
            raise ValueError(f"unknown option {key!r} in {text!r} (refresh, nameserver)")
    if srv:
        name, port = where, 0
        if not name or ":" in name or "/" in name:
            raise ValueError(f"bad SRV name in {text!r} (want dns+srv://_service._proto.NAME)")
    else:
        name, port = _one_server(where.rstrip("/"))
    spec = f"{'dns+srv' if srv else 'dns'}://{name}" + (f":{port}" if port else "")
    options = ([f"refresh={refresh:g}"] if refresh != DEFAULT_REFRESH else []) + [
        f"nameserver={h}:{p}" if ":" not in h else f"nameserver=[{h}]:{p}"
        for h, p in nameservers]
    if options:
        spec += "?" + "&".join(options)
    return Discovery(spec, name, port, srv, tuple(nameservers), refresh)


def _one_server(spec: ServerSpec, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    if isinstance(spec, tuple):
        host, port = spec
    else:
        text = spec.strip()
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            if rest and not rest.startswith(":"):
                raise ValueError(f"bad server address {spec!r}")
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
        else:  # a bare host name, or an IPv6 address without a port
            host, port_text = text, ""
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"bad port in server address {spec!r}") from None
    if not host or type(port) is not int or not 0 < port < 65536 or "/" in host:
        raise ValueError(f"bad server address {spec!r} (want host:port)")
    return host, port


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_specs(servers: Servers) -> tuple[list[tuple[str, str, int]], list[Discovery]]:
    """The fixed servers ("address", host, port) and the DNS names, duplicates dropped."""
    if isinstance(servers, str):
        specs: list[ServerSpec] = [s for s in servers.split(",") if s.strip()]
    elif isinstance(servers, tuple) and len(servers) == 2 and isinstance(servers[1], int):
        specs = [(str(servers[0]), servers[1])]
    else:
        specs = []
        for spec in servers:
            if isinstance(spec, str):
                specs.extend(s for s in spec.split(",") if s.strip())
            else:
                specs.append(spec)
    fixed: dict[str, tuple[str, str, int]] = {}
    names: dict[str, Discovery] = {}
    for spec in specs:
        if isinstance(spec, str) and spec.strip().lower().startswith(_DNS_SCHEMES):
            found = _discovery(spec.strip())
            names.setdefault(found.spec, found)
            continue
        host, port = _one_server(spec)
        address = _address(host, port)
        fixed.setdefault(address, (address, host, port))
    if not fixed and not names:
        raise ValueError("no server given")
    return list(fixed.values()), list(names.values())


def parse_servers(servers: Servers) -> list[tuple[str, str, int]]:
    """("address", host, port) per server, duplicates dropped, in the given order.

    Takes "host:port", "host" (port 2229), "[::1]:2229", (host, port), a comma-separated
    string or a sequence of any of those; a `dns://NAME:PORT` or `dns+srv://...` address
    (see Discovery) comes back as (its normalized address, NAME, PORT), unresolved.
    """
    fixed, names = parse_specs(servers)
    return fixed + [(d.spec, d.name, d.port) for d in names]


@dataclass(slots=True)
class ServerState:
    address: str
    host: str
    port: int
    delay: float = 0.0  # the current back-off; 0 = healthy
    down_until: float = 0.0
    failures: int = 0
    skips: int = 0
    #: The name a TLS certificate must carry: the DNS name a discovered server came from.
    tls_name: str = ""


class Pool:
    """Which servers to try, in which order, and how long a failed one is skipped.

    Each pool takes its servers in its own random order (`rng`), so short-lived clients
    spread their first calls the way one long-lived client spreads all of its calls.
    Servers from DNS names join at random places when they appear and leave when the
    name no longer gives them; the client closes a leaving server's connection.
    """

    def __init__(self, servers: Servers, backoff: float, max_backoff: float,
                 rng: random.Random | None = None) -> None:
        if backoff <= 0 or max_backoff < backoff:
            raise ValueError("want 0 < backoff <= max_backoff")
        fixed, self.names = parse_specs(servers)
        self._rng = rng or random.Random()
        self.servers = [ServerState(a, h, p) for a, h, p in fixed]
        self._rng.shuffle(self.servers)
        self.fixed = frozenset(a for a, _, _ in fixed)
        self.by_address = {s.address: s for s in self.servers}
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._next = {"put": 0, "get": 0}
        self._found: dict[str, frozenset[str]] = {d.spec: frozenset() for d in self.names}
        self._due = {d.spec: 0.0 for d in self.names}  # when to resolve each name again
        self._resolved_at = {d.spec: -backoff for d in self.names}
        self._why: dict[str, str] = {}  # each name's last resolution failure

    def order(self, kind: str, now: float) -> list[ServerState]:
        """The servers from this kind's round-robin cursor on, skipping those backing off.

        When every server is backing off they are all tried anyway: failing without
        asking anyone helps no one, and a single server is then simply always tried.
        With no server at all (DNS names that gave none) it raises ConnectionFailed.
        """
        n = len(self.require())
        start = self._next[kind] % n
        self._next[kind] = (start + 1) % n
        rotated = self.servers[start:] + self.servers[:start]
        up = [s for s in rotated if s.down_until <= now]
        if not up:
            return rotated
        for s in rotated:
            if s.down_until > now:
                s.skips += 1
        return up

    def require(self) -> list[ServerState]:
        """The servers; ConnectionFailed saying why when there are none (DNS names that
        gave no address, or could not be resolved)."""
        if not self.servers:
            why = "; ".join(self._why.get(d.spec, f"{d.spec} resolved to no address")
                            for d in self.names)
            raise ConnectionFailed(f"no server: {why}")
        return self.servers

    def failed(self, server: ServerState, now: float) -> None:
        server.failures += 1
        server.delay = min(server.delay * 2, self.max_backoff) if server.delay else self.backoff
        server.down_until = now + server.delay
        if server.address not in self.fixed:  # re-resolve soon: it may have moved
            for spec, at in self._resolved_at.items():
                if server.address in self._found[spec]:
                    self._due[spec] = min(self._due[spec], at + self.backoff)

    def ok(self, server: ServerState) -> None:
        server.delay = 0.0
        server.down_until = 0.0

    # -- discovery

    def due(self, now: float) -> list[Discovery]:
        """The DNS names to resolve now."""
        return [d for d in self.names if self._due[d.spec] <= now]

    def resolved(self, name: Discovery, found: Iterable[tuple[str, int, str]],
                 now: float) -> list[str]:
        """What resolving `name` gave, (host, port, name its certificate must carry) each;
        returns the addresses that left the rotation (the client closes their connections
        once idle)."""
        self._resolved_at[name.spec] = now
        self._due[name.spec] = now + name.refresh
        self._why.pop(name.spec, None)
        addresses: dict[str, tuple[str, int, str]] = {}
        for host, port, tls_name in found:
            addresses.setdefault(_address(host, port), (host, port, tls_name))
        self._found[name.spec] = frozenset(addresses)
        for address, (host, port, tls_name) in addresses.items():
            if address not in self.by_address:
                state = ServerState(address, host, port, tls_name=tls_name)
                self.servers.insert(self._rng.randrange(len(self.servers) + 1), state)
                self.by_address[address] = state
        wanted = self.fixed.union(*self._found.values())
        gone = [s.address for s in self.servers if s.address not in wanted]
        if gone:
            self.servers = [s for s in self.servers if s.address in wanted]
            for address in gone:
                del self.by_address[address]
        return gone

    def resolve_failed(self, name: Discovery, why: str, now: float) -> None:
        """Resolving failed (no answer, timeout): keep what it gave last, try again soon."""
        self._why[name.spec] = why
        self._resolved_at[name.spec] = now
        self._due[name.spec] = now + min(self.backoff, name.refresh)

    def statistics(self, connected: Callable[[str], bool], now: float) -> list[ServerStatistics]:
        return [ServerStatistics(s.address, connected(s.address), s.failures, s.skips,
                                 max(0.0, s.down_until - now)) for s in self.servers]


def lookup(pool: Pool, server: str) -> ServerState:
    try:
        return pool.by_address[parse_servers(server)[0][0]]
    except KeyError:
        raise ValueError(f"{server!r} is not one of this client's servers") from None


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


def int_result(result: Any, method: str) -> int:
    if type(result) is not int:
        raise BadResponse(f"{method} answered {result!r}, not an integer")
    return result


def to_items(result: Any, queue: str, server: str, serial: int) -> list[Item]:
    """A get's items: [id, data] each, or [id, data, flags] when it asked for flags."""
    if not isinstance(result, list):
        raise BadResponse(f"get answered {type(result).__name__}, not an array")
    out = []
    for pair in result:
        if (not isinstance(pair, list) or not 2 <= len(pair) <= 3 or type(pair[0]) is not int
                or not isinstance(pair[1], bytes | str)
                or (len(pair) == 3 and (type(pair[2]) is not int
                                        or not 0 <= pair[2] <= MAX_FLAGS))):
            raise BadResponse(f"get answered an item {pair!r:.80}, not [id, data(, flags)]")
        data = pair[1].encode() if isinstance(pair[1], str) else pair[1]
        out.append(Item(pair[0], data, queue, server, serial, pair[2] if len(pair) == 3 else 0))
    return out


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
    groups: dict[tuple[str, str, int], list[int]] = {}
    for it in [items] if isinstance(items, Item) else items:
        groups.setdefault((it.server, it.queue, it.connection), []).append(it.id)
    return groups
