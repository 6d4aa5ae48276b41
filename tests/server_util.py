"""Helpers for the real-TCP server tests: in-process servers, raw sockets, subprocesses.

Everything binds 127.0.0.1 on port 0, every wait is bounded by a timeout, and every
subprocess is killed by its PID when the test ends.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import compiled_util
import msgpack
import pytest
import trio
from pymemcache.client.base import Client as MemcacheClient
from wait_util import WAIT, wait_for

from queued.client import Client
from queued.config import ServerConfig, load_config
from queued.server.app import serve
from queued.server.listeners import Server
from queued.storage.files import PROBE_NAME

HOST = "127.0.0.1"
ANY_PORT: Mapping[str, object] = {
    "memcache_port": 0, "text_port": 0, "rpc_port": 0, "http_port": 0,
}
QUEUED = Path(sys.executable).with_name("queued")
T = TypeVar("T")


def make_config(data_dir: Path, toml: str | None = None, **settings: object) -> ServerConfig:
    """A config on free ports; `toml` (if given) is written next to data_dir and loaded."""
    flags: dict[str, object] = {"data_dir": str(data_dir), **ANY_PORT, **settings}
    if toml is not None:
        path = data_dir.parent / f"{data_dir.name}.toml"
        path.write_text(toml)
        flags["config"] = str(path)
    return load_config(flags, env={})


@asynccontextmanager
async def running(config: ServerConfig) -> AsyncIterator[Server]:
    """An in-process server for the body of the `async with`; shut down afterwards."""
    async with trio.open_nursery() as nursery:
        server: Server = await nursery.start(serve, config)
        try:
            yield server
        finally:
            server.request_shutdown("test finished")


@asynccontextmanager
async def running_conn(config: ServerConfig) -> AsyncIterator[Conn]:
    """`running(config)` and one raw memcache connection to it (`.port` is the server's
    memcache port), closed at the end."""
    async with running(config) as server:
        conn = await Conn.open(server.ports["memcache"])
        try:
            yield conn
        finally:
            await conn.aclose()


def data_files(data_dir: Path) -> list[str]:
    """The files in `data_dir`, but the write probe a running server makes now and then."""
    if not data_dir.exists():
        return []
    return sorted(name for name in os.listdir(data_dir) if name != PROBE_NAME)


# -- raw trio sockets --------------------------------------------------------------------------


class Conn:
    """A raw client connection with a line-oriented receive buffer."""

    def __init__(self, stream: trio.SocketStream, newline: bytes, port: int = 0) -> None:
        self.stream = stream
        self.newline = newline
        self.port = port  # the server port it was opened on (0: made from a stream)
        self.buf = bytearray()
        self.eof = False

    @classmethod
    async def open(cls, port: int, newline: bytes = b"\r\n") -> Conn:
        with trio.fail_after(WAIT):
            return cls(await trio.open_tcp_stream(HOST, port), newline, port)

    async def send(self, data: bytes) -> None:
        with trio.fail_after(WAIT):
            await self.stream.send_all(data)

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            raise EOFError("connection closed by the server")
        self.buf += data

    async def line(self, timeout: float = WAIT) -> bytes:
        """The next reply line without its line end."""
        with trio.fail_after(timeout):
            while True:
                i = self.buf.find(self.newline)
                if i >= 0:
                    line = bytes(self.buf[:i])
                    del self.buf[: i + len(self.newline)]
                    return line
                await self._fill()

    async def exactly(self, n: int, timeout: float = WAIT) -> bytes:
        with trio.fail_after(timeout):
            while len(self.buf) < n:
                await self._fill()
            data = bytes(self.buf[:n])
            del self.buf[:n]
            return data

    async def lines_until(self, last: bytes, timeout: float = WAIT) -> list[bytes]:
        """Lines up to and including `last` (e.g. END after stats)."""
        out: list[bytes] = []
        with trio.fail_after(timeout):
            while not out or out[-1] != last:
                out.append(await self.line())
        return out

    async def cmd(self, line: bytes, timeout: float = WAIT) -> bytes:
        """Send one command line, return the first reply line."""
        await self.send(line + b"\r\n")
        return await self.line(timeout)

    async def set(self, queue: str, data: bytes, exptime: int = 0) -> bytes:
        await self.send(b"set %s 0 %d %d\r\n%s\r\n" % (queue.encode(), exptime, len(data), data))
        return await self.line()

    async def store(self, queue: str, *values: bytes) -> None:
        """memcache `set` of each value in turn; asserts each is STORED."""
        for value in values:
            reply = await self.set(queue, value)
            assert reply == b"STORED", (queue, value, reply)

    async def get(self, key: str, timeout: float = WAIT) -> bytes | None:
        """memcache `get key`: the value, or None for END. Asserts the VALUE line echoes key."""
        await self.send(b"get %s\r\n" % key.encode())
        return await self.read_value(key, timeout)

    async def read_value(self, key: str, timeout: float = WAIT) -> bytes | None:
        """A get's reply: one VALUE block and END, or END alone (None)."""
        with trio.fail_after(timeout):
            data = await self.read_block(key, allow_end=True)
            if data is not None:
                assert await self.line() == b"END"
            return data

    async def read_block(self, key: str, *, allow_end: bool = False,
                         timeout: float = WAIT) -> bytes | None:
        """One `VALUE <key> 0 <n>` block (no END after it, as monitor sends them)."""
        with trio.fail_after(timeout):
            first = await self.line()
            if allow_end and first == b"END":
                return None
            parts = first.split(b" ")
            assert parts[:3] == [b"VALUE", key.encode(), b"0"], first
            data = await self.exactly(int(parts[3]) + 2)
            assert data.endswith(b"\r\n")
            return data[:-2]

    async def stats(self) -> dict[str, str]:
        await self.send(b"stats\r\n")
        out = {}
        for line in await self.lines_until(b"END"):
            if line != b"END":
                _, name, value = line.decode().split(" ", 2)
                out[name] = value
        return out

    async def expect_closed(self, timeout: float = WAIT) -> bytes:
        """Wait for the server to close; returns whatever was still unread."""
        with trio.fail_after(timeout):
            try:
                while True:
                    await self._fill()
            except (EOFError, trio.BrokenResourceError):
                pass
        rest, self.buf = bytes(self.buf), bytearray()
        return rest

    async def aclose(self) -> None:
        with trio.move_on_after(WAIT):
            await self.stream.aclose()


