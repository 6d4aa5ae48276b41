"""Pipelined writer rounds under fsync "always" (issue 15): a round of appends writes and
starts its fsync while the round before it is still in its fsync, and is acknowledged
only after that round and after its own fsync.

Held fsyncs (a FileIO that holds the first fsync in its thread until the test lets it
go) show the overlap and the order; a failed fsync fails the rounds that overlapped it;
a simulated power cut (tests/power_util.py), taken again and again while many appenders
keep the pipeline full, finds every append acknowledged before the cut. The SIGKILL test
of a real server under load is in tests/test_server_restart.py.
"""

from __future__ import annotations

import errno
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from power_util import Cut, PowerLossFS

from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.core import journal_format as jf
from queued.core.errors import JournalWriteError
from queued.storage import fileio
from queued.storage.datadir import DataDir, open_data_dir
from queued.storage.journal import QueueJournal
from queued.storage.writer import PIPELINE_DEPTH

T0 = 1_700_000_000_000
ALWAYS = JournalConfig(fsync=FsyncPolicy.parse("always"))
#: Bound on every wait for the other thread (a hung test fails instead of hanging).
BOUND_S = 10.0


class HeldFsync(fileio.FileIO):
    """Holds the first fsync after `hold()` until `release()`; then it succeeds, or fails
    with EIO if `fail`. Other fsyncs go through (counted in `passed`)."""

    def __init__(self) -> None:
        self.armed = False
        self.fail = False
        self.held = threading.Event()  # the held fsync has begun
        self._go = threading.Event()
        self.passed = 0

    def hold(self, *, fail: bool = False) -> None:
        self.armed, self.fail = True, fail

    def release(self) -> None:
        self._go.set()

    def fsync(self, fd: int) -> None:
        if self.armed:
            self.armed = False
            self.held.set()
            self._go.wait(BOUND_S)
            if self.fail:
                raise OSError(errno.EIO, "Input/output error")
        else:
            self.passed += 1
        super().fsync(fd)


@pytest.fixture
def held() -> Iterator[HeldFsync]:
    io = HeldFsync()
    previous = fileio.use(io)
    try:
        yield io
    finally:
        io.release()
        fileio.use(previous)


def puts_in(data_dir: Path) -> list[bytes]:
    return [d.record.data for seg in sorted(data_dir.glob("q.[0-9]*"))
            for d in jf.decode_all(seg.read_bytes()) if isinstance(d.record, jf.Put)]


async def until(check: object, what: str) -> None:
    """Poll `check()` (another thread's progress) until true, within BOUND_S."""
    with trio.fail_after(BOUND_S):
        while not check():  # type: ignore[operator]
            await trio.sleep(0.001)
    assert check(), what  # type: ignore[operator]


async def two_overlapping_appends(
    held: HeldFsync, j: QueueJournal, nursery: trio.Nursery, done: list[str],
    errors: dict[str, BaseException], data_dir: Path, *, fail: bool,
) -> None:
    """Append `b` (its round's fsync is held), then `c` (written and fsynced meanwhile)."""
    async def append(data: bytes) -> None:
        try:
            await j.append([data], T0)
            done.append(data.decode())
        except JournalWriteError as exc:
            errors[data.decode()] = exc

    held.hold(fail=fail)
    nursery.start_soon(append, b"b")
    await until(held.held.is_set, "the first round's fsync began")
    passed = held.passed
    nursery.start_soon(append, b"c")
    await until(lambda: b"c" in puts_in(data_dir), "the second round wrote")
    await until(lambda: held.passed > passed, "the second round's fsync ran")
    await trio.testing.wait_all_tasks_blocked()
    assert done == [] and errors == {}, "acknowledged before the held fsync returned"


async def test_a_round_writes_while_the_one_before_fsyncs_and_is_acked_after_it(
        tmp_path: Path, held: HeldFsync) -> None:
    done: list[str] = []
    errors: dict[str, BaseException] = {}
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)  # opens the segment: a round of its own
        rounds = dd.statistics().rounds
        async with trio.open_nursery() as nursery:
            await two_overlapping_appends(held, j, nursery, done, errors, tmp_path,
                                          fail=False)
            held.release()
        assert sorted(done) == ["b", "c"] and errors == {}
        assert dd.statistics().rounds == rounds + 2
        assert [s.count for s in j.segments] == [3]
    assert puts_in(tmp_path) == [b"a", b"b", b"c"]
    assert DataDir.open(tmp_path).queues["q"].last_id == 3


