"""Review of idle-queue parking (branch `park`): what parking and loading must keep,
tried on a real in-process server (real sockets on port 0, real files).

Each test parks by the server's own parker (park_after 100 ms) or by hand with
Registry.park, and checks one thing a park or a load could lose or leave behind.
Every wait is a bounded loop on a condition.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
from pathlib import Path

import trio
from server_util import WAIT, Conn, ServerProcess, data_files, http_get, pymc, running
from test_parking import VOLATILE, cfg, parked, wait_until

from queued.reader.open_reads import OpenReads


def open_files_under(path: Path) -> list[str]:
    """This process's open file descriptors that point into `path`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd)
        if target.startswith(str(path)):
            found.append(os.path.basename(target))
    return found


def alive(ids: set[int]) -> list[str]:
    """Which of the objects `ids` names are still there (QueueState and co. have
    __slots__ without __weakref__: looked for among the objects gc tracks)."""
    gc.collect()
    kinds = {"QueueState", "QueueJournal", "LiveReader", "Reader"}
    return [type(o).__name__ for o in gc.get_objects()
            if id(o) in ids and type(o).__name__ in kinds]


async def test_parked_queue_state_is_freed_and_its_files_closed(tmp_path: Path) -> None:
    """Nothing keeps a parked queue's QueueState, handles or journal alive, and none of
    its files stay open."""
    data = tmp_path / "data"
    toml = '[queues.fd]\nmax_journal_size = "1MiB"\n'  # (its journal holds qs.before_drop)
    async with running(cfg(tmp_path, toml, fsync="always")) as server:
        conn = await Conn.open(server.ports["memcache"])
        for i in range(3):
            assert await conn.set("fd", b"x%d" % i) == b"STORED"
        assert await conn.get("fd") == b"x0"
        assert await conn.get("fd+a") == b"x1"  # takes over the default reader
        assert await conn.get("fd+b") is None  # a second reader, its own file
        assert await conn.set("fd", b"x3") == b"STORED"
        qs = server.broker.queues["fd"]
        ids = {id(qs), id(qs.journal), *(id(h) for h in qs.readers.values()),
               *(id(h.reader) for h in qs.readers.values())}
        assert len(alive(ids)) == 6
        assert any(n.startswith("fd.") for n in open_files_under(data))
        del qs
        await parked(server, "fd")
        assert alive(ids) == []
        assert not [n for n in open_files_under(data) if n.startswith("fd.")]
        assert await conn.get("fd+a") == b"x2"  # and it loads again
        assert await conn.get("fd+b") == b"x3"
        await conn.aclose()


async def test_stats_and_journal_figures_agree_parked_and_loaded(tmp_path: Path) -> None:
    """A fanout queue after a takeover: `stats` fields and the /metrics journal figures
    are the same loaded, parked and loaded again (but the memory figures and ages)."""
    async with running(cfg(tmp_path, fsync="always")) as server:
        b = server.broker
        conn = await Conn.open(server.ports["memcache"])
        for i in range(4):
            assert await conn.set("fan", b"x%d" % i) == b"STORED"
        assert await conn.get("fan") == b"x0"
        assert await conn.get("fan+a") == b"x1"  # takes over the default reader
        assert await conn.get("fan+b") is None
        assert await conn.set("fan", b"x4") == b"STORED"

        def view() -> tuple[list[tuple[str, dict[str, int]]], dict[str, object]]:
            fields, journal = b.queue_view("fan")
            keep = {"segments", "bytes", "last_id", "fsyncs", "write_errors", "failed",
                    "readers"}
            return ([(r, {k: v for k, v in f.items() if k not in VOLATILE})
                     for r, f in fields],
                    {k: v for k, v in dataclasses.asdict(journal).items() if k in keep})

        await wait_until(lambda: not any(h.reader.dirty
                                         for h in b.queues["fan"].readers.values()))
        before = view()
        await parked(server, "fan")
        assert view() == before
        assert b.has_reader("fan", "a") and b.reader_count("fan") == 2
        b.registry.unpark("fan")
        assert view() == before
        await conn.aclose()


