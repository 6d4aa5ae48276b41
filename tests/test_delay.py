"""Delayed delivery: a put or an abort with a delay keeps the item invisible until it is due.

Real servers on 127.0.0.1 port 0 with real clients (raw memcache and text sockets, the
Python client over MessagePack-RPC), a subprocess SIGKILLed and restarted on its data
directory, the pure reader against its own model, and the journal read back by a reader
written from seeds/002 alone, which skips the DELAY record (command 5) as it skips any
command it does not know.

Timing: no test asserts that something happened quickly. "Never early" is checked
against the clock read before the put (an item may come late on a loaded machine,
never before its due time); long polls give each due item several seconds.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_util import seed_reader
from server_util import (
    HOST,
    QUEUED,
    WAIT,
    Conn,
    ServerProcess,
    http_get,
    in_thread,
    make_config,
    rpc_call,
    running,
)

from queued.client import Client
from queued.errors import CorruptRecordError
from queued.journal import format as jf
from queued.reader.state import Reader
from queued.storage.files import decode_checkpoint
from queued.storage.journal_scan import scan_segment

DELAY = 300  # ms: long enough to see an item hidden, short enough for a quick suite


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def get_value(conn: Conn, key: str) -> bytes | None:
    await conn.send(b"get %s\r\n" % key.encode())
    first = await conn.line()
    if first == b"END":
        return None
    size = int(first.split(b" ")[3])
    data = await conn.exactly(size + 2)
    assert await conn.line() == b"END"
    return data[:-2]


async def stat(conn: Conn, queue: str, field: str) -> int:
    await conn.send(b"stats\r\n")
    lines = await conn.lines_until(b"END")
    key = f"STAT queue_{queue}_{field} ".encode()
    (line,) = [ln for ln in lines if ln.startswith(key)]
    return int(line.split(b" ")[2])


# -- memcache ----------------------------------------------------------------------------------


async def test_memcache_set_with_delay_is_hidden_until_due(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        before = now_ms()
        assert await conn.cmd(b"set q/delay=%d 0 0 5\r\nlater" % DELAY) == b"STORED"
        assert await conn.cmd(b"set q 0 0 3\r\nnow") == b"STORED"
        assert await get_value(conn, "q") == b"now"
        assert await get_value(conn, "q") is None  # not due: invisible to a get
        assert await get_value(conn, "q/peek") is None  # and to a peek
        assert await stat(conn, "q", "delayed") == 1
        assert await stat(conn, "q", "items") == 1  # it is in the queue all the same
        got = await get_value(conn, "q/t=5000")  # a long poll wakes when it falls due
        arrived = now_ms()
        assert got == b"later"
        assert arrived >= before + DELAY
        assert await stat(conn, "q", "delayed") == 0
        assert await get_value(conn, "q") is None
        await conn.aclose()


async def test_memcache_get_abort_with_delay_and_bad_delays(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.cmd(b"set q 0 0 3\r\njob") == b"STORED"
        assert await get_value(conn, "q/open") == b"job"
        before = now_ms()
        assert await get_value(conn, f"q/abort/delay={DELAY}") is None
        assert await get_value(conn, "q") is None  # back off: hidden for the delay
        assert await get_value(conn, "q/t=5000") == b"job"
        assert now_ms() >= before + DELAY
        for bad, why in ((b"-1", b"delay out of range"), (b"x", b"bad delay"),
                         (b"99999999999999999999", b"delay out of range")):
            reply = await conn.cmd(b"set q/delay=%s 0 0 1\r\nz" % bad)
            assert reply == b"CLIENT_ERROR " + why, reply
        assert await conn.cmd(b"set q/later=5 0 0 1\r\nz") == (
            b"CLIENT_ERROR unknown or repeated set option (delay=<ms>, key=<k>)")
        assert await get_value(conn, "q") is None  # the refused sets stored nothing
        # delay= on a get only goes with abort (Kestrel closes on bad get options)
        assert await conn.cmd(b"get q/delay=5") == b"CLIENT_ERROR delay=<ms> goes only with abort"
        await conn.aclose()


# -- text and RPC ----------------------------------------------------------------------------


async def test_text_put_with_delay(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["text"], b"\n")
        before = now_ms()
        await conn.send(b"put q delay=%d:\nlater\n\n" % DELAY)
        assert await conn.line() == b"+1"
        await conn.send(b"get q\n")
        assert await conn.line() == b"*"  # nothing visible yet
        await conn.send(b"get q 5000\n")
        assert await conn.line() == b":later"
        assert now_ms() >= before + DELAY
        await conn.send(b"put q 1000 delay=-3:\nx\n\n")
        assert (await conn.line()).startswith(b"-")
        await conn.aclose()


async def test_rpc_put_delays_deliver_in_due_order_ties_in_put_order(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        port = server.ports["rpc"]

        def work() -> tuple[list[tuple[bytes, int]], int]:
            with Client(f"{HOST}:{port}", read_timeout=WAIT) as client:
                before = now_ms()
                for data, delay in ((b"c", 3 * DELAY), (b"a1", DELAY), (b"b", 2 * DELAY),
                                    (b"a2", DELAY)):
                    assert client.put("q", [data], delay_ms=delay) == 1
                assert client.put("q", [b"plain"]) == 1  # three params on the wire
                got: list[tuple[bytes, int]] = []
                for _ in range(5):
                    (it,) = client.get("q", 1, 5000)
                    got.append((it.data, now_ms() - before))
                assert client.get("q", 10) == []
                with pytest.raises(ValueError, match="delay_ms"):
                    client.put("q", [b"no"], delay_ms=-1)
                return got, before

        got, _ = await in_thread(work)
        bad = [await in_thread(lambda p=p: rpc_call(port, "put", ["q", [b"z"], 0, 0, p]))
               for p in (-1, "soon", jf.MAX_DELAY_MS + 1)]
    assert [d for d, _ in got] == [b"plain", b"a1", b"a2", b"b", b"c"]
    due = {b"plain": 0, b"a1": DELAY, b"a2": DELAY, b"b": 2 * DELAY, b"c": 3 * DELAY}
    assert all(at >= due[d] for d, at in got), got  # none early
    assert all(err[0] == 3 and "delay_ms" in err[1] and res is None for err, res in bad), bad


async def test_rpc_abort_with_delay_keeps_error_count_and_dead_letters(tmp_path: Path) -> None:
    toml = '[queues.q]\nerror_queue = "dead"\nmax_errors = 2\n'
    async with running(make_config(tmp_path / "data", toml)) as server:
        port = server.ports["rpc"]

        def work() -> tuple[list[bytes], list[bytes], int]:
            with Client(f"{HOST}:{port}", read_timeout=WAIT) as client:
                client.put("q", [b"job"])
                (it,) = client.get("q", 1, 0, 60_000)
                before = now_ms()
                assert client.abort([it], delay_ms=DELAY) == 1  # error count 1
                assert client.get("q", 1) == []  # backing off
                (it2,) = client.get("q", 1, 5000, 60_000)
                late = now_ms() - before
                # The second abort reaches max_errors (the count was kept through the
                # delay): dead-lettered at once, delay or not.
                assert client.abort([it2], delay_ms=10 * DELAY) == 1
                dead = client.get("dead", 1, 5000)
                left = client.get("q", 1)
                return [d.data for d in dead], [d.data for d in left], late

        dead, left, late = await in_thread(work)
    assert dead == [b"job"]
    assert left == []
    assert late >= DELAY


# -- fanout, read-behind, stats and metrics --------------------------------------------------


async def test_fanout_readers_and_read_behind_and_metrics(tmp_path: Path) -> None:
    # 1 KiB of memory for q: most delayed items' data stays on disk and is read back by id
    toml = '[queues.q]\nmax_memory_size = "1KiB"\n'
    async with running(make_config(tmp_path / "data", toml)) as server:
        port, http = server.ports["rpc"], server.ports["http"]
        n = 60

        def work() -> tuple[list[bytes], list[bytes], list[bytes], str, str]:
            with Client(f"{HOST}:{port}", read_timeout=WAIT) as client:
                for reader in ("q+main", "q+audit"):  # two fanout readers
                    client.get(reader, 1)
                before = now_ms()
                # ids ascend, due times descend by group: due order is not id order
                for g in range(3):
                    items = [b"%03d" % k + b"." * 100 for k in range(g * 20, g * 20 + 20)]
                    client.put("q", items, delay_ms=DELAY * (3 - g))
                _, _, page = http_get(http, "/metrics")
                metrics = page.decode()
                stats = http_get(http, "/stats.json")[2].decode()
                main = [it.data[:3] for it in _drain(client, "q+main", n)]
                audit = [it.data[:3] for it in _drain(client, "q+audit", n)]
                assert now_ms() - before >= DELAY
                return main, audit, sorted(main), metrics, stats

        main, audit, _, metrics, stats = await in_thread(work)
    expected = [b"%03d" % k for k in sorted(range(n), key=lambda k: (-(k // 20), k))]
    assert main == expected
    assert audit == expected
    assert f'queued_delayed_items{{queue="q",reader="main"}} {float(n)}' in metrics
    assert f'queued_delayed_items{{queue="q",reader="audit"}} {float(n)}' in metrics
    assert f'"delayed": {n}' in stats or f'"delayed":{n}' in stats


def _drain(client: Client, queue: str, n: int) -> list:  # type: ignore[type-arg]
    out = []
    for _ in range(n):
        got = client.get(queue, 1, 5000)
        assert got, f"{queue}: only {len(out)} of {n} items came"
        out.extend(got)
    return out


# -- restart and SIGKILL ---------------------------------------------------------------------


async def test_delays_survive_a_clean_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cfg = make_config(data)
    async with running(cfg) as server:
        conn = await Conn.open(server.ports["memcache"])
        before = now_ms()
        assert await conn.cmd(b"set q/delay=1500 0 0 4\r\nslow") == b"STORED"
        assert await conn.cmd(b"set q/delay=%d 0 0 4\r\nfast" % DELAY) == b"STORED"
        assert await conn.cmd(b"set q 0 0 3\r\njob") == b"STORED"
        assert await get_value(conn, "q/open") == b"job"
        assert await get_value(conn, "q/abort/delay=1200") is None
        await conn.aclose()
    async with running(make_config(data)) as server:
        conn = await Conn.open(server.ports["memcache"])
        got = []
        for _ in range(3):
            value = await get_value(conn, "q/t=5000")
            got.append((value, now_ms() - before))
        assert await get_value(conn, "q/t=300") is None
        await conn.aclose()
    assert [v for v, _ in got] == [b"fast", b"job", b"slow"]
    assert got[0][1] >= DELAY and got[1][1] >= 1200 and got[2][1] >= 1500, got


@pytest.mark.slow
def test_delays_survive_sigkill_each_due_item_once_none_early(
    server_proc: ServerProcess,
) -> None:
    server_proc.start()
    before = now_ms()
    due: dict[bytes, int] = {}
    with Client(f"{HOST}:{server_proc.rpc}", read_timeout=WAIT) as client:
        for k in range(20):
            delay = [DELAY, 1500, 0, 900][k % 4]
            data = b"item-%d" % k
            assert client.put("q", [data], delay_ms=delay) == 1  # acknowledged: durable
            due[data] = delay
        (it,) = client.get("q", 1, 0, 60_000)  # item-2 (no delay): an open read
        due[it.data] = now_ms() - before + 1000  # (read before the server's clock is)
        assert client.abort([it], delay_ms=1000) == 1  # durable once acknowledged
    server_proc.signal(signal.SIGKILL)
    server_proc.wait()
    server_proc.start()
    got: list[tuple[bytes, int]] = []
    with Client(f"{HOST}:{server_proc.rpc}", read_timeout=WAIT) as client:
        for _ in range(20):
            (it,) = client.get("q", 1, 5000)
            got.append((it.data, now_ms() - before))
        assert client.get("q", 1, 300) == []
    assert Counter(d for d, _ in got) == Counter(due.keys())  # each exactly once
    early = [(d, at, due[d]) for d, at in got if at < due[d]]
    assert not early


# -- the journal on disk -----------------------------------------------------------------------


async def test_seed_readers_dump_check_and_the_spark_scanner_read_delay_records(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    async with running(make_config(data)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.cmd(b"set q/delay=60000 7 0 5\r\nitem0") == b"STORED"  # flags too
        assert await conn.cmd(b"set q 0 0 5\r\nitem1") == b"STORED"
        assert await conn.cmd(b"set q/delay=60000 0 0 5\r\nitem2") == b"STORED"
        assert await get_value(conn, "q") == b"item1"
        await conn.aclose()
    (seg,) = [p for p in data.iterdir() if p.name.startswith("q.") and "read" not in p.name]
    puts, skipped = seed_reader(seg.read_bytes())
    assert puts == [(1, 0, b"item0"), (2, 0, b"item1"), (3, 0, b"item2")]
    # FLAGS, DELAY, checks, INCARNATION: every one an extension record (command 13).
    assert skipped == Counter({13: 1 + 2 + 5 + 1})
    ours = [d.record for d in jf.decode_all(seg.read_bytes()) if isinstance(d.record, jf.Put)]
    assert [type(p) for p in ours] == [jf.DelayedPut, jf.Put, jf.DelayedPut]
    assert ours[0].flags == 7
    dump = subprocess.run([str(QUEUED), "dump", str(seg)], capture_output=True, text=True,
                          timeout=WAIT, check=False)
    shown = [line for line in dump.stdout.splitlines() if " PUT " in line]
    assert [" due=" in line for line in shown] == [True, False, True]
    check = subprocess.run([str(QUEUED), "check", str(data)], capture_output=True, text=True,
                           timeout=WAIT, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # The Spark source's scanner reads them as plain PUTs, flags kept.
    cols = [chunk.columns() for chunk in scan_segment(seg)]
    assert [(i, d, f) for c in cols for i, d, f in zip(c.ids, c.data, c.flags, strict=True)] == [
        (1, b"item0", 7), (2, b"item1", 0), (3, b"item2", 0)]


# -- the pure reader and the records -------------------------------------------------------


class Limits:
    max_items = 0
    max_size = 0
    max_memory_size = 10
    discard_old_when_full = False


def test_reader_orders_by_due_time_and_checkpoints_around_delayed_items() -> None:
    r = Reader("q", "", Limits())
    r.add([jf.DelayedPut(1, b"a", 0, due_ms=500), jf.Put(2, b"b", 0),
           jf.DelayedPut(3, b"cccccccccccc", 0, due_ms=200),  # over memory: data on disk
           jf.DelayedPut(4, b"d", 0, due_ms=200)])
    assert (r.items, r.delayed_count) == (4, 3)
    assert r.take(100, []) == jf.Put(2, b"b", 0)
    r.consume(2)
    assert r.take(199, []) is None  # nothing due
    assert r.checkpoint() == (0, [2])  # id 1 still waits: 2 is listed as done
    assert r.take(200, []) is None  # 3 is due first, but its data is on disk
    assert r.fetch_ids(10) == [3]
    assert r.fetched([jf.DelayedPut(3, b"cccccccccccc", 0, due_ms=200)], [3]) == 0
    assert [r.take(200, []).id, r.take(200, []).id] == [3, 4]  # type: ignore[union-attr]
    r.consume(3)
    r.consume(4)
    assert r.take(499, []) is None and r.take(500, []).id == 1  # type: ignore[union-attr]
    r.consume(1)
    assert r.checkpoint() == (4, [])
    assert r.delay_low is None and (r.items, r.bytes, r.mem_bytes) == (0, 0, 0)


def test_reader_abort_with_delay_and_what_a_restart_restores() -> None:
    r = Reader("q", "", Limits())
    r.add([jf.Put(1, b"a", 0), jf.Put(2, b"b", 0)])
    it = r.take(0, [])
    assert it is not None
    r.open_read(it)
    back = r.abort(1, count_error=True)
    assert back is not None
    r.delay_back(back, 1000)
    assert r.take(10, []).id == 2  # type: ignore[union-attr]
    r.consume(2)
    head, done = r.checkpoint()
    assert (head, done, r.delay_entries(), r.error_counts()) == (0, [2], [(1, 1000)], [(1, 1)])
    blob = jf.encode_checkpoint(head, done, r.error_counts(), r.delay_entries())
    cp, _ = decode_checkpoint(blob)
    assert (cp.head, cp.done, cp.errors, cp.delays) == (0, (2,), ((1, 1),), ((1, 1000),))
    # a restart: the heap is rebuilt from the journal and the checkpoint
    again = Reader("q", "", Limits(), head=cp.head, done=cp.done, errors=cp.errors,
                   delays=cp.delays, tail=2)
    again.restore([], 1, 1, 1)
    again.restore_delayed([(1000, 1, 1)])
    again.load(1, [jf.Put(1, b"a", 0), jf.Put(2, b"b", 0)], 3)  # read-behind skips it
    assert again.take(999, []) is None
    assert again.fetch_ids(5) == []
    assert again.take(1000, []) is None and again.fetch_ids(5) == [1]
    again.fetched([jf.Put(1, b"a", 0)], [1])
    item = again.take(1000, [])
    assert item is not None and (item.id, item.error_count) == (1, 1)


PUT_HI = "86 02000000 00000000 0500000000000000 e803000000000000 6869"


@pytest.mark.parametrize(("record", "hexbytes"), [
    (jf.DelayedPut(5, b"hi", 1000, due_ms=2000), "d1 09000000 03 d007000000000000 " + PUT_HI),
    (jf.DelayedPut(5, b"hi", 1000, flags=16, due_ms=2000),
     "d1 05000000 02 10000000 d1 09000000 03 d007000000000000 " + PUT_HI),
])
def test_golden_delayed_puts(record: jf.Put, hexbytes: str) -> None:
    blob = bytes.fromhex(hexbytes.replace(" ", ""))
    assert jf.encode_put(record) == blob
    (got,) = jf.decode_all(jf.WRITER_MAGIC + blob)
    assert got.record == record and type(got.record) is jf.DelayedPut


@pytest.mark.parametrize(("record", "hexbytes"), [
    (jf.DelayedPut(5, b"hi", 1000, due_ms=2000), "52 d007000000000000 " + PUT_HI),
    (jf.DelayedPut(5, b"hi", 1000, flags=16, due_ms=2000),
     "41 10000000 52 d007000000000000 " + PUT_HI),
    (jf.DelayedPut(5, b"hi", 1000, flags=16, due_ms=2000),  # forms mixed: still one item
     "41 10000000 d1 09000000 03 d007000000000000 " + PUT_HI),
])
def test_delayed_puts_of_earlier_releases_still_decode(record: jf.Put, hexbytes: str) -> None:
    blob = jf.WRITER_MAGIC + bytes.fromhex(hexbytes.replace(" ", ""))
    (got,) = jf.decode_all(blob)
    assert got.record == record and type(got.record) is jf.DelayedPut
    sealed = jf.WRITER_MAGIC + jf.EMPTY_CHECK + jf.seal(blob[4:], 18)
    dec = jf.RecordDecoder()
    dec.receive_data(sealed)
    dec.receive_data(b"")
    offsets: list[int] = []
    delays: dict[int, int] = {}
    flags: dict[int, int] = {}
    assert isinstance(dec.next_batch(offsets), jf.Batch)  # the empty check
    batch = dec.next_batch(offsets, flags, delays)
    assert isinstance(batch, jf.Batch) and batch.delayed == 1
    (put_at,) = offsets
    assert delays == {put_at: 2000} and flags.get(put_at, 0) == record.flags


@pytest.mark.parametrize("after", ["02 0100000000000000", "72 00000000 00000000", "00"])
def test_delay_record_not_followed_by_a_put_is_corrupt(after: str) -> None:
    blob = jf.WRITER_MAGIC + bytes.fromhex("52 d007000000000000" + after.replace(" ", ""))
    with pytest.raises(CorruptRecordError, match="DELAY record followed by"):
        jf.decode_all(blob)
    dec = jf.RecordDecoder()
    dec.receive_data(jf.WRITER_MAGIC + bytes.fromhex("00" * 9).replace(b"\x00", b"\x52", 1)
                     + bytes(8) + bytes.fromhex(after.replace(" ", "")))
    dec.receive_data(b"")
    with pytest.raises(CorruptRecordError):
        dec.next_batch()


def test_read_delays_record_round_trips() -> None:
    rec = jf.ReadDelays(((3, 1700000000000), (9, 5)))
    blob = jf.encode_record(rec)
    assert blob[0] == 0xA1
    (got,) = jf.decode_all(jf.READER_MAGIC + blob, jf.FileKind.READER)
    assert got.record == rec


def test_journal_page_delay_record_example_is_true() -> None:
    """The FLAGS, DELAY and PUT records docs/journal.md shows for `hi`, due at 2000 ms."""
    page = (Path(__file__).parent.parent / "docs" / "journal.md").read_text()
    section = page.split("## The delay record")[1].split("```")[1]
    shown = "".join(line.split("  ")[0].replace(" ", "") for line in section.splitlines())
    record = jf.DelayedPut(5, b"hi", 1000, flags=16, due_ms=2000)
    assert jf.encode_put(record).hex() == shown
    assert "| 3 | **DELAY** |" in page and "`0x52` + `i64` (9)" in page


async def test_spark_writer_option_delay_ms(tmp_path: Path) -> None:
    """The writer's write() called directly, as a Spark task does, on an Arrow batch."""
    pa = pytest.importorskip("pyarrow")
    types = pytest.importorskip("pyspark.sql.types")
    from queued.spark import QueuedDataSourceError
    from queued.spark.sink import QueuedWriter

    schema = types.StructType([types.StructField("data", types.BinaryType())])
    async with running(make_config(tmp_path / "data")) as server:
        addr = f"{HOST}:{server.ports['rpc']}"
        for bad in ("-1", "soon", str(jf.MAX_DELAY_MS + 1)):
            with pytest.raises(QueuedDataSourceError, match="option delay_ms must be"):
                QueuedWriter({"server": addr, "queue": "s", "delay_ms": bad}, schema)
        writer = QueuedWriter({"server": addr, "queue": "s", "delay_ms": str(DELAY)}, schema)

        def work() -> tuple[list[bytes], list[bytes], int]:
            before = now_ms()
            writer.write(iter([pa.RecordBatch.from_pydict({"data": [b"r1", b"r2"]})]))
            with Client(addr, read_timeout=WAIT) as client:
                hidden = [it.data for it in client.get("s", 10)]
                first = client.get("s", 10, 5000)
                late = now_ms() - before
                rest = client.get("s", 10, 1000) if len(first) < 2 else []
            return hidden, [it.data for it in first + rest], late

        hidden, got, late = await in_thread(work)
    assert hidden == []
    assert got == [b"r1", b"r2"]
    assert late >= DELAY