async def test_a_failed_fsync_fails_the_rounds_that_overlapped_it(
        tmp_path: Path, held: HeldFsync) -> None:
    """The second round's own fsync succeeded, but after a failed fsync nothing later in
    that file can be trusted: neither append is acknowledged, the queue refuses writes."""
    done: list[str] = []
    errors: dict[str, BaseException] = {}
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)
        async with trio.open_nursery() as nursery:
            await two_overlapping_appends(held, j, nursery, done, errors, tmp_path,
                                          fail=True)
            held.release()
        assert done == [] and sorted(errors) == ["b", "c"]
        assert j.failed is not None
        with pytest.raises(JournalWriteError):
            await j.append([b"d"], T0)
        assert [s.count for s in j.segments] == [1]  # only what was acknowledged


async def test_rounds_pipeline_no_deeper_than_the_limit(
        tmp_path: Path, held: HeldFsync) -> None:
    """With the first round held in its fsync, at most PIPELINE_DEPTH rounds are under
    way; what comes after waits and goes into one round once a slot frees."""
    async with open_data_dir(tmp_path, DataDirConfig(), lambda _: ALWAYS) as dd:
        j = dd.queue("q")
        await j.append([b"a"], T0)
        rounds = dd.statistics().rounds
        acked: list[int] = []

        async def append(n: int) -> None:
            await j.append([b"%d" % n], T0)
            acked.append(n)

        async with trio.open_nursery() as nursery:
            held.hold()
            nursery.start_soon(append, 0)
            await until(held.held.is_set, "the first round's fsync began")
            for n in range(1, 12):
                nursery.start_soon(append, n)
                await trio.testing.wait_all_tasks_blocked()
            assert acked == []
            held.release()
        assert sorted(acked) == list(range(12))  # (tasks woken together run in any order)
        # depth rounds, then the rest (queued meanwhile) in one
        assert dd.statistics().rounds == rounds + PIPELINE_DEPTH + 1
    assert puts_in(tmp_path) == [b"a", *(b"%d" % n for n in range(12))]


def recovered_ids(cut: Cut, where: Path) -> set[int]:
    """The ids recovery finds in the disk state `cut` (written out into `where`)."""
    [entries] = cut.values()
    where.mkdir()
    for name, data in entries.items():
        (where / name).write_bytes(data)
    q = DataDir.open(where).queues.get("q")
    return set() if q is None else {p.id for p in q.iter_puts()}


async def test_a_power_cut_keeps_every_append_acknowledged_before_it(tmp_path: Path) -> None:
    """Eight appenders, started one after another, keep rounds overlapping (each fsync
    takes 1 ms; small segments: rotations too, which wait for the pipeline to empty);
    the power is cut again and again, each time from the event loop, where the
    acknowledgements land: every id acknowledged before a cut is in it. That rounds did
    overlap is checked (WriterStats.overlapped), or the test would show nothing."""
    data = tmp_path / "data"
    data.mkdir()
    fs = PowerLossFS(data, fsync_delay=0.001)
    previous = fileio.use(fs)
    cuts: list[tuple[set[int], Cut]] = []
    acked: set[int] = set()
    rng = random.Random(15)
    cfg = JournalConfig(fsync=FsyncPolicy.parse("always"), journal_size=16 * 1024)
    try:
        async with open_data_dir(data, DataDirConfig(), lambda _: cfg) as dd:
            j = dd.queue("q")

            async def appender(k: int) -> None:
                for n in range(60):
                    puts = await j.append([b"%d-%d" % (k, n) * (1 + n % 7)], T0)
                    acked.update(p.id for p in puts)

            async with trio.open_nursery() as nursery:
                for k in range(8):
                    nursery.start_soon(appender, k)
                    await trio.sleep(0.0005)  # staggered: each lands in another round
                for _ in range(25):
                    await trio.sleep(rng.random() * 0.004)
                    cuts.append((set(acked), fs.cut()))
        assert len(acked) == 8 * 60
        assert dd.statistics().rounds < 8 * 60, "no round carried more than one append"
        overlapped = dd._writer.statistics().overlapped
        print("rounds", dd.statistics().rounds, "overlapped", overlapped)
        assert overlapped > 0, "no round started while another was under way"
    finally:
        fileio.use(previous)
    assert fs.bypasses == []
    for i, (before, cut) in enumerate(cuts):
        missing = before - recovered_ids(cut, tmp_path / f"cut{i}")
        assert not missing, f"cut {i}: acknowledged ids lost: {sorted(missing)[:10]}"
    shutil.rmtree(tmp_path / "data")
