"""Item headers: every path an item takes with them (the rule, the block and the HEADERS
record, pure: test_journal_headers.py).

Real servers on 127.0.0.1 port 0: raw MessagePack-RPC (old clients' shapes unchanged, the
limits refused with nothing stored), both Python clients, moves to error and expiry queues, reject,
redrive, delays, read-behind, parking, a restart, compaction, memcache and text gets (the
data alone), the console's head view, `queued put --header` / `get --headers` / `dump`,
and a subprocess SIGKILLed and restarted.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from journal_util import T0, cfg, data_for
from ops_util import get as http_get
from rpc_util import Rpc
from server_util import HOST, QUEUED, WAIT, Conn, ServerProcess, make_config, running
from wait_util import wait_until

from queued.client import AsyncClient, Client
from queued.journal import format as jf
from queued.journal.headers import encode_headers
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir
from queued.wire.rpc_protocol import ErrorCode

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE = {"traceparent": TRACEPARENT, "tracestate": b"vendor=\x00\xff"}


async def test_compaction_keeps_the_headers_of_stragglers(tmp_path: Path) -> None:
    def block_of(i: int) -> bytes:
        return encode_headers({"i": str(i)}) if i % 3 else b""

    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=2000)) as dd:
        q = dd.queue("q")
        for i in range(1, 121):
            await q.append([data_for(i)], T0, headers=[block_of(i)])
        stragglers = {30, 77, 78, 79}
        await q.write_checkpoint("", 29, [i for i in range(31, 101) if i not in stragglers])
        assert (await q.compact()).rewritten >= 2
    expected = [(i, block_of(i)) for i in [*sorted(stragglers), *range(101, 121)]]
    q2 = DataDir.open(tmp_path).queues["q"]
    out = next(s for s in q2.segments if s.compacted_from is not None)
    rewritten = [d.record for d in jf.decode_all(out.path.read_bytes())]
    assert [(p.id, p.headers) for p in rewritten if isinstance(p, jf.Put)] == [
        e for e in expected if e[0] <= out.last_id]
    assert [(p.id, p.headers) for p in q2.iter_unconsumed("")] == expected


# -- RPC on the wire -----------------------------------------------------------------------


class RawRpc(Rpc):
    """Rpc that can also take a reply as its raw bytes (what an old client parses)."""

    async def raw(self, method: str, *params: Any) -> bytes:
        """The reply to one call, as sent (call it with no other reply in flight)."""
        await self.send_request(method, *params)
        buf = b""
        with trio.fail_after(WAIT):
            while True:
                unpacker = msgpack.Unpacker(raw=False)
                unpacker.feed(buf)
                try:
                    unpacker.unpack()
                except msgpack.OutOfData:
                    more = await self.stream.receive_some(65536)
                    if not more:
                        raise EOFError("closed by the server") from None
                    buf += more
                    continue
                assert unpacker.tell() == len(buf)
                return buf


async def test_old_clients_wire_shapes_are_unchanged(tmp_path: Path) -> None:
    """Puts without headers in every older form; gets and browses in every older form
    answer items with headers exactly as before (their bytes); only with_headers adds them."""
    async with running(make_config(tmp_path / "data")) as server:
        c = await RawRpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"h1", b"h2"], 0, 0, 0, None, 0, None, TRACE) == 2
        for params in (["q", [b"a"]], ["q", [b"b"], 0], ["q", [b"c"], 0, 5],
                       ["q", [b"d"], 0, 0, 0], ["q", [b"e"], 0, 0, 0, None],
                       ["q", [b"f"], 0, 0, 0, None, 0], ["q", [b"g"], 0, 0, 0, None, 0, None],
                       ["q", [b"h"], 0, 0, 0, None, 0, None, None]):
            assert await c.raw("put", *params) == msgpack.packb([1, c.msgid, None, 1])
        assert await c.raw("browse", "q", 0, 2) == msgpack.packb(
            [1, c.msgid, None, [[1, b"h1", 0, 0], [2, b"h2", 0, 0]]])
        assert await c.raw("browse", "q", 0, 1, True) == msgpack.packb(
            [1, c.msgid, None, [[1, b"h1", 0, 0, TRACE]]])
        assert await c.raw("get", "q", 1) == msgpack.packb([1, c.msgid, None, [[1, b"h1"]]])
        assert await c.raw("get", "q", 1, 0, 0, True) == msgpack.packb(
            [1, c.msgid, None, [[2, b"h2", 0]]])
        assert await c.raw("get", "q", 1, 0, 0, False, True) == msgpack.packb(
            [1, c.msgid, None, [[3, b"a", 0, 1]]])
        assert await c.raw("get", "q", 2, 0, 0, False, False, True) == msgpack.packb(
            [1, c.msgid, None, [[4, b"b", 0, 1, {}], [5, b"c", 5, 1, {}]]])
        # per item: a map or nil each
        assert await c.call("put", "r", [b"x", b"y", b"z"], 0, 0, 0, None, 0, None,
                            [None, {"k": "v"}, {}]) == 3
        assert await c.call("get", "r", 3, 0, 0, False, False, True) == [
            [1, b"x", 0, 1, {}], [2, b"y", 0, 1, {"k": "v"}], [3, b"z", 0, 1, {}]]
        await c.aclose()


async def test_headers_past_the_limits_are_refused_and_nothing_is_stored(
        tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        c = await Rpc.open(server.ports["rpc"])
        for headers, why in [
            ({f"k{i}": "v" for i in range(65)}, "65 headers, over the limit of 64"),
            ({"k": b"v" * 16_384}, "over the limit of 16384 bytes"),
            ({"k": 1}, "values must be bytes or strings"),
            ({b"k": b"v"}, "keys must be non-empty strings"),
            ([{"k": "v"}], "1 maps for 2 items"),
            ([{"k": "v"}, 7], "headers must be a map"),
            ("k=v", "headers must be a map"),
        ]:
            code, message = await c.error("put", "q", [b"a", b"b"], 0, 0, 0, None, 0, None, headers)
            assert code == ErrorCode.BAD_PARAMS and why in message, message
        # the same refused with a deduplication key (the eighth param): nothing stored
        code, message = await c.error("put", "q", [b"a"], 0, 0, 0, None, 0, b"k", 7)
        assert code == ErrorCode.BAD_PARAMS and "headers must be" in message, message
        # the same refused with a producer: nothing stored, the sequence not taken (the
        # eighth param, nil, is the deduplication key's)
        code, _ = await c.error("put", "q", [b"a", b"b"], 0, 0, 0, b"p", 1, None, {"k": 2})
        assert code == ErrorCode.BAD_PARAMS
        assert await c.call("put", "q", [b"ok"], 0, 0, 0, b"p", 1, None, {"k": "v"}) == [
            1, 1, False]
        assert await c.call("get", "q", 100, 0, 0, False, False, True) == [
            [1, b"ok", 0, 1, {"k": "v"}]]
        await c.aclose()


# -- both clients, and every path an item takes --------------------------------------------


async def test_both_clients_put_and_read_headers(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        addr = f"{HOST}:{server.ports['rpc']}"
        async with AsyncClient(addr) as c:
            assert await c.put("q", [b"a", b"b"], headers=TRACE) == 2
            assert await c.put("q", ["c", "d"], headers=[None, {"n": "1"}]) == 2
            with pytest.raises(ValueError, match="over the limit of 64"):
                await c.put("q", b"e", headers={f"k{i}": b"" for i in range(65)})
            with pytest.raises(ValueError, match="16384 bytes"):
                await c.put("q", b"e", headers={"k": "v" * 16_384})
            with pytest.raises(ValueError, match="2 headers maps for 1 items"):
                await c.put("q", b"e", headers=[None, None])
            got = await c.get("q", 1)  # not asked for: None
            assert got[0].headers is None and got[0].data == b"a"
            async with c.reserve("q", with_headers=True) as item:
                assert item is not None and item.headers == TRACE and item.deliveries == 1
            items = [it async for it in c.consume("q", stop_when_empty=True, with_headers=True)]
            assert [(it.data, it.headers) for it in items] == [(b"c", {}), (b"d", {"n": "1"})]

        def blocking() -> None:
            with Client(addr) as c:
                assert c.put("s", [b"x"], headers={"traceparent": TRACEPARENT}) == 1
                with pytest.raises(ValueError, match="keys must be non-empty strings"):
                    c.put("s", b"y", headers={"": "v"})
                assert [it.headers for it in c.browse("s", with_headers=True)] == [
                    {"traceparent": TRACEPARENT}]
                (item,) = c.get("s", 10, with_headers=True)
                assert item.headers == {"traceparent": TRACEPARENT}
                assert c.get("s", 10) == []  # the refused puts stored nothing
        await trio.to_thread.run_sync(blocking)


async def test_moves_and_delays_keep_headers(tmp_path: Path) -> None:
    """error_queue (aborts), reject, expire_to_queue, a redrive (move) and a delayed put."""
    toml = """
