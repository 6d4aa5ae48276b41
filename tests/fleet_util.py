"""Helpers for the fleet tests: a real DNS server on loopback, and free ports on several
loopback addresses (127.0.0.11, .12, .13: Linux routes all of 127/8 without set-up).

The DNS server answers real UDP queries (dnspython's message API) from tables the test
changes while it runs, as a Kubernetes headless Service's answers change when pods come
and go. It runs in a thread and stops when its `with` ends.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

FLEET_HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


class FakeDns:
    """A DNS server on 127.0.0.1:<port> (UDP). `a` maps a name to its IPv4 addresses,
    `srv` a name to its (port, target) records; replace either whole to change answers.
    A name in neither answers NXDOMAIN."""

    def __init__(self) -> None:
        self.a: Mapping[str, Sequence[str]] = {}
        self.srv: Mapping[str, Sequence[tuple[int, str]]] = {}
        self.queries = 0
        self.silent = False  # when True it answers nothing (a dead nameserver)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.queries += 1
            if self.silent:
                continue
            self._sock.sendto(self._answer(dns.message.from_wire(data)).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        a, srv = self.a, self.srv
        if name not in a and name not in srv:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and a.get(name):
            reply.answer.append(dns.rrset.from_text(question.name, 1, dns.rdataclass.IN,
                                                    dns.rdatatype.A, *a[name]))
        elif question.rdtype == dns.rdatatype.SRV and srv.get(name):
            reply.answer.append(dns.rrset.from_text(
                question.name, 1, dns.rdataclass.IN, dns.rdatatype.SRV,
                *(f"0 0 {port} {target}." for port, target in srv[name])))
        return reply  # (no AAAA records: an empty answer)

    def __enter__(self) -> FakeDns:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def common_free_port(hosts: Sequence[str] = FLEET_HOSTS) -> int:
    """A port free on every one of `hosts` (a dns:// name carries one port for all)."""
    for _ in range(50):
        with ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in hosts]
            socks[0].bind((hosts[0], 0))
            port = int(socks[0].getsockname()[1])
            try:
                for sock, host in zip(socks[1:], hosts[1:], strict=True):
                    sock.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on all of " + ", ".join(hosts))


@contextmanager
def fake_dns() -> Iterator[FakeDns]:
    with FakeDns() as server:
        yield server
