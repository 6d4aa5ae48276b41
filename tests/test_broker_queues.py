"""One queue's state (queued.broker.queues.QueueState) and what an idle one holds:
containers made on first use or shared while empty, the reader lock dropped after a
checkpoint, `before_drop` and `unsaved_checkpoints` set when first needed, one
JournalConfig for equal settings, reloads that change only the queue they name.

Each test drives the real broker on a real data directory (open_broker, restarts
included), as tests/test_broker.py does: no mocks. What each one guards against is in
its docstring.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing
from server_util import Conn, running
from server_util import make_config as server_config
from wait_util import wait_until

import queued.storage.journal as journal_module
from queued.broker.broker import Broker
from queued.broker.queues import QueueState
from queued.broker.upkeep import open_broker
from queued.config import FsyncPolicy, ServerConfig, load_config
from queued.config.loading import reload_queue_configs
from queued.reader.open_reads import OpenReads
from queued.reader.shared import NO_ENTRIES, NO_IDS, NO_ITEMS
from queued.storage.files import NO_CHECKPOINT, Checkpoint

HOUR = 3_600_000


def make_config(tmp: Path, toml: str = "") -> ServerConfig:
    """A config on tmp/data with its file at tmp/queued.toml (rewritten to reload)."""
    path = tmp / "queued.toml"
    path.write_text(toml)
    return load_config({
        "data_dir": str(tmp / "data"), "memcache_port": 0, "text_port": 0, "rpc_port": 0,
        "http_port": 0, "fsync": "never", "checkpoint_interval": HOUR,
        "expiration_timer": HOUR, "config": str(path),
    }, env={})


def reload(broker: Broker, tmp: Path, toml: str) -> ServerConfig:
    """What the `reload` command does: re-read the file, apply the queue configs."""
    (tmp / "queued.toml").write_text(toml)
    config = reload_queue_configs(broker.config)
    broker.reconfigure(config)
    return config


def stats(broker: Broker, name: str) -> dict[str, int]:
    return dict(broker.queue_stats())[name]


async def get_all(broker: Broker, queue: str, reader: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(10_000):
        it = await broker.get(queue, reader)
        if it is None:
            return out
        out.append(it.data)
    raise AssertionError("the queue never ran dry")


async def settle(done: Callable[[], bool]) -> None:
    """Let background work (a move to error_queue: a put, then a writer round in a
    thread) finish: bounded in count and time."""
    await wait_until(done, why="background work finished")


def p100(i: int) -> bytes:
    return b"%03d" % i + b"." * 97


def assert_untouched(qs: QueueState) -> None:
    """Every container of an unused queue is still the shared empty one."""
    for h in qs.readers.values():
        r = h.reader
        assert (r.open, r.moving, r.errors, r.delays, r.parked) == ({},) * 5
        assert r.done == set() and list(r.delayed) == []
    assert not qs.unsaved_checkpoints


def assert_shared_still_empty() -> None:
    assert not NO_ENTRIES and not NO_IDS and not NO_ITEMS
    assert not journal_module.NO_ENTRIES and not journal_module.NO_CHUNKS
    assert Checkpoint() == NO_CHECKPOINT


# -- shared empty containers: no state leaks from one queue into another ---------------------


async def test_reliable_reads_errors_delays_and_moves_stay_in_their_queue(
    tmp_path: Path,
) -> None:
    """Open reads, aborts with error counts and delays, moves to error_queue, flushes and
    confirms out of order on queue `a` fill its reader's own containers: queue `b`
    (made before and after) keeps the shared empty ones, and a restart recovers `a`'s
    error counts and delays and nothing for `b`."""
    cfg = make_config(tmp_path, '[queues.a]\nerror_queue = "dead"\nmax_errors = 2\n')
    async with open_broker(cfg) as broker:
        assert await broker.get("b") is None
        await broker.put("a", [b"%d" % i for i in range(1, 9)])
        c = broker.register(OpenReads())
        for _ in range(6):
            assert await broker.get("a", client=c, open=True) is not None
        broker.confirm(c, "a", ids=[2, 4])  # out of order: `done` gets ids
        broker.abort(c, "a", ids=[1])  # error count 1
        broker.abort(c, "a", ids=[3], delay_ms=60_000)  # delayed, error count 1
        assert await broker.get("c") is None  # a queue made in the middle of it
        assert broker.flush("b") == 0
        # id 5 aborted twice in all: its second abort moves it to `dead`
        broker.abort(c, "a", ids=[5])
        assert (await broker.get("a", client=c, open=True)).data == b"5"  # type: ignore[union-attr]
        broker.abort(c, "a", ids=[5])
        await settle(lambda: not broker.queues["a"].readers[""].reader.moving)  # moved
        a = broker.queues["a"].readers[""].reader
        assert a.errors and a.delays and a.open and a.delayed
        for name in ("b", "c"):
            assert_untouched(broker.queues[name])
        assert_shared_still_empty()
        await broker.checkpoint_all()
        for name in ("b", "c"):
            assert_untouched(broker.queues[name])
        assert_shared_still_empty()
        assert await get_all(broker, "dead") == [b"5"]
    async with open_broker(cfg) as broker:
        a = broker.queues["a"].readers[""].reader
        assert dict(a.errors) == {1: 1, 3: 1} and list(a.delays) == [3]
        assert await get_all(broker, "a") == [b"1", b"6", b"7", b"8"]  # 3 still delayed
        assert_untouched(broker.queues["b"])
        assert stats(broker, "b")["items"] == 0
        assert_shared_still_empty()


async def test_a_flush_with_open_reads_keeps_its_ids_in_its_own_reader(tmp_path: Path) -> None:
    """flush() with open reads writes the flushed ids into `done` (made on first use):
    they must not end up in the shared empty set another queue's reader holds, and the
    restart must not deliver the flushed items again."""
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        assert await broker.get("idle") is None
        await broker.put("f", [b"1", b"2", b"3", b"4"])
        c = broker.register(OpenReads())
        assert (await broker.get("f", client=c, open=True)).data == b"1"  # type: ignore[union-attr]
        assert broker.flush("f") == 3
        assert broker.queues["f"].readers[""].reader.done == {2, 3, 4}
        assert_untouched(broker.queues["idle"])
        assert_shared_still_empty()
        broker.confirm(c, "f")
        await broker.checkpoint_all()
        assert_shared_still_empty()
    async with open_broker(cfg) as broker:
        assert await get_all(broker, "f") == []
        assert await get_all(broker, "idle") == []


# -- one JournalConfig for equal settings: a reload changes only the queues it names --------


async def test_reload_changes_only_the_queue_it_names(tmp_path: Path) -> None:
    """Queues without a section share one JournalConfig: a reload that gives `a` its own
    fsync and journal sizes must leave `b`'s config, its segment file's fsync and its
    reader files' fsync as they were; a reload back makes `a` equal to `b` again."""
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        for name in ("a", "b"):
            await broker.put(name, [b"x"])
            assert await broker.get(name) is not None
        await broker.checkpoint_all()  # reader files exist: their fsync must follow too
        ja, jb = broker.queues["a"].journal, broker.queues["b"].journal
        assert ja.config is jb.config
        before = jb.config
        reload(broker, tmp_path, '[queues.a]\nfsync = "always"\nmax_journal_size = 9000\n'
                                 'journal_size = 3000\njournal_full_policy = "drop_oldest"\n')
        always = FsyncPolicy.parse("always")
        assert ja.config.fsync == always and ja.config.max_journal_size == 9000
        assert jb.config is before and jb.config.max_journal_size == 0
        assert all(f.fsync == always for f in ja.files())
        assert all(f.fsync == before.fsync for f in jb.files())
        reload(broker, tmp_path, "")
        assert ja.config is jb.config is before
        assert all(f.fsync == before.fsync for f in ja.files())