async def test_cli_put_delay(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        addr = f"{HOST}:{server.ports['rpc']}"

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(QUEUED), *args], capture_output=True, text=True,
                                  timeout=WAIT, check=False)

        def work() -> tuple[list[subprocess.CompletedProcess[str]], list[bytes], int]:
            bad = [cli("put", "--server", addr, "--delay", d, "q", "x")
                   for d in ("-1", "soon", str(jf.MAX_DELAY_MS + 1))]
            before = now_ms()
            ok = cli("put", "--server", addr, "--delay", str(DELAY), "q", "later")
            with Client(addr, read_timeout=WAIT) as client:
                hidden = client.get("q", 10)
                (it,) = client.get("q", 1, 5000)
            return [*bad, ok], [i.data for i in hidden] + [it.data], now_ms() - before

        runs, got, late = await in_thread(work)
    *bad, ok = runs
    assert all(r.returncode == 2 and "--delay" in r.stderr for r in bad), bad
    assert ok.returncode == 0, ok.stderr
    assert got == [b"later"]
    assert late >= DELAY


def _read_back(r: Reader, store: dict[int, jf.Put]) -> None:
    """What the broker does in a worker thread: due items' data by id, then read-behind."""
    ids = r.fetch_ids(100)
    if ids:
        r.fetched([store[i] for i in ids], ids)
    if r.behind is not None and not r.mem_count:
        start = r.behind
        r.load(start, [store[i] for i in range(start, r.tail + 1)], r.tail + 1)