async def test_recovery_report_survives_parking(tmp_path: Path) -> None:
    """What the start-up recovery cut from a torn tail (queued_recovery_truncated_bytes)
    is still reported once that queue has parked."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path, park_after=0)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("torn", b"x") == b"STORED"
        await conn.aclose()
    (segment,) = [n for n in os.listdir(data) if n.startswith("torn.") and ".read" not in n]
    with open(data / segment, "ab") as f:
        f.write(b"\x00\x01\x02\x03\x04\x05\x06")  # a torn append after the last batch
    async with running(cfg(tmp_path)) as server:
        cut = server.broker.datadir.statistics().truncated_bytes
        assert cut > 0
        await parked(server, "torn")
        assert server.broker.datadir.statistics().truncated_bytes == cut
        assert server.broker.datadir.report.records >= 1


async def test_error_counts_and_confirms_survive_park(tmp_path: Path) -> None:
    """Aborted reads keep their error counts, confirmed reads stay gone, across a park
    and a load (and a second one); ids keep rising."""
    async with running(cfg(tmp_path)) as server:
        b = server.broker
        await b.put("err", [b"a", b"b", b"c"])
        client = b.register(OpenReads())
        a = await b.get("err", client=client, open=True)
        bb = await b.get("err", client=client, open=True)
        assert a is not None and bb is not None
        assert b.abort(client, "err", ids=[a.id]) == 1
        assert b.confirm(client, "err", ids=[bb.id]) == 1
        again = await b.get("err", client=client, open=True)
        assert again is not None and again.id == a.id and again.error_count == 1
        assert b.abort(client, "err", ids=[a.id]) == 1
        for _ in range(2):
            await parked(server, "err")
            await b.put("err", [b"d"])
        got = await b.get_many("err", max_items=10)
        assert [(it.data, it.error_count) for it in got] == [
            (b"a", 2), (b"c", 0), (b"d", 0), (b"d", 0)]
        ids = [it.id for it in got]
        assert ids == sorted(set(ids)) and bb.id not in ids


async def test_delete_of_a_parked_queue_racing_a_put_of_the_same_name(tmp_path: Path) -> None:
    """`delete q` of a parked queue forgets it at once, then removes its files: a put
    of q meanwhile makes a new queue, whose acknowledged item must survive."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path, park_after="1h")) as server:
        b = server.broker
        await b.put("dq", [b"old"])
        qs = b.queues["dq"]
        qs.used = False
        assert await b.registry.park(qs)
        del qs
        acked: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.delete, "dq")
            for _ in range(100):  # a few scheduling rounds: the delete starts at once
                if "dq" not in b.registry.parked:
                    break
                await trio.lowlevel.checkpoint()
            assert "dq" not in b.registry.parked  # the delete is under way
            acked.append(await b.put("dq", [b"new"]))
        assert acked == [1]
        assert any(n.startswith("dq.") and ".read" not in n for n in os.listdir(data))
        got = await b.get("dq")
        assert got is not None and got.data == b"new"


async def test_sweep_does_not_expire_items_of_a_queue_parked_meanwhile(tmp_path: Path) -> None:
    """The expiry sweep walks a list of the queues taken before it awaits (deleting a
    queue past max_queue_age); a queue parked during that await must not be swept from
    its stale state: its expired items would move to expire_to_queue from a state
    nobody saves, and again from its files when it loads (twice in the target)."""
    toml = ('[queues.old]\nmax_queue_age = "10ms"\n'
            '[queues.y]\nmax_age = "20ms"\nexpire_to_queue = "dead"\n')
    async with running(cfg(tmp_path, toml, park_after="1h")) as server:
        b = server.broker
        await b.put("old", [b"o"])
        assert (await b.get("old")) is not None  # empty: the sweep deletes it
        await b.put("y", [b"e1", b"e2"])
        await b.checkpoint_all()
        put_at = b.clock()
        await wait_until(lambda: b.clock() > put_at + 30)  # y's items are past max_age
        y = b.queues["y"]
        y.used = False
        lock = b.datadir._writer._lock
        # The writer held, as a round would: the park waits first, the sweep's delete next.
        async with trio.open_nursery() as nursery, b.datadir._writer.paused():
            nursery.start_soon(b.registry.park, y)
            await wait_until(lambda: lock.statistics().tasks_waiting == 1)
            nursery.start_soon(b.sweep)  # its delete of `old` waits behind the park
            await wait_until(lambda: lock.statistics().tasks_waiting == 2)
        assert "old" not in b.queues and "y" in b.registry.parked
        del y
        for _ in range(3):  # loads y: its items expire (now, from its files)
            assert await b.get("y") is None

        def moved() -> int:
            return sum(f["items"] for n, f in b.queue_stats() if n == "dead")
        await wait_until(lambda: moved() >= 2)
        for _ in range(20):  # (a move of the stale state may land a little later)
            await trio.sleep(0.01)
        got = await b.get_many("dead", max_items=10)
        assert sorted(it.data for it in got) == [b"e1", b"e2"]