async def test_a_queue_made_after_a_reload_gets_the_reloaded_journal_settings(
    tmp_path: Path,
) -> None:
    """A reload that adds a section for a queue not made yet: once made, its journal must
    follow that section (max_journal_size, drop_oldest), as the queue's own config does.
    Found here (not made by qmem): the data dir asked the start-up config for a new
    queue's journal settings, so they stayed unbounded until the next reload."""
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        reload(broker, tmp_path, "[queues.q]\njournal_size = 1000\nmax_journal_size = 3000\n"
                                 'journal_full_policy = "drop_oldest"\n')
        for i in range(60):
            await broker.put("q", [p100(i)])
        qs = broker.queues["q"]
        assert qs.config.max_journal_size == 3000
        assert qs.journal.config.max_journal_size == 3000, "journal settings of the old config"
        assert qs.journal.total_bytes <= 3000
        s = stats(broker, "q")
        assert s["discarded"] == 60 - s["items"] > 0
        got = await get_all(broker, "q")
        assert got == [p100(i) for i in range(60 - len(got), 60)]


# -- before_drop set on first need: drops after a reload keep every reader's counts right ------


async def test_drop_oldest_turned_on_by_a_reload_keeps_counts_right(tmp_path: Path) -> None:
    """A queue with a backlog and two readers, made with no journal bound: a reload sets
    max_journal_size with drop_oldest. The next put drops segments, and each reader's
    items/bytes must lose exactly what was dropped (the hook that subtracts them is set
    only when first needed): a missed hook leaves counts that no get can bring to 0."""
    cfg = make_config(tmp_path, "[queues.q]\njournal_size = 1000\nmax_memory_size = 350\n")
    async with open_broker(cfg) as broker:
        assert await broker.get("q", "r1") is None and await broker.get("q", "r2") is None
        for i in range(40):
            await broker.put("q", [p100(i)])
        assert await broker.get("q", "r2") is not None
        reload(broker, tmp_path, "[queues.q]\njournal_size = 1000\nmax_memory_size = 350\n"
                                 'max_journal_size = 3000\njournal_full_policy = "drop_oldest"\n')
        for i in range(40, 50):
            await broker.put("q", [p100(i)])
        assert broker.queues["q"].journal.total_bytes <= 3000
        for reader in ("r1", "r2"):
            s = stats(broker, f"q+{reader}")
            assert s["bytes"] == 100 * s["items"]
            got = await get_all(broker, "q", reader)
            assert len(got) == s["items"] and got[-1] == p100(49)
            assert stats(broker, f"q+{reader}")["items"] == 0


