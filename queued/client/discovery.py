"""Resolving a `dns://` or `dns+srv://` server address (core.Discovery): blocking DNS look-ups.

Owns the look-ups only: which addresses a name gives now. The pool (core.Pool) decides what
to do with them and when to ask again; io_sync calls `resolve` directly, io_trio in a
worker thread. A/AAAA with no nameserver given go through getaddrinfo (which honours
/etc/hosts and cluster DNS); SRV records, and any name with `nameserver=`, through dnspython.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from queued.client.common import ConnectionFailed
from queued.client.servers import Discovery

if TYPE_CHECKING:  # imported when used: plain dns:// (and every CLI run) needs none of it
    import dns.resolver

#: Each answer's (host, port, name a TLS certificate must carry).
Found = list[tuple[str, int, str]]


def resolve(name: Discovery, timeout: float) -> Found:
    """Every address `name` gives now; [] when the name does not exist or has no records.

    Raises ConnectionFailed when no answer came (timeout, unreachable nameserver, a
    server failure): the caller keeps the addresses it had.
    """
    try:
        if name.srv or name.nameservers:
            return _with_dnspython(name, timeout)
        return _getaddrinfo(name.name, name.port)
    except OSError as exc:
        raise ConnectionFailed(f"{name.spec}: cannot resolve: {exc}", name.spec) from exc


def resolve_soon(name: Discovery, timeout: float) -> Future[Found]:
    """`resolve` in a daemon thread of its own, started now: the future gets its answer
    or its exception. The thread ends with the look-up (bounded by `timeout` through
    dnspython, by the system resolver's own timeout through getaddrinfo); nobody has to
    wait for it, so a DNS outage stalls no call that has servers to go on with."""
    future: Future[Found] = Future()

    def run() -> None:
        try:
            future.set_result(resolve(name, timeout))
        except BaseException as exc:  # handed to whoever takes the answer
            future.set_exception(exc)

    threading.Thread(target=run, name=f"queued-resolve {name.spec}", daemon=True).start()
    return future


def _getaddrinfo(host: str, port: int) -> Found:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []  # no such name, or no address: no servers now
        raise
    found: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            found.setdefault(str(sockaddr[0]))
    return [(address, port, host) for address in found]


def _with_dnspython(name: Discovery, timeout: float) -> Found:
    import dns.exception
    import dns.nameserver
    import dns.rdatatype
    import dns.resolver

    resolver = dns.resolver.Resolver(configure=not name.nameservers)
    if name.nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port)
                                for host, port in name.nameservers]
    resolver.lifetime = timeout
    resolver.cache = None
    try:
        if not name.srv:
            return [(host, name.port, name.name) for host in _a_aaaa(resolver, name.name)]
        found: Found = []
        for record in _records(resolver, name.name, dns.rdatatype.SRV):
            target = str(record.target).rstrip(".")
            if not target:  # "." : the service is decidedly not available
                continue
            hosts = (_a_aaaa(resolver, target) if name.nameservers
                     else [h for h, _, _ in _getaddrinfo(target, record.port)])
            found.extend((host, int(record.port), target) for host in hosts)
        return found
    except dns.exception.DNSException as exc:
        raise ConnectionFailed(f"{name.spec}: cannot resolve: {exc or type(exc).__name__}",
                               name.spec) from exc


def _a_aaaa(resolver: dns.resolver.Resolver, host: str) -> list[str]:
    import dns.rdatatype

    found: list[str] = []
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        found.extend(str(r.address) for r in _records(resolver, host, rdtype))
    return found


def _records(resolver: dns.resolver.Resolver, qname: str, rdtype: Any) -> list[Any]:
    import dns.resolver

    try:
        return list(resolver.resolve(qname, rdtype, search=False, raise_on_no_answer=False))
    except dns.resolver.NXDOMAIN:
        return []
