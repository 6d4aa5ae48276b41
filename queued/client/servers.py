"""Which servers a client has and in which order it tries them: addresses, DNS names, back-off.

Pure: no sockets, no clock (callers pass the time and what DNS answered), so both clients
make the same choices; the look-ups themselves are discovery.py's. Import the public
names from queued.client.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from queued.client.common import (
    DEFAULT_PORT,
    ConnectionFailed,
    Servers,
    ServerSpec,
    ServerStatistics,
)

#: How often a `dns://` name is resolved again unless its address says `?refresh=`.
DEFAULT_REFRESH: Final = 30.0
_DNS_SCHEMES: Final = ("dns://", "dns+srv://")
#: How long a call that starts a look-up of a name that already gave servers waits for
#: its answer before it goes on with those servers (the answer then serves later calls).
LOOKUP_PATIENCE: Final = 0.25


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
    srv = text.lower().startswith("dns+srv://")
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
    failed_at: float = float("-inf")  # when the failure that set `delay` was recorded
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

    def failed(self, server: ServerState, now: float, started: float | None = None) -> None:
        """A call to `server` that began at `started` failed (None: a new incident).

        The back-off doubles per incident, not per failed call: a call that began before
        the failure that set the current back-off (pipelined calls that all chose the
        server, then all failed) is counted but keeps the back-off as it is.
        """
        server.failures += 1
        if server.delay and started is not None and started <= server.failed_at:
            server.down_until = max(server.down_until, now + server.delay)
            return
        server.delay = min(server.delay * 2, self.max_backoff) if server.delay else self.backoff
        server.down_until = now + server.delay
        server.failed_at = now
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
        once idle). An empty answer (no such name, no records: no pod ready yet) takes the
        name's servers away but, like a failed look-up, is asked again after `backoff`."""
        self._why.pop(name.spec, None)
        addresses: dict[str, tuple[str, int, str]] = {}
        for host, port, tls_name in found:
            addresses.setdefault(_address(host, port), (host, port, tls_name))
        self._resolved_at[name.spec] = now
        self._due[name.spec] = now + (name.refresh if addresses
                                      else min(self.backoff, name.refresh))
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
