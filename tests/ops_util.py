"""Helpers for the operations-port tests (the HTTP port, /metrics, the console): HTTP
requests, raw bytes sent to the port, Basic credentials, and expositions read back as
{(sample, labels): value} with prometheus-client's parser."""

from __future__ import annotations

import base64
import socket
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families as parse_text
from server_util import HOST, WAIT, Conn, http_get, make_config

from queued.config import ServerConfig
from queued.server.listeners import Server

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]

NONE: Labels = frozenset()


def cfg(tmp_path: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    return make_config(tmp_path / "data", toml, **settings)


async def get(port: int, path: str, headers: dict[str, str] | None = None, *,
              method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await trio.to_thread.run_sync(
        lambda: http_get(port, path, headers, method=method))


def raw_http(port: int, data: bytes, timeout: float = WAIT, *, eof: bool = False) -> bytes:
    """Blocking: send raw bytes (then EOF if `eof`), read until the server closes."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        if eof:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def raw(port: int, data: bytes, *, eof: bool = False) -> bytes:
    return await trio.to_thread.run_sync(lambda: raw_http(port, data, eof=eof))


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def samples(text: str) -> Samples:
    """{(sample name, labels): value} of a text exposition."""
    out: Samples = {}
    for family in parse_text(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def scrape(server: Server) -> Samples:
    status, headers, body = await get(server.ports["http"], "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(body.decode())


def q(queue: str, reader: str = "") -> Labels:
    return frozenset({("queue", queue), ("reader", reader)})


def lab(**labels: str) -> Labels:
    return frozenset(labels.items())


async def put(server: Server, queue: str, *values: bytes) -> None:
    conn = await Conn.open(server.ports["memcache"])
    try:
        for v in values:
            assert await conn.set(queue, v) == b"STORED"
    finally:
        await conn.aclose()