# -- the reader lock, dropped after a checkpoint unless held or waited for ---------------------


async def test_checkpoints_and_takeovers_never_share_the_critical_section(
    tmp_path: Path,
) -> None:
    """A checkpoint drops the queue's reader lock after it, unless another task holds or
    waits for it. Checkpoints (forced and not), takeovers by the first named reader,
    new readers and deletes of readers all race here; the lock they get must be one at
    a time: a second lock made while the first is held would let two takeovers both
    take the default reader (KeyError) or a checkpoint write the default reader's file
    after the takeover removed it. Then a restart must find each reader where it was."""
    cfg = make_config(tmp_path)
    n = 30
    async with open_broker(cfg) as broker:
        for k in range(6):
            q = f"q{k}"
            await broker.put(q, [b"%d" % i for i in range(n)])
            assert await broker.get(q) is not None  # dirty: the checkpoint takes the lock
        holders: list[int] = []
        overlaps: list[tuple[int, int]] = []

        async def hold(q: str, who: int) -> None:
            # A task of this test that takes the queue's reader lock as the broker does,
            # and checks nobody replaced it while held (that would let others in).
            qs = broker.queues[q]
            lock = qs.reader_lock
            async with lock:
                if holders:
                    overlaps.append((holders[0], who))
                holders.append(who)
                for _ in range(3):
                    await trio.sleep(0)
                    if qs.reader_lock is not lock:
                        overlaps.append((-1, who))
                holders.remove(who)

        async def work(k: int) -> None:
            q = f"q{k}"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold, q, 0)
                nursery.start_soon(broker.queues[q].write_checkpoints)
                nursery.start_soon(broker.get, q, "a")  # takeover of the default reader
                nursery.start_soon(partial(broker.queues[q].write_checkpoints, force=True))
                nursery.start_soon(broker.get, q, "b")  # a second reader
                nursery.start_soon(hold, q, 1)
                nursery.start_soon(broker.checkpoint_all)
                nursery.start_soon(broker.get, q, "a")

        for k in range(6):
            await work(k)
        assert not overlaps
        for k in range(6):
            qs = broker.queues[f"q{k}"]
            assert set(qs.readers) == {"a", "b"}
            # whichever came first took the default reader over; the other is new
            assert sorted(h.aliases for h in qs.readers.values()) == [frozenset(), {""}]
        taken = {f"q{k}+{r}": stats(broker, f"q{k}+{r}")["items"]
                 for k in range(6) for r in "ab"}
        await broker.checkpoint_all(force=True)
        for k in range(6):
            assert broker.queues[f"q{k}"]._reader_lock is None  # dropped once idle
    async with open_broker(cfg) as broker:
        for k in range(6):
            q = f"q{k}"
            assert set(broker.queues[q].readers) == {"a", "b"}
            for r in "ab":
                assert stats(broker, f"{q}+{r}")["items"] == taken[f"{q}+{r}"]


