"""Memcache flags are kept: stored with each item and returned on every path an item takes.

Real servers on 127.0.0.1 port 0 and real clients: python-memcached (it keeps `str`, `int`,
`bytes` and pickled values apart by their flags), pymemcache with explicit flags and with
its python-memcache serde, raw sockets (what Node's `memcached` sends for a Buffer, and
Node itself where it and that module are installed), a subprocess SIGKILLed and restarted
on its data directory; and the journal read back by a reader written from seeds/002
alone, which skips the FLAGS record as it skips any command it does not know.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import memcache  # python-memcached
import pytest
from journal_util import seed_reader
from pymemcache import serde
from pymemcache.client.base import Client as MemcacheClient
from server_util import (
    HOST,
    QUEUED,
    WAIT,
    Conn,
    ServerProcess,
    in_thread,
    make_config,
    rpc_call,
    running,
)

from queued.client import Client, Item
from queued.journal import format as jf

T = TypeVar("T")

MAX_FLAGS = 2**32 - 1


def python_memcached(port: int) -> Any:
    return memcache.Client([f"{HOST}:{port}"], socket_timeout=WAIT)


class KeepFlags:
    """A pymemcache serde that stores bytes as given and hands back (value, flags)."""

    def serialize(self, key: str, value: bytes) -> tuple[bytes, int]:
        return value, 0

    def deserialize(self, key: str, value: bytes, flags: int) -> tuple[bytes, int]:
        return value, flags


def pymc_flags(port: int) -> MemcacheClient:
    return MemcacheClient((HOST, port), default_noreply=False, connect_timeout=WAIT,
                          timeout=WAIT, serde=KeepFlags())


async def value_and_flags(conn: Conn, key: str) -> tuple[bytes, int] | None:
    """`get key` on a raw connection: (data, flags) of its VALUE line, or None for END."""
    await conn.send(b"get %s\r\n" % key.encode())
    first = await conn.line()
    if first == b"END":
        return None
    word, got_key, flags, size = first.split(b" ")
    assert (word, got_key) == (b"VALUE", key.encode()), first
    data = await conn.exactly(int(size) + 2)
    assert data.endswith(b"\r\n") and await conn.line() == b"END"
    return data[:-2], int(flags)


# -- clients that keep their types in the flags -------------------------------------------


async def test_python_memcached_round_trips_str_int_bytes_and_pickled(tmp_path: Path) -> None:
    values: list[object] = ["héllo wörld", 42, b"\x00\xffraw bytes", {"a": [1, 2]}, "", -7]
    async with running(make_config(tmp_path / "data")) as server:
        mc = python_memcached(server.ports["memcache"])

        def round_trip() -> list[object]:
            for v in values:
                assert mc.set("jobs", v)
            got = [mc.get("jobs") for _ in values]
            assert mc.get("jobs") is None
            return got

        got = await in_thread(round_trip)
        mc.disconnect_all()
    assert got == values
    assert [type(v) for v in got] == [type(v) for v in values]  # "42" is not b"42"


async def test_pymemcache_flags_and_its_python_memcache_serde(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        raw, typed = pymc_flags(port), MemcacheClient(
            (HOST, port), default_noreply=False, timeout=WAIT, serde=serde.pickle_serde)

        sent = [(b"a", 0), (b"b", 1), (b"c", MAX_FLAGS), (b"d", 123456), (b"", 9)]
        values: list[object] = ["text", 7, {"k": ["v"]}, b"bytes"]

        def round_trip() -> tuple[list[object], list[object]]:
            for data, flags in sent:
                assert raw.set("jobs", data, flags=flags)
            for v in values:
                assert typed.set("typed", v)
            return [raw.get("jobs") for _ in sent], [typed.get("typed") for _ in values]

        got_raw, got_typed = await in_thread(round_trip)
        raw.close()
        typed.close()
    assert got_raw == sent
    assert got_typed == values


# -- raw memcache bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("queue_exists", [False, True])
async def test_raw_flags_in_value_lines_and_pipelined_sets_with_mixed_flags(
    tmp_path: Path, queue_exists: bool,
) -> None:
    """Pipelined sets with different flags arrive in one chunk: those with the same flags
    may be joined into one append, the others not, every VALUE line has its own, and the
    items come back in the order sent (with the queue loaded, the pass joins its puts: a
    put after one with other flags must not join an earlier append of its own flags)."""
    flags = [5, 5, 0, 0, 9, MAX_FLAGS, 5, 0, 5]
    sets = b"".join(b"set q %d 0 2\r\n%02d\r\n" % (f, i) for i, f in enumerate(flags))
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        if queue_exists:
            assert await conn.cmd(b"set q 0 0 1\r\nz") == b"STORED"
            assert await value_and_flags(conn, "q") == (b"z", 0)
        await conn.send(sets)
        assert [await conn.line() for _ in flags] == [b"STORED"] * len(flags)
        got = [await value_and_flags(conn, "q") for _ in flags]
        # Out of range: refused before anything is stored, and the connection goes on.
        for bad in (b"4294967296", b"-1", b"99999999999"):
            assert (await conn.cmd(b"set q %s 0 1\r\nx" % bad)).startswith(b"CLIENT_ERROR")
        assert await value_and_flags(conn, "q") is None
        await conn.aclose()
    assert got == [(b"%02d" % i, f) for i, f in enumerate(flags)]


#: What Node's `memcached` module (2.2.2) sends for `set('jobs', <Buffer 00 01 02 fe ff 80 0d
#: 0a>, 0)`, captured from the wire: FLAG_BINARY (1 << 2), the buffer as a latin-1 string
#: written out as UTF-8, and CR / LF escaped with a backslash.
NODE_BUFFER = bytes([0x00, 0x01, 0x02, 0xFE, 0xFF, 0x80, 0x0D, 0x0A])
NODE_SET = b"set jobs 4 0 13\r\n\x00\x01\x02\xc3\xbe\xc3\xbf\xc2\x80\\\r\\\n\r\n"
NODE_FLAG_BINARY = 1 << 2


def node_memcached_value(data: bytes, flags: int) -> bytes | str:
    """How Node's `memcached` turns a VALUE back into a JavaScript value: a string, unless
    the flags say Buffer (then its latin-1 bytes)."""
    text = data.decode("utf-8").replace("\\\r", "\r").replace("\\\n", "\n")
    return text.encode("latin-1") if flags == NODE_FLAG_BINARY else text


async def test_node_memcached_buffer_round_trip_on_the_wire(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        await conn.send(NODE_SET)
        assert await conn.line() == b"STORED"
        got = await value_and_flags(conn, "jobs")
        await conn.aclose()
    assert got is not None
    assert got == (NODE_SET[17:-2], NODE_FLAG_BINARY)
    assert node_memcached_value(*got) == NODE_BUFFER  # a Buffer again, byte for byte


def _node_with_memcached() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    found = subprocess.run([node, "-e", "require.resolve('memcached')"], capture_output=True,
                           timeout=WAIT, check=False)
    return node if found.returncode == 0 else None


NODE_SCRIPT = r"""
const Memcached = require('memcached');
const m = new Memcached('127.0.0.1:' + process.argv[1], {retries: 0, timeout: 5000});
const buf = Buffer.from([0, 1, 2, 0xfe, 0xff, 0x80, 0x0d, 0x0a]);
m.set('jobs', buf, 0, (err) => {
  if (err) { console.log('set failed: ' + err); process.exit(2); }
  m.get('jobs', (err2, got) => {
    console.log(JSON.stringify({err: String(err2), buffer: Buffer.isBuffer(got),
                                same: Buffer.isBuffer(got) && got.equals(buf)}));
    m.end();
  });
});
"""


def test_node_memcached_buffer_round_trip(server_proc: ServerProcess) -> None:
    """The real client, where Node and its `memcached` module can be found (NODE_PATH)."""
    node = _node_with_memcached()
    if node is None:
        pytest.skip("node or its `memcached` module is not installed (set NODE_PATH)")
    server_proc.start()
    done = subprocess.run([node, "-e", NODE_SCRIPT, str(server_proc.memcache)],
                          capture_output=True, timeout=WAIT, check=False)
    assert done.stdout.strip() == b'{"err":"undefined","buffer":true,"same":true}', done


# -- MessagePack-RPC and the Python client ----------------------------------------------------


async def test_rpc_and_the_python_client_put_and_read_flags(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        mc_port, rpc_port = server.ports["memcache"], server.ports["rpc"]
        conn = await Conn.open(mc_port)
        assert await conn.cmd(b"set q 16 0 5\r\nhello") == b"STORED"

        def work() -> tuple[Any, list[Item], object]:
            with Client(f"{HOST}:{rpc_port}", read_timeout=WAIT) as client:
                assert client.put("q", [b"buf", b"buf2"], flags=NODE_FLAG_BINARY) == 2
                assert client.put("q", ["x"]) == 1
                with pytest.raises(ValueError):
                    client.put("q", [b"no"], flags=2**32)
                # A get that does not ask for flags answers [id, data] pairs, as always.
                plain = rpc_call(rpc_port, "get", ["q", 1])
                got = client.get("q", 10, with_flags=True)
                # An RPC producer feeding a python-memcached consumer: str (flag 16).
                assert client.put("r", "text", flags=16) == 1
                mc = python_memcached(mc_port)
                value = mc.get("r")
                mc.disconnect_all()
                return plain, got, value

        plain, got, value = await in_thread(work)
        bad = await in_thread(lambda: rpc_call(rpc_port, "put", ["q", [b"z"], 0, 2**32]))
        assert await value_and_flags(conn, "q") is None  # the refused put stored nothing
        await conn.aclose()
    assert plain == [None, [[1, b"hello"]]]
    assert [(i.id, i.data, i.flags) for i in got] == [
        (2, b"buf", NODE_FLAG_BINARY), (3, b"buf2", NODE_FLAG_BINARY), (4, b"x", 0)]
    assert value == "text"
    assert bad[0][0] == 3 and bad[1] is None  # BAD_PARAMS


# -- every path an item takes ---------------------------------------------------------------


async def test_flags_survive_open_reads_aborted_disconnected_and_fanout(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["memcache"]
        conn = await Conn.open(port)
        for key in ("f+a", "f+b"):  # two fanout readers, before the put
            assert await value_and_flags(conn, key) is None
        assert await conn.cmd(b"set f 77 0 3\r\nfan") == b"STORED"
        assert await conn.cmd(b"set q 11 0 3\r\none") == b"STORED"
        assert await value_and_flags(conn, "q/open") == (b"one", 11)
        assert await conn.cmd(b"get q/abort") == b"END"
        assert await value_and_flags(conn, "q/open") == (b"one", 11)  # redelivered
        await conn.aclose()  # open read returned on disconnect
        again = await Conn.open(port)
        assert await value_and_flags(again, "q/t=5000/open") == (b"one", 11)
        assert await again.cmd(b"get q/close") == b"END"
        assert await value_and_flags(again, "f+a") == (b"fan", 77)
        assert await value_and_flags(again, "f+b/peek") == (b"fan", 77)
        assert await value_and_flags(again, "f+b") == (b"fan", 77)
        await again.aclose()


async def test_flags_survive_error_queue_and_expire_to_queue_moves(tmp_path: Path) -> None:
    toml = """