async def only_the_failing_one_closes(bad: Conn, good: Conn, logged: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """`bad` sends `get boom`, which the test made fail inside the server (a bug, not bad
    input): the server logs `logged` and closes `bad` alone; `good` is served on (and
    closed after)."""
    with caplog.at_level(logging.ERROR, logger="queued.server"):
        await bad.send(b"get boom\r\n")
        await bad.expect_closed()
    assert logged in caplog.text
    assert await good.set("q", b"1") == b"STORED"
    assert await good.get("q") == b"1"
    await good.aclose()


class Rpc:
    """Raw MessagePack-RPC over any trio stream."""

    @classmethod
    async def open(cls, port: int) -> Rpc:
        with trio.fail_after(WAIT):
            return cls(await trio.open_tcp_stream(HOST, port))

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0

    async def call(self, method: str, *params: Any) -> tuple[Any, Any]:
        self.msgid += 1
        with trio.fail_after(WAIT):
            await self.stream.send_all(msgpack.packb([0, self.msgid, method, list(params)]))
            while True:
                for msg in self.unpacker:
                    assert msg[1] == self.msgid
                    return msg[2], msg[3]
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("closed")
                self.unpacker.feed(data)

    async def closed(self) -> bool:
        with trio.fail_after(WAIT):
            try:
                return await self.stream.receive_some(65536) == b""
            except trio.BrokenResourceError:
                return True

    async def aclose(self) -> None:
        with trio.move_on_after(WAIT):
            await self.stream.aclose()


async def wait_for_stat(port: int, name: str, want: Any, timeout: float = WAIT) -> dict[str, str]:
    """Poll `stats` on a fresh connection until stat `name` equals str(want)."""
    conn = await Conn.open(port)
    try:
        return await wait_for(conn.stats, lambda stats: stats.get(name) == str(want), timeout)
    finally:
        await conn.aclose()


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def drain_queue(addr: str, queue: str, rounds: int = 1000) -> list[bytes]:
    """Every item of `queue` at the RPC address `addr`, in the order the server hands them
    out, taken 10,000 at a time (a queue not dry after `rounds` takes fails)."""
    out: list[bytes] = []
    with Client(addr) as c:
        for _ in range(rounds):
            got = c.get(queue, 10_000, timeout_ms=0)
            if not got:
                return out
            out += [it.data for it in got]
    raise AssertionError(f"queue {queue} did not run dry")


def rpc_call(port: int, method: str, params: list[Any]) -> Any:
    """One call on a fresh socket, written from the msgpack-rpc spec: its [error, result]."""
    with socket.create_connection((HOST, port), timeout=WAIT) as s:
        s.sendall(msgpack.packb([0, 1, method, params]))
        unpacker = msgpack.Unpacker()
        while True:
            chunk = s.recv(65536)
            assert chunk, "connection closed before the reply"
            unpacker.feed(chunk)
            for msg in unpacker:
                assert msg[:2] == [1, 1], msg
                return msg[2:]


def pymc(port: int) -> MemcacheClient:
    """pymemcache, blocking, with replies (noreply=False) and bounded waits."""
    return MemcacheClient((HOST, port), default_noreply=False, connect_timeout=WAIT,
                          timeout=WAIT)


def gets_until_dry(client: MemcacheClient, queue: str, limit: int = 1000) -> list[bytes]:
    """Blocking: memcache gets of `queue` until one finds nothing (a queue not dry after
    `limit` gets fails)."""
    out: list[bytes] = []
    for _ in range(limit):
        value = client.get(queue)
        if value is None:
            return out
        out.append(value)
    raise AssertionError(f"{queue} did not run dry after {limit} gets")


# -- a server subprocess -----------------------------------------------------------------------

_LISTEN_RE = re.compile(rb"listening for (\w+) on [0-9.]+:(\d+)")


class ServerProcess:
    """`queued serve` in a child process on free ports; stderr (the log) goes to a file."""

    def __init__(self, data_dir: Path, log_path: Path, config: Path | None = None, *,
                 host: str = HOST) -> None:
        self.host = host  # another loopback address (127.0.0.11) for fleet tests
        self.data_dir = data_dir
        self.log_path = log_path
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self._log_start = 0

    def start(self, timeout: float = 30.0, *, rpc_port: int = 0) -> ServerProcess:
        """Start it; `rpc_port` (else any free port) lets a restart keep its address."""
        cmd = [str(QUEUED), "serve", "--data-dir", str(self.data_dir), "--host", self.host,
               "--memcache-port", "0", "--text-port", "0", "--rpc-port", str(rpc_port),
               "--http-port", "0"]
        if self.config is not None:
            cmd += ["--config", str(self.config)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUED_")}
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = dict(_LISTEN_RE.findall(self.log()))
            if {b"memcache", b"text", b"rpc", b"http"} <= found.keys():
                self.ports = {k.decode(): int(v) for k, v in found.items()}
                if compiled_util.BUILD is not None:  # the server runs the build under test
                    assert compiled_util.server_build_ok(self.log()), self.log()[:2000]
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n"
                                     f"{self.log().decode(errors='replace')}")
            time.sleep(0.02)
        raise AssertionError("server did not start listening in time:\n"
                             + self.log().decode(errors="replace"))

    def log(self) -> bytes:
        """The log of the current run only."""
        return self.log_path.read_bytes()[self._log_start:] if self.log_path.exists() else b""

    @property
    def memcache(self) -> int:
        return self.ports["memcache"]

    @property
    def text(self) -> int:
        return self.ports["text"]

    @property
    def rpc(self) -> int:
        return self.ports["rpc"]

    @property
    def rpc_address(self) -> str:
        """host:port of its RPC port, as `queued.client.Client` takes it."""
        return f"{self.host}:{self.rpc}"

    @property
    def http(self) -> int:
        return self.ports["http"]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL by PID (if still running) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(WAIT)


def http_get(port: int, path: str, headers: Mapping[str, str] | None = None, *,
             method: str = "GET", timeout: float = WAIT) -> tuple[int, dict[str, str], bytes]:
    """Blocking: one request with the standard library's client: (status, headers, body)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, headers=dict(headers or {}))
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def send_lines(port: int, data: bytes, *, until: bytes, timeout: float = WAIT) -> bytes:
    """Blocking: send `data` on a fresh socket, read until the reply ends with `until`."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while not out.endswith(until):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def recv_until(sock: socket.socket, end: bytes, timeout: float = WAIT) -> bytes:
    """Blocking: what `sock` receives until it ends with `end` (the peer may not close)."""
    sock.settimeout(timeout)
    got = b""
    while not got.endswith(end):
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return got


@asynccontextmanager
async def served_sockets(port: int, n: int, tls: ssl.SSLContext | None = None,
                         ) -> AsyncIterator[list[socket.socket]]:
    """`n` blocking sockets to `port` (plain, or TLS with the client context `tls`),
    each accepted and served (a `version` answered), for sends with no await between
    them; closed at the end."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.create_connection((HOST, port), timeout=WAIT)
            if tls is not None:  # (the handshake in a thread: the server runs on this one)
                sock = await trio.to_thread.run_sync(
                    partial(tls.wrap_socket, sock, server_hostname=HOST))
            socks.append(sock)
        for sock in socks:
            sock.sendall(b"version\r\n")
            assert (await trio.to_thread.run_sync(recv_until, sock, b"\r\n")).startswith(
                b"VERSION")
        yield socks
    finally:
        for sock in socks:
            sock.close()


def killed_at_end(tmp_path: Path, config_text: str) -> Iterator[ServerProcess]:
    """For a fixture: a ServerProcess (not yet started) with `config_text` as its config
    file, always SIGKILLed by PID at the end."""
    config = tmp_path / "queued.toml"
    config.write_text(config_text)
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log", config)
    try:
        yield proc
    finally:
        proc.kill()