async def test_console_page_of_a_parked_queue_that_cannot_load(tmp_path: Path) -> None:
    """The console's page of a parked queue whose files are gone answers an error (as
    the protocols do) and the server goes on serving."""
    data = tmp_path / "data"
    async with running(cfg(tmp_path)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("gone", b"x") == b"STORED"
        await parked(server, "gone")
        for name in os.listdir(data):
            if name.startswith("gone.") and ".read" not in name:
                (data / name).unlink()
        status, _, body = await trio.to_thread.run_sync(
            http_get, server.ports["http"], "/api/queues/gone")
        assert status == 503 and b"loading it from disk failed" in body
        assert await conn.set("other", b"y") == b"STORED"
        await conn.aclose()


def test_sigkill_after_park_load_put_cycles_recovers_in_order(tmp_path: Path) -> None:
    """Park, load by a get and a put (a new segment each time), park again, a few times;
    then SIGKILL: the restarted server has exactly the unconsumed items, in order."""
    from test_parking import _deadline, _server

    def wait_parked(proc: ServerProcess) -> None:
        with _deadline(WAIT) as left:
            while left():
                _, _, body = http_get(proc.http, "/metrics")
                if re.search(rb"^queued_parked_queues 1\.0$", body, re.M):
                    return
        raise AssertionError("never parked")

    for proc in _server(tmp_path):
        proc.start()
        client = pymc(proc.memcache)
        expect: list[bytes] = []
        for cycle in range(4):
            for i in range(3):
                assert client.set("cyc", b"%d-%d" % (cycle, i))
                expect.append(b"%d-%d" % (cycle, i))
            assert client.get("cyc") == expect.pop(0)
            wait_parked(proc)
        segments = [n for n in data_files(tmp_path / "data")
                    if n.startswith("cyc.") and ".read" not in n]
        assert 1 <= len(segments) <= 4  # compaction keeps up with the new segments
        client.close()
        proc.kill()
        proc.start()
        client = pymc(proc.memcache)
        got = [client.get("cyc") for _ in range(len(expect) + 1)]
        client.close()
        assert got == [*expect, None]


async def test_max_queues_counts_parked_readers(tmp_path: Path) -> None:
    """Fanout readers of a parked queue count towards max_queues: parking frees no room
    for new queues or readers, and loading it takes none."""
    async with running(cfg(tmp_path, max_queues=4)) as server:
        conn = await Conn.open(server.ports["memcache"])
        assert await conn.set("f", b"x") == b"STORED"
        assert await conn.get("f+a") == b"x"  # takes over: still one name
        assert await conn.get("f+b") is None
        assert await conn.get("f+c") is None  # f+a, f+b, f+c: three names
        assert await conn.set("g", b"x") == b"STORED"  # four
        await parked(server, "f", "g")
        assert server.broker.registry.names() == 4
        assert (await conn.set("h", b"x")).startswith(b"SERVER_ERROR")
        assert (await conn.cmd(b"get f+d")).startswith(b"SERVER_ERROR")  # loads f, no room
        assert "f" in server.broker.queues and server.broker.registry.names() == 4
        assert await conn.get("g") == b"x"
        await conn.aclose()