async def test_a_delete_racing_a_checkpoint_leaves_no_files(tmp_path: Path) -> None:
    """Deleting a queue while its checkpoint is being written (and its compaction may run)
    removes every file of it; a queue of the same name made afterwards starts empty."""
    cfg = make_config(tmp_path, "[queues.q]\njournal_size = 1000\n")
    async with open_broker(cfg) as broker:
        for _ in range(5):
            for i in range(30):
                await broker.put("q", [p100(i)])
            for _ in range(25):
                assert await broker.get("q") is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(broker.checkpoint_all)
                nursery.start_soon(broker.delete, "q")
            assert "q" not in broker.queues
            data = Path(broker.config.data_dir)
            left = [p.name for p in data.iterdir() if p.name.startswith("q.")]
            assert left == []
            assert await broker.get("q") is None
    async with open_broker(cfg) as broker:
        assert await get_all(broker, "q") == []


# -- unsaved checkpoints: the dict made on the first failure, emptied by the next success -----


def chattr(flag: str, path: Path) -> None:
    try:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True,
                              timeout=20, check=False)
    except OSError as exc:
        pytest.skip(f"no chattr here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot change a directory's immutable flag here: {done.stderr.strip()}")


async def test_a_failed_checkpoint_is_listed_until_one_succeeds(tmp_path: Path) -> None:
    """A checkpoint that cannot be written (an immutable data dir: no new file, by root
    either) is listed for its queue only; the next checkpoint that succeeds takes it off
    and the reader's position is durable after all."""
    cfg = make_config(tmp_path)
    async with open_broker(cfg) as broker:
        for name in ("a", "b"):
            await broker.put(name, [b"1", b"2"])
        assert await broker.get("a") is not None
        data = Path(cfg.data_dir)
        chattr("+i", data)
        try:
            assert await broker.checkpoint_all() == 0
        finally:
            chattr("-i", data)
        assert set(broker.queues["a"].unsaved_checkpoints) == {""}
        assert not broker.queues["b"].unsaved_checkpoints
        assert_shared_still_empty()
        assert await broker.checkpoint_all() == 1
        assert not broker.queues["a"].unsaved_checkpoints
    async with open_broker(cfg) as broker:
        assert await get_all(broker, "a") == [b"2"]
        assert await get_all(broker, "b") == [b"1", b"2"]


async def test_a_reload_over_the_wire_bounds_the_journal_of_a_queue_made_after_it(
    tmp_path: Path,
) -> None:
    """The same through a real server and memcache connection: `reload` adds a bounded
    journal for `q`, then the first `set` makes `q`; its journal stays under the bound
    and the oldest items are dropped (with the start-up settings it grew unbounded)."""
    data = tmp_path / "data"
    config = server_config(data, "", fsync="never")
    assert config.config_file is not None
    async with running(config) as server:
        c = await Conn.open(server.ports["memcache"])
        try:
            config.config_file.write_text(
                "[queues.q]\njournal_size = 1000\nmax_journal_size = 3000\n"
                'journal_full_policy = "drop_oldest"\n')
            assert await c.cmd(b"reload") == b"Reloaded config."
            for i in range(60):
                assert await c.set("q", p100(i)) == b"STORED"
            s = await c.stats()
            assert int(s["queue_q_logsize"]) <= 3000, s["queue_q_logsize"]
            assert int(s["queue_q_discarded"]) == 60 - int(s["queue_q_items"]) > 0
            assert await c.get("q") == p100(60 - int(s["queue_q_items"]))
        finally:
            await c.aclose()