[queues.jobs]
error_queue = "failed"
max_errors = 1

[queues.soon]
expire_to_queue = "late"
"""
    async with running(make_config(tmp_path / "data", toml)) as server, AsyncClient(
            f"{HOST}:{server.ports['rpc']}") as c:
        await c.put("jobs", [b"aborted", b"rejected"], headers=[TRACE, {"r": "1"}])
        first, second = await c.get("jobs", 2, auto_abort_ms=60_000)
        await c.abort(first)
        await c.reject(second)
        await c.put("soon", [b"expired"], expiration_ms=1, headers={"e": b"1"})
        await trio.sleep(0.01)
        assert await c.get("soon") == []  # meets it expired: moved
        late = await c.get("late", 1, 5000, with_headers=True)
        assert [(it.data, it.headers) for it in late] == [(b"expired", {"e": b"1"})]
        failed = await c.get("failed", 2, 5000, with_headers=True)
        assert {it.data: it.headers for it in failed} == {b"aborted": TRACE,
                                                          b"rejected": {"r": "1"}}
        await c.put("failed", [b"redriven"], headers=TRACE)
        assert await c.move("failed", "jobs") == 1
        (it,) = await c.get("jobs", 1, with_headers=True)
        assert (it.data, it.headers) == (b"redriven", TRACE)
        await c.put("later", [b"due"], delay_ms=150, headers=TRACE)
        assert await c.get("later") == []
        (it,) = await c.get("later", 1, 5000, with_headers=True)
        assert (it.data, it.headers) == (b"due", TRACE)


async def test_headers_survive_read_behind_parking_and_a_restart(tmp_path: Path) -> None:
    toml = '[queues.big]\nmax_memory_size = "1KiB"\n'
    config = make_config(tmp_path / "data", toml, park_after="100ms",
                         checkpoint_interval="50ms")
    n = 150
    sent = [(b"%04d" % i * 20, {"i": str(i)} if i % 4 else {}) for i in range(n)]
    async with running(config) as server, AsyncClient(f"{HOST}:{server.ports['rpc']}") as c:
        await c.put("big", [d for d, _ in sent], headers=[h or None for _, h in sent])
        stats = (await c.stats())[f"{HOST}:{server.ports['rpc']}"]["queues"]["big"]
        assert stats["mem_items"] < n // 4  # the rest is read back from the journal
        got = await c.get("big", n // 2, with_headers=True)
        await c.put("parked", [b"p"], headers=TRACE)
        await wait_until(lambda: "parked" in server.broker.registry.parked)
        (it,) = await c.get("parked", 1, with_headers=True)
        assert it.headers == TRACE
    async with running(config) as server, AsyncClient(f"{HOST}:{server.ports['rpc']}") as c:
        got += await c.get("big", n, with_headers=True)
    assert [(it.data, it.headers) for it in got] == sent


async def test_max_memory_size_counts_headers(tmp_path: Path) -> None:
    """Items of 1 byte with 8 KiB of headers each: a 64 KiB queue holds about eight in
    memory (mem_bytes counts the headers), the rest is read back from the journal."""
    toml = '[queues.heavy]\nmax_memory_size = "64KiB"\n'
    big = [{"h": f"{i:03d}" + "x" * 8189} for i in range(60)]
    async with running(make_config(tmp_path / "data", toml)) as server, AsyncClient(
            f"{HOST}:{server.ports['rpc']}") as c:
        for h in big:
            await c.put("heavy", [b"d"], headers=h)
        stats = (await c.stats())[f"{HOST}:{server.ports['rpc']}"]["queues"]["heavy"]
        assert stats["mem_items"] <= 9 and stats["mem_bytes"] <= 64 * 1024 + 8200
        assert stats["bytes"] == 60  # (the queue's bytes are its items' data)
        got = await c.get("heavy", 100, with_headers=True)
        got += await c.get("heavy", 100, with_headers=True)
    assert [it.headers for it in got] == big


async def test_memcache_and_text_gets_return_the_data_alone(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        c = await Rpc.open(server.ports["rpc"])
        assert await c.call("put", "q", [b"one", b"two"], 0, 0, 0, None, 0, None, TRACE) == 2
        await c.aclose()
        mc = await Conn.open(server.ports["memcache"])
        assert await mc.get("q") == b"one"
        await mc.aclose()
        text = await Conn.open(server.ports["text"], newline=b"\n")
        assert await text.cmd(b"get q") == b":two"
        await text.aclose()


async def test_the_console_head_view_shows_headers(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        c = await Rpc.open(server.ports["rpc"])
        await c.call("put", "q", [b"one", b"two"], 0, 0, 0, None, 0, None, [TRACE, None])
        await c.aclose()
        status, _, body = await http_get(server.ports["http"], "/api/queues/q")
        assert status == 200
        items = json.loads(body)["items"]
        assert [[(h["key"], h["text"], h["binary"]) for h in it["headers"]] for it in items] == [
            [("traceparent", TRACEPARENT, False), ("tracestate", "vendor=\\x00\ufffd", True)], []]


async def test_the_command_line_puts_gets_and_dumps_headers(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        addr = f"{HOST}:{server.ports['rpc']}"

        def run(*args: str) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run([str(QUEUED), *args, "--server", addr], capture_output=True,
                                  timeout=WAIT * 3, check=True)

        await trio.to_thread.run_sync(run, "put", "q", "a", "--header",
                                      f"traceparent={TRACEPARENT}", "--header", "n=1")
        await trio.to_thread.run_sync(run, "put", "q", "b")
        out = (await trio.to_thread.run_sync(run, "get", "q", "-n", "2", "--headers")).stdout
        assert out.splitlines() == [json.dumps({"traceparent": TRACEPARENT, "n": "1"}).encode(),
                                    b"a", b"{}", b"b"]
        bad = await trio.to_thread.run_sync(lambda: subprocess.run(
            [str(QUEUED), "put", "q", "c", "--header", "novalue", "--server", addr],
            capture_output=True, timeout=WAIT * 3, check=False))
        assert bad.returncode == 2 and b"is not KEY=VALUE" in bad.stderr
    (seg,) = [p for p in (tmp_path / "data").iterdir() if p.name.startswith("q.")
              and "read" not in p.name]
    dump = subprocess.run([str(QUEUED), "dump", str(seg)], capture_output=True, text=True,
                          timeout=WAIT, check=True).stdout
    shown = [line for line in dump.splitlines() if " PUT " in line]
    assert f"headers=[traceparent={TRACEPARENT}, n=1]" in shown[0]
    assert "headers=" not in shown[1]


# -- a crash ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_headers_survive_sigkill_and_restart(server_proc: ServerProcess) -> None:
    server_proc.start()
    sent = [(b"item-%d" % i, {"i": str(i), "t": TRACEPARENT} if i % 2 else {})
            for i in range(40)]
    with Client(f"{HOST}:{server_proc.rpc}") as c:
        for k in range(0, len(sent), 10):  # acknowledged puts, idempotent and not
            batch = sent[k:k + 10]
            assert c.put("q", [d for d, _ in batch], headers=[h for _, h in batch]) == 10
        c.put("later", [b"delayed"], headers=TRACE, delay_ms=1)
        (opened,) = c.get("q", 1, auto_abort_ms=60_000, with_headers=True)
        assert opened.headers == {}
        server_proc.signal(signal.SIGKILL)
        server_proc.wait()
    server_proc.start()
    with Client(f"{HOST}:{server_proc.rpc}") as c:
        got = c.get("q", 100, 5000, with_headers=True)
        later = c.get("later", 1, 5000, with_headers=True)
    assert [(it.data, it.headers) for it in got] == sent
    assert [(it.data, it.headers) for it in later] == [(b"delayed", TRACE)]
