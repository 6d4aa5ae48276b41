"""Logging in again on a connection that is logged in already.

A request runs with the grant in force at its place in the stream, also when a login
comes before it in the same write (text AUTH, RPC auth, memcache's login set). On
memcache, a set whose data is a configured user's credential pair is a login, never an
item: its password must not reach a queue or the journal. Real servers on 127.0.0.1
port 0 with a users file, raw sockets and pymemcache.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from security_util import REFUSED, mc_login, secured
from server_util import HOST, QUEUED, WAIT, Conn, Rpc, pymc

from queued.config.users import hash_password
from queued.wire.access import MAX_PASSWORD

DENIED = "permission denied: user 'bob' lacks 'admin' on queue 'scratch'"


def data_dir_bytes(data_dir: Path) -> bytes:
    """Every byte of every file under the data directory."""
    out = bytearray()
    for root, _, files in os.walk(data_dir):
        for name in files:
            out += Path(root, name).read_bytes()
    return bytes(out)


async def rpc_pipelined(rpc: Rpc, *calls: tuple[str, list[Any]]) -> list[tuple[Any, Any]]:
    """Send `calls` in one write; their (error, result) replies in order."""
    first = rpc.msgid + 1
    rpc.msgid += len(calls)
    await rpc.stream.send_all(b"".join(msgpack.packb([0, first + i, method, params])
                                       for i, (method, params) in enumerate(calls)))
    replies: dict[int, tuple[Any, Any]] = {}
    with trio.fail_after(WAIT):
        while len(replies) < len(calls):
            for msg in rpc.unpacker:
                replies[msg[1]] = (msg[2], msg[3])
            if len(replies) < len(calls):
                data = await rpc.stream.receive_some(65536)
                assert data, "closed"
                rpc.unpacker.feed(data)
    return [replies[first + i] for i in range(len(calls))]


# -- the grant in force at each request ---------------------------------------------------------


async def test_text_login_in_a_pipelined_batch_governs_the_requests_after_it(
        tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        conn = await Conn.open(server.ports["text"], b"\n")
        assert await conn.cmd(b"AUTH root root-pw") == b"+1"
        await conn.send(b"put scratch:\nkeep\n\n")
        assert await conn.line() == b"+1"
        await conn.send(b"AUTH bob bob-pw\nflush scratch\n")  # one write
        assert [await conn.line(), await conn.line()] == [b"+1", b"-" + DENIED.encode()]
        await conn.send(b"AUTH root root-pw\nflush scratch\n")  # and back, in one write
        assert [await conn.line(), await conn.line()] == [b"+1", b"+0"]
        await conn.aclose()
        assert server.broker.queues["scratch"].readers[""].reader.items == 0


async def test_rpc_login_in_a_pipelined_batch_governs_the_requests_after_it(
        tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        rpc = Rpc(await trio.open_tcp_stream(HOST, server.ports["rpc"]))
        assert await rpc.call("auth", "root", "root-pw") == (None, True)
        assert await rpc.call("put", "scratch", [b"keep"]) == (None, 1)
        assert await rpc_pipelined(rpc, ("auth", ["bob", "bob-pw"]),
                                   ("flush", ["scratch"])) == [(None, True), ([15, DENIED], None)]
        assert await rpc.call("peek", "scratch") != (None, None)
        assert await rpc_pipelined(rpc, ("auth", ["root", "root-pw"]), ("flush", ["scratch"]),
                                   ("get", ["scratch", 1])) == [
            (None, True), (None, 1), (None, [])]
        await rpc.stream.aclose()


async def test_memcache_login_in_a_pipelined_batch_governs_the_requests_after_it(
        tmp_path: Path, users_file: Path) -> None:
    async with secured(tmp_path, users_file) as server:
        conn = await mc_login(server.ports["memcache"], "root", "root-pw")
        assert await conn.set("scratch", b"keep") == b"STORED"
        await conn.send(b"set auth 0 0 10\r\nbob bob-pw\r\nflush scratch\r\n")
        assert [await conn.line(), await conn.line()] == [
            b"STORED", b"CLIENT_ERROR " + DENIED.encode()]
        await conn.send(b"set auth 0 0 12\r\nroot root-pw\r\nget scratch\r\n")
        assert await conn.line() == b"STORED"
        assert await conn.read_value("scratch") == b"keep"  # root's again: allowed
        await conn.aclose()


# -- memcache: a credential pair is a login, never an item ---------------------------------------


async def test_memcache_login_set_on_a_logged_in_connection_is_not_stored(
        tmp_path: Path, users_file: Path) -> None:
    data_dir = tmp_path / "data"
    async with secured(tmp_path, users_file) as server:
        port = server.ports["memcache"]

        def client_work() -> list[Any]:
            # pymemcache, as a client library that logs in again on a connection it
            # believes new: the second login set must answer as the first did
            mc = pymc(port)
            try:
                out: list[Any] = [mc.set("auth", "root root-pw"), mc.set("auth", "root root-pw"),
                                  mc.set("jobs", "root root-pw"), mc.get("auth"),
                                  mc.get("jobs")]
                out.append(mc.set("jobs", b"an item"))
                out.append(mc.get("jobs"))
                return out
            finally:
                mc.close()

        assert await trio.to_thread.run_sync(client_work) == [
            True, True, True, None, None, True, b"an item"]
        # pipelined sets of one queue: the login among them is not joined to the items
        conn = await mc_login(port, "root", "root-pw")
        await conn.send(b"set auth 0 0 2\r\nx1\r\nset auth 0 0 12\r\nroot root-pw\r\n"
                        b"set auth 0 0 2\r\nx2\r\n")
        assert [await conn.line() for _ in range(3)] == [b"STORED"] * 3
        assert [await conn.get("auth"), await conn.get("auth"), await conn.get("auth")] == [
            b"x1", b"x2", None]
        # what only looks like a login is data: an unknown user, or over the login cap
        assert await conn.set("jobs", b"mallory says hi") == b"STORED"
        long = b"root " + b"x" * 2000
        assert await conn.set("jobs", long) == b"STORED"
        assert [await conn.get("jobs"), await conn.get("jobs")] == [b"mallory says hi", long]
        await conn.aclose()
    assert b"root-pw" not in data_dir_bytes(data_dir)


async def test_memcache_known_user_with_a_wrong_password_is_a_failed_login(
        tmp_path: Path, users_file: Path) -> None:
    """On a logged-in connection, `<configured user> <not its password>` is refused as a
    wrong login is (closed, counted), never stored; the connection's grant is not kept."""
    data_dir = tmp_path / "data"
    async with secured(tmp_path, users_file) as server:
        conn = await mc_login(server.ports["memcache"], "root", "root-pw")
        assert await conn.set("jobs", b"alice guessed-wrong") == REFUSED
        await conn.expect_closed()
        assert server.protocols["memcache"].auth_failures == 1
        conn = await mc_login(server.ports["memcache"], "root", "root-pw")
        assert await conn.get("jobs") is None  # nothing was stored
        await conn.aclose()
    assert b"guessed-wrong" not in data_dir_bytes(data_dir)


def test_passwords_are_capped_where_they_are_made_and_checked() -> None:
    with pytest.raises(ValueError, match="at most"):
        hash_password("p" * (MAX_PASSWORD + 1), log_n=4)
    too_long = subprocess.run([str(QUEUED), "passwd"], input="p" * (MAX_PASSWORD + 1) + "\n",
                              capture_output=True, text=True, timeout=WAIT, check=False)
    assert too_long.returncode == 2 and "at most" in too_long.stderr
