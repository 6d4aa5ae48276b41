"""Resolving `dns://` and `dns+srv://` server addresses (queued.client.discovery) against
a real DNS server on loopback (fleet_util.FakeDns, real UDP): A records, SRV records and
their targets, a name that does not exist (no servers, not an error), a nameserver that
does not answer (an error: the caller keeps what it had), the answer of a thread of its
own, and the system resolver for a plain name. The pool's use of the answers:
test_client_servers.py; a fleet behind a name: test_fleet.py."""

from __future__ import annotations

import pytest
from fleet_util import fake_dns

from queued.client import ConnectionFailed, parse_servers
from queued.client.discovery import resolve, resolve_soon
from queued.client.servers import Discovery, Pool

NAME = "queued.discovery.test"


def discovery(url: str) -> Discovery:
    return Pool(url, backoff=1.0, max_backoff=1.0).names[0]


def test_a_records_through_a_named_nameserver() -> None:
    with fake_dns() as dns_server:
        dns_server.a = {NAME: ["127.0.0.11", "127.0.0.12"]}
        name = discovery(f"dns://{NAME}:7000?nameserver={dns_server.nameserver}")
        assert sorted(resolve(name, 2.0)) == [("127.0.0.11", 7000, NAME),
                                              ("127.0.0.12", 7000, NAME)]
        assert dns_server.queries >= 2  # A and AAAA


def test_srv_records_give_their_targets_and_ports() -> None:
    with fake_dns() as dns_server:
        service = f"_queued._tcp.{NAME}"
        dns_server.srv = {service: [(2229, "a.test"), (2230, "b.test")]}
        dns_server.a = {"a.test": ["127.0.0.11"], "b.test": ["127.0.0.12", "127.0.0.13"]}
        name = discovery(f"dns+srv://{service}?nameserver={dns_server.nameserver}")
        assert sorted(resolve(name, 2.0)) == [("127.0.0.11", 2229, "a.test"),
                                              ("127.0.0.12", 2230, "b.test"),
                                              ("127.0.0.13", 2230, "b.test")]


def test_a_name_that_does_not_exist_has_no_servers() -> None:
    with fake_dns() as dns_server:
        name = discovery(f"dns://nowhere.test:1?nameserver={dns_server.nameserver}")
        assert resolve(name, 2.0) == []


def test_a_silent_nameserver_is_an_error_within_the_timeout() -> None:
    with fake_dns() as dns_server:
        dns_server.silent = True
        name = discovery(f"dns://{NAME}:1?nameserver={dns_server.nameserver}")
        with pytest.raises(ConnectionFailed, match="cannot resolve") as failed:
            resolve(name, 0.3)
        assert failed.value.server == name.spec


def test_resolve_soon_hands_the_answer_or_the_error_to_a_future() -> None:
    with fake_dns() as dns_server:
        dns_server.a = {NAME: ["127.0.0.11"]}
        name = discovery(f"dns://{NAME}:9?nameserver={dns_server.nameserver}")
        assert resolve_soon(name, 2.0).result(5) == [("127.0.0.11", 9, NAME)]
        dns_server.silent = True
        with pytest.raises(ConnectionFailed):
            resolve_soon(name, 0.3).result(5)


def test_the_system_resolver_for_a_plain_name() -> None:
    name = discovery("dns://localhost:2229")
    assert not name.nameservers
    found = resolve(name, 2.0)
    assert found and all(port == 2229 and host == "localhost" for _, port, host in found)
    assert {address for address, _, _ in found} <= {"127.0.0.1", "::1"}
    assert parse_servers("dns://localhost:2229")[0][0] == name.spec
