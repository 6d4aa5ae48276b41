"""Which servers a client tries and in which order (queued.client.servers), pure: address
parsing, the pool's rotation per operation, back-off doubling and its cap, one incident
backing a server off once, and DNS names asked again when an answer is empty.

The same pool under real servers and a real DNS server: test_fleet.py.
"""

from __future__ import annotations

import random

import pytest

from queued.client import (
    ConnectionFailed,
    parse_servers,
)
from queued.client.servers import Pool


def test_parse_servers() -> None:
    assert parse_servers("h:1") == [("h:1", "h", 1)]
    assert parse_servers("h") == [("h:2229", "h", 2229)]
    assert parse_servers(("h", 7)) == [("h:7", "h", 7)]
    assert parse_servers(["a:1,b:2", ("c", 3), " a:1 "]) == [
        ("a:1", "a", 1), ("b:2", "b", 2), ("c:3", "c", 3)]
    assert parse_servers("[::1]:5") == [("[::1]:5", "::1", 5)]
    assert parse_servers("[::1]") == [("[::1]:2229", "::1", 2229)]
    for bad in ("h:x", "h:0", "h:70000", "", ":5", "[::1]x", []):
        with pytest.raises(ValueError):
            parse_servers(bad)


def test_pool_rotation_and_backoff() -> None:
    pool = Pool(["a:1", "b:1", "c:1"], backoff=1.0, max_backoff=4.0, rng=random.Random(7))
    a, b, c = pool.servers  # in the pool's own random order
    assert {a.address, b.address, c.address} == {"a:1", "b:1", "c:1"}
    assert pool.order("put", 0) == [a, b, c]
    assert pool.order("put", 0) == [b, c, a]
    assert pool.order("get", 0) == [a, b, c]  # own cursor
    delays = []
    for _ in range(4):
        pool.failed(b, 10.0)
        delays.append(b.down_until - 10.0)
    assert delays == [1.0, 2.0, 4.0, 4.0]  # doubling, capped
    assert pool.order("put", 11.0) == [c, a]
    assert b.skips == 1
    assert pool.order("put", 14.0) == [a, b, c]  # over
    pool.failed(a, 20.0)
    pool.failed(c, 20.0)
    pool.failed(b, 20.0)
    # Everyone backing off: all are tried anyway rather than failing without asking.
    assert {s.address for s in pool.order("put", 20.5)} == {"a:1", "b:1", "c:1"}
    pool.ok(b)
    assert b.down_until == 0 and b.delay == 0
    pool.failed(b, 30.0)
    assert b.down_until == 31.0  # back to the first delay after a success


# -- back-off per incident, DNS answers, schemes -----------------------------------------------


def test_a_failure_from_the_same_incident_keeps_the_backoff() -> None:
    """Pure: calls that began before the failure that set the back-off count, but do not
    double it; a call that began after it does."""
    pool = Pool("a:1", backoff=1.0, max_backoff=30.0)
    server = pool.servers[0]
    pool.failed(server, 10.0, started=9.0)
    assert (server.delay, server.down_until) == (1.0, 11.0)
    for n in range(9):  # nine pipelined calls that began with the first
        pool.failed(server, 10.0 + n / 100, started=9.0)
    assert server.failures == 10 and server.delay == 1.0
    assert server.down_until == pytest.approx(11.08)
    pool.failed(server, 12.0, started=11.5)  # a new incident
    assert (server.delay, server.down_until) == (2.0, 14.0)
    pool.ok(server)
    assert (server.delay, server.down_until) == (0.0, 0.0)


def test_an_empty_answer_is_asked_again_after_backoff() -> None:
    pool = Pool("dns://n:1?refresh=30", backoff=0.5, max_backoff=1.0)
    name = pool.names[0]
    assert pool.resolved(name, [], 100.0) == []
    assert pool.due(100.4) == [] and pool.due(100.5) == [name]
    with pytest.raises(ConnectionFailed, match="resolved to no address"):
        pool.require()
    pool.resolved(name, [("10.0.0.1", 1, "n")], 101.0)
    assert pool.due(130.9) == [] and pool.due(131.0) == [name]
    assert pool.resolved(name, [], 131.0) == ["10.0.0.1:1"]  # it left; asked again soon
    assert pool.due(131.5) == [name]


def test_dns_schemes_match_in_any_case() -> None:
    assert parse_servers("DNS+SRV://_q._tcp.x.svc") == [
        ("dns+srv://_q._tcp.x.svc", "_q._tcp.x.svc", 0)]
    assert parse_servers("Dns://x.svc:7") == [("dns://x.svc:7", "x.svc", 7)]
