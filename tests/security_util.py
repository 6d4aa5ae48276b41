"""Helpers for the tests of users, logins and TLS: users files with cheap hashes, servers
that need a login, a memcache login, and a small PKI made by trustme.

Used by the security, console, visibility, login, client credential and Spark sink tests
(and conftest's `users_file` fixture).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trustme
from server_util import HOST, WAIT, Conn, make_config, running

from queued.config.users import hash_password
from queued.server.listeners import Server

REFUSED = b"CLIENT_ERROR authentication failure"
#: Cheap hashes for tests (the default cost is ~50 ms a check).
FAST = 4


def users_toml(**users: dict[str, Any]) -> str:
    lines = []
    for name, spec in users.items():
        lines.append(f"[users.{name}]")
        lines.append(f'password = "{hash_password(spec["password"], log_n=FAST)}"')
        for key in ("put", "get"):
            if key in spec:
                lines.append(f"{key} = {spec[key]!r}".replace("'", '"'))
        for flag in ("admin", "metrics"):
            if spec.get(flag):
                lines.append(f"{flag} = true")
    return "\n".join(lines) + "\n"


USERS = dict(
    alice={"password": "alice pw", "put": ["orders", "jobs-*"], "get": ["orders"]},
    bob={"password": "bob-pw", "get": ["jobs-*"]},
    root={"password": "root-pw", "admin": True, "put": ["*"], "get": ["*"]},
)


@asynccontextmanager
async def secured(tmp_path: Path, users_file: Path, **settings: object,
                  ) -> AsyncIterator[Server]:
    config = make_config(tmp_path / "data", users_file=str(users_file), **settings)
    async with running(config) as server:
        yield server


async def mc_login(port: int, user: str, password: str) -> Conn:
    conn = await Conn.open(port)
    assert await conn.set("auth", f"{user} {password}".encode()) == b"STORED"
    return conn


class Pki:
    """A CA, a server certificate for 127.0.0.1 in files, and client contexts."""

    def __init__(self, where: Path) -> None:
        self.ca = trustme.CA()
        self.dir = where
        self.cert, self.key, self.ca_file = where / "server.crt", where / "server.key", \
            where / "ca.crt"
        self.issue(self.ca)
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def issue(self, ca: trustme.CA) -> None:
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        leaf.private_key_pem.write_to_path(str(self.key))
        self.cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))

    def client(self, ca: trustme.CA | None = None, *, cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        (ca or self.ca).configure_trust(ctx)
        if cert:
            self.ca.issue_cert("client.example").configure_cert(ctx)
        return ctx


def tls_settings(pki: Pki, **more: object) -> dict[str, object]:
    """Server settings for TLS with `pki`'s certificate."""
    return {"tls_cert": str(pki.cert), "tls_key": str(pki.key), **more}


async def tls_open(port: int, ctx: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
    with trio.fail_after(WAIT):
        stream = trio.SSLStream(await trio.open_tcp_stream(HOST, port), ctx,
                                server_hostname="127.0.0.1")
        await stream.do_handshake()
        return stream


def tls_conn(stream: trio.SSLStream[trio.SocketStream], newline: bytes = b"\r\n") -> Conn:
    return Conn(stream, newline)  # type: ignore[arg-type]  # any trio stream serves