def _take(r: Reader, store: dict[int, jf.Put], now: int) -> jf.Put | None:
    """A get: take; when nothing is in memory, read back (as take_now does) and retry."""
    for _ in range(3):
        it = r.take(now, [])
        if it is not None or not (r.wants_fetch() or r.behind is not None):
            return it
        _read_back(r, store)
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "put", "take", "tick", "checkpoint",
                                            "abort"]),
                          st.integers(0, 50), st.integers(0, 30)), max_size=60))
def test_reader_never_early_each_once_and_checkpoints_stay_true(
    ops: list[tuple[str, int, int]],
) -> None:
    """The pure reader against a model: an item is never taken before it is due, every
    item is taken once (aborted ones again), and every checkpoint names exactly the
    consumed ids (<= head or in done); data is read back by id when not kept."""
    r = Reader("q", "", Limits())
    now = next_id = 0
    store: dict[int, jf.Put] = {}  # the journal
    due: dict[int, int] = {}
    consumed: set[int] = set()
    opened: list[jf.Put] = []
    for op, a, b in ops:
        if op == "put":
            next_id += 1
            data = b"x" * (b % 7)
            it = (jf.DelayedPut(next_id, data, now, due_ms=now + a) if a % 3 else
                  jf.Put(next_id, data, now))
            store[it.id] = it
            due[it.id] = now + a if a % 3 else now
            r.add([it])
        elif op == "tick":
            now += a
        elif op == "abort" and opened:
            it = opened.pop()
            back = r.abort(it.id, count_error=True)
            assert back is not None
            if b % 2:
                r.delay_back(back, now + b)
                due[it.id] = now + b
            else:
                r.put_back(back)
        elif op == "checkpoint":
            head, done = r.checkpoint()
            outstanding = set(store) - consumed
            assert all(i <= head or i in done for i in consumed)
            assert not any(i <= head or i in done for i in outstanding)
        else:
            it = _take(r, store, now)
            if it is None:
                continue
            assert due[it.id] <= now, (it.id, due[it.id], now)
            r.open_read(it)
            if a % 2:
                opened.append(it)
            else:
                assert r.confirm(it.id)
                consumed.add(it.id)
    # drain: everything left comes, once, when due
    for it in opened:
        r.confirm(it.id)
        consumed.add(it.id)
    now += 10_000
    for _ in range(len(store) + 1):
        it = _take(r, store, now)
        if it is None:
            break
        assert it.id not in consumed
        r.consume(it.id)
        consumed.add(it.id)
    assert consumed == set(store)
    assert (r.items, r.bytes, r.mem_bytes, r.delayed_count) == (0, 0, 0, 0)
    head, done = r.checkpoint()
    assert head == next_id and done == []