[queues.jobs]
error_queue = "failed"
max_errors = 2

[queues.soon]
expire_to_queue = "late"
"""
    async with running(make_config(tmp_path / "data", toml)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.cmd(b"set jobs 31 0 3\r\nbad") == b"STORED"
        for _ in range(2):  # aborted max_errors times: moved to the error queue
            assert await value_and_flags(conn, "jobs/open") == (b"bad", 31)
            assert await conn.cmd(b"get jobs/abort") == b"END"
        assert await value_and_flags(conn, "failed/t=5000") == (b"bad", 31)
        # Expired already (a negative exptime, as memcached): moved when a get meets them;
        # the three with the same flags in one put, the other in its own.
        await conn.send(b"set soon 5 -1 1\r\na\r\nset soon 5 -1 1\r\nb\r\n"
                        b"set soon 0 -1 1\r\nc\r\nset soon 5 -1 1\r\nd\r\n")
        assert [await conn.line() for _ in range(4)] == [b"STORED"] * 4
        assert await value_and_flags(conn, "soon") is None
        got = [await value_and_flags(conn, "late/t=5000") for _ in range(4)]
        await conn.aclose()
    assert got == [(b"a", 5), (b"b", 5), (b"c", 0), (b"d", 5)]


async def test_flags_survive_read_behind(tmp_path: Path) -> None:
    """A backlog far over max_memory_size: most items are read back from the journal."""
    toml = '[queues.big]\nmax_memory_size = "1KiB"\n'
    n = 200
    async with running(make_config(tmp_path / "data", toml)) as server:
        conn = await Conn.open(server.ports["memcache"])
        await conn.send(b"".join(b"set big %d 0 100\r\n%s\r\n" % (i * 7, b"%03d" % i * 33 + b"x")
                                 for i in range(n)))
        assert [await conn.line() for _ in range(n)] == [b"STORED"] * n
        stats = await conn.stats()
        assert int(stats["queue_big_mem_items"]) < n // 4  # the rest waits on disk
        got = [await value_and_flags(conn, "big") for _ in range(n)]
        await conn.aclose()
    assert got == [(b"%03d" % i * 33 + b"x", i * 7) for i in range(n)]


# -- restart, and what is on disk -----------------------------------------------------------


@pytest.mark.slow
def test_flags_survive_sigkill_and_restart(server_proc: ServerProcess) -> None:
    server_proc.start()
    client = pymc_flags(server_proc.memcache)
    sent = [(b"item-%d" % i, [0, 2, 16, MAX_FLAGS, 4][i % 5]) for i in range(50)]
    for data, flags in sent:
        assert client.set("q", data, flags=flags)
    assert client.get("q/open") == sent[0]  # an open read: back at the head after the kill
    client.close()
    server_proc.signal(signal.SIGKILL)
    server_proc.wait()
    server_proc.start()
    client = pymc_flags(server_proc.memcache)
    try:
        got = [client.get("q") for _ in range(len(sent))]
        assert client.get("q") is None
    finally:
        client.close()
    assert got == sent


async def test_seed_readers_read_journals_with_flags_and_flags_zero_costs_no_bytes(
    tmp_path: Path,
) -> None:
    flags = [0, 16, 0, 2, MAX_FLAGS, 0, 1]
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        for i, f in enumerate(flags):  # one at a time: one batch (and check record) each
            assert await conn.cmd(b"set q %d 0 5\r\nitem%d" % (f, i)) == b"STORED"
            assert await conn.cmd(b"set plain 0 0 5\r\nitem%d" % i) == b"STORED"
        await conn.aclose()
    data = tmp_path / "data"
    (seg,) = [p for p in data.iterdir() if p.name.startswith("q.") and "read" not in p.name]
    puts, skipped = seed_reader(seg.read_bytes())
    assert puts == [(i + 1, 0, b"item%d" % i) for i in range(len(flags))]
    # One FLAGS record per flagged item, skipped; check records too, and the head's
    # INCARNATION record (tests/test_incarnation.py) in its own batch: all of them
    # extension records (command 13, one header word).
    assert skipped == Counter({13: sum(1 for f in flags if f) + len(flags) + 2 + 1})
    # Flags 0 add no byte: magic, empty check, incarnation, then per item one PUT and one
    # check.
    (plain,) = [p for p in data.iterdir() if p.name.startswith("plain.") and "read" not in p.name]
    assert plain.stat().st_size == 4 + 14 + 14 + 14 + len(flags) * (25 + 5 + 14)
    assert seed_reader(plain.read_bytes())[1] == Counter({13: len(flags) + 2 + 1})
    # Our own decoder gives each PUT its flags back; `queued dump` shows them.
    ours = [d.record for d in jf.decode_all(seg.read_bytes()) if isinstance(d.record, jf.Put)]
    assert [p.flags for p in ours] == flags
    dump = subprocess.run([str(QUEUED), "dump", str(seg)], capture_output=True, text=True,
                          timeout=WAIT, check=False)
    shown = [line for line in dump.stdout.splitlines() if " PUT " in line]
    assert [f" flags={f} " in line for line, f in zip(shown, flags, strict=True)] == [
        bool(f) for f in flags]
    # `queued check` finds nothing wrong with FLAGS records (exit 0: healthy).
    check = subprocess.run([str(QUEUED), "check", str(data)], capture_output=True, text=True,
                           timeout=WAIT, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