# -- found in review: takeover, unsealed segments, read-back budget ---------------------------


def test_a_named_reader_taking_over_keeps_abort_delays_across_sigkill(tmp_path: Path) -> None:
    """The first named reader takes over the default reader's file: the due time an abort
    gave must move with it (it was dropped: after a crash the item came 59 s early)."""
    p = ServerProcess(tmp_path / "data", tmp_path / "log")
    try:
        p.start()
        with Client(f"{HOST}:{p.rpc}", read_timeout=WAIT) as c:
            c.put("q", [b"job"])
            (it,) = c.get("q", 1, 0, 60_000)
            c.abort([it], delay_ms=60_000)
            assert c.get("q+named", 1) == []  # takes over the default reader; not due
        p.signal(signal.SIGKILL)
        p.wait()
        p.start()
        with Client(f"{HOST}:{p.rpc}", read_timeout=WAIT) as c:
            assert c.get("q+named", 1, 500) == []  # still a minute to wait
            assert c.peek("q+named").stats["delayed"] == 1
    finally:
        p.kill()


def test_a_delayed_item_in_an_unsealed_segment_is_delivered_when_due(tmp_path: Path) -> None:
    """A segment without check records (the seed writer's, or a tool's) holding a delayed
    put: recovery must hand the item to the delay heap (it was never delivered)."""
    data = tmp_path / "data"
    data.mkdir()
    now = now_ms()
    due = now + 4000  # (past the server's start on a loaded machine: it must still wait)
    (data / "q.1").write_bytes(
        jf.WRITER_MAGIC + jf.encode_put(jf.DelayedPut(1, b"delayed", now, None, 0, 0, due))
        + jf.encode_put(jf.Put(2, b"plain", now, None, 0, 0)))
    p = ServerProcess(data, tmp_path / "log")
    try:
        p.start()
        with Client(f"{HOST}:{p.rpc}", read_timeout=WAIT) as c:
            assert [i.data for i in c.get("q", 1, 0)] == [b"plain"]
            if now_ms() < due:
                assert c.get("q", 1, 0) == []  # not due yet
            assert [i.data for i in c.get("q", 1, 10_000)] == [b"delayed"]
            assert now_ms() >= due
    finally:
        p.kill()


def test_due_items_read_back_from_disk_keep_to_the_memory_budget() -> None:
    from dataclasses import replace

    from queued.config.settings import QueueConfig
    cfg = replace(QueueConfig(), max_memory_size=4096)
    r = Reader("q", "", cfg, tail=200)
    store = {i: jf.DelayedPut(i, b"x" * 1000, 0, None, 0, 0, 100) for i in range(1, 201)}
    r.restore([], 1, 200, 200_000)  # after a restart: everything on disk
    r.restore_delayed([(100, i, 1000) for i in store])
    r.promote(100)
    ids = r.fetch_ids(10_000)
    assert 1 <= len(ids) <= 5
    r.fetched([store[i] for i in ids], ids)
    assert r.mem_bytes <= 5000
