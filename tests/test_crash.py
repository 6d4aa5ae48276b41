"""Crash tests: a real driver process (tests/crash_driver.py) is killed with SIGKILL.

What the driver printed before it died (its stdout goes to a file, one flushed
line per acknowledged append / checkpoint / compaction) is what it was promised;
recovery (`DataDir.open`) must keep every promise: acknowledged items present
with their exact bytes, ids strictly increasing, checkpoints intact and not older
than the last acknowledged one, compaction never losing nor duplicating an item
a durable checkpoint still needs. SIGKILL keeps the page cache, so these tests
prove the logic of torn tails, temp files, rotation and crash-safe compaction,
not the fsync calls themselves (test_full_disk covers the write-error paths).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import crash_driver as drv
import pytest

from queued.config import DataDirConfig, FsyncPolicy, JournalConfig
from queued.journal import format as jf
from queued.storage import fileio
from queued.storage.datadir import DataDir
from queued.storage.journal import QueueJournal, wait_durable
from queued.storage.opening import open_data_dir

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("crash_driver.py")
Q = drv.QUEUE
#: Hard bound on one driver run, from start to kill (the driver bounds itself too).
RUN_TIMEOUT = 60.0  # generous: a loaded CI machine is slow to start Python


class Run:
    """Lines a killed driver wrote, complete lines only (a torn last line is dropped)."""

    def __init__(self, lines: list[list[str]], exited: int | None, stderr: str) -> None:
        self.lines = lines
        self.exited = exited  # exit status if the driver ended before the kill
        self.stderr = stderr

    def acked_ids(self) -> list[int]:
        return [int(x) for parts in self.lines if parts[0] == "A" for x in parts[1:]]

    def of(self, kind: str) -> list[list[str]]:
        return [parts[1:] for parts in self.lines if parts[0] == kind]


def _read_lines(path: Path) -> list[list[str]]:
    text = path.read_bytes().decode()
    complete = text[: text.rfind("\n") + 1]
    return [line.split() for line in complete.splitlines() if line]


def run_and_kill(
    tmp_path: Path,
    mode: str,
    kill_when: Callable[[list[list[str]]], bool],
    *args: str,
    jitter: float = 0.0,
    name: str = "run",
) -> tuple[Path, Run]:
    """Start the driver on a fresh data dir, SIGKILL it once `kill_when(lines)` holds."""
    datadir = tmp_path / f"{name}-data"
    out_path = tmp_path / f"{name}.out"
    err_path = tmp_path / f"{name}.err"
    cmd = [sys.executable, str(DRIVER), mode, str(datadir), "--seconds", "12", *args]
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=DRIVER.parent)
    exited: int | None = None
    try:
        started = time.monotonic()
        while True:
            status = proc.poll()
            lines = _read_lines(out_path)
            if kill_when(lines):
                if jitter:
                    time.sleep(jitter)
                break
            if status is not None:
                exited = status
                break
            if time.monotonic() - started > RUN_TIMEOUT:
                pytest.fail(f"driver {mode} did not reach its kill point in {RUN_TIMEOUT}s")
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    if exited is None and proc.returncode != -signal.SIGKILL:
        exited = proc.returncode  # it ended on its own between the check and the kill
    run = Run(_read_lines(out_path), exited, err_path.read_text())
    if exited not in (None, 0):
        pytest.fail(f"driver {mode} exited with {exited}:\n{run.stderr}")
    return datadir, run


def temp_files(datadir: Path) -> list[str]:
    return [n for n in os.listdir(datadir) if jf.TEMP_MARK in n]


def check_segments(q: QueueJournal) -> list[int]:
    """Segment id ranges do not overlap; every put has its exact data; ids strictly increase."""
    numbers = [s.number for s in q.segments]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    prev_last = 0
    for seg in q.segments:
        if seg.count:
            assert seg.first_id > prev_last, (
                f"{seg.path.name} starts at {seg.first_id}, not after {prev_last}"
            )
            assert seg.last_id >= seg.first_id
            prev_last = seg.last_id
    ids: list[int] = []
    for put in q.iter_puts(1):
        assert put.data == drv.data_for(put.id), f"item {put.id} has wrong data"
        assert not ids or put.id > ids[-1], f"id {put.id} after {ids[-1]}"
        ids.append(put.id)
    assert len(ids) == sum(s.count for s in q.segments)
    return ids


# -- append -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kill_after", "journal_size", "fsync"),
    [
        (1, 4096, "always"),
        (150, 4096, "always"),
        (700, 2048, "always"),
        (1500, 8192, "always"),
        (1000, 3000, "never"),
    ],
)
def test_sigkill_during_appends_keeps_every_acknowledged_item(
    tmp_path: Path, kill_after: int, journal_size: int, fsync: str
) -> None:
    """Acknowledged items survive SIGKILL at any point, across segment rotations."""
    rng = random.Random(kill_after)
    datadir, run = run_and_kill(
        tmp_path, "append",
        lambda lines: sum(len(p) - 1 for p in lines if p[0] == "A") >= kill_after,
        "--journal-size", str(journal_size), "--fsync", fsync, "--seed", str(kill_after),
        jitter=rng.random() * 0.01,
    )
    assert run.exited is None, "the driver finished before its kill point"
    acked = run.acked_ids()
    assert len(acked) >= kill_after
    assert len(set(acked)) == len(acked), "the driver was given an id twice"

    dd = DataDir.open(datadir)
    assert temp_files(datadir) == []
    q = dd.queues[Q]
    ids = check_segments(q)
    if sum(len(drv.data_for(i)) + 34 for i in ids) > 3 * journal_size:
        assert len(q.segments) > 2, "journal_size is small: segments must have rotated"
    missing = set(acked) - set(ids)
    assert not missing, f"{len(missing)} acknowledged ids lost, e.g. {sorted(missing)[:10]}"
    # Nothing that was not written by the driver: ids are a gap-free prefix up to the
    # last one recovered (every append in the driver either completed or was in flight).
    assert ids == list(range(1, len(ids) + 1))
    assert q.last_id >= max(acked)


async def test_recovered_journal_accepts_appends_after_a_kill(tmp_path: Path) -> None:
    """After SIGKILL and recovery the writer resumes: new ids follow, old items stay."""
    datadir, run = run_and_kill(
        tmp_path, "append",
        lambda lines: sum(len(p) - 1 for p in lines if p[0] == "A") >= 300,
        "--journal-size", "2048",
    )
    acked = set(run.acked_ids())
    cfg = JournalConfig(journal_size=2048, fsync=FsyncPolicy.parse("always"))
    async with open_data_dir(datadir, DataDirConfig(), lambda _n: cfg) as dd:
        q = dd.queue(Q)
        before = q.last_id
        puts = await q.append([drv.data_for(before + k + 1) for k in range(50)], 1)
        assert [p.id for p in puts] == list(range(before + 1, before + 51))
    dd2 = DataDir.open(datadir)
    assert dd2.report.truncated_bytes == 0, "a clean shutdown leaves nothing to cut"
    ids = check_segments(dd2.queues[Q])
    assert acked <= set(ids)
    assert ids[-50:] == list(range(before + 1, before + 51))


# -- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("kill_after", [1, 40, 250])
def test_sigkill_during_checkpoints_keeps_an_intact_recent_checkpoint(
    tmp_path: Path, kill_after: int
) -> None:
    """The recovered checkpoint is whole and at least the last acknowledged one."""
    rng = random.Random(kill_after)
    datadir, run = run_and_kill(
        tmp_path, "checkpoint",
        lambda lines: sum(1 for p in lines if p[0] == "C") >= kill_after,
        "--max-items", "3000", "--seed", str(kill_after),
        jitter=rng.random() * 0.005,
    )
    assert run.exited is None, "the driver finished before its kill point"
    left_temps = temp_files(datadir)
    dd = DataDir.open(datadir)
    assert temp_files(datadir) == [], "recovery must remove ~~ temp files"
    rep = dd.report.queues[Q]
    assert rep.temps_removed == len(left_temps)
    assert rep.unreadable_checkpoints == []
    q = dd.queues[Q]
    for reader in ("", "r1"):
        tag = reader or "-"
        acked = [int(h) for r, h in run.of("C") if r == tag]
        attempted = {int(h) for r, h in run.of("c") if r == tag}
        cp = q.readers.get(reader)
        if cp is None:
            # Never checkpointed: no file, so no reader (the default one is only
            # implied when a queue has no checkpoint file at all).
            assert not acked, f"reader {reader!r} checkpoint lost"
            continue
        if not acked and cp.head == 0:
            continue  # the default reader before its first checkpoint
        assert cp.head in attempted, f"reader {reader!r}: head {cp.head} was never written"
        assert cp.head >= max(acked, default=0), (
            f"reader {reader!r}: recovered head {cp.head} older than acknowledged "
            f"{max(acked)}"
        )
        assert cp.done == drv.checkpoint_done(cp.head), "checkpoint done ids mixed or torn"
    acked_items = set(run.acked_ids())
    assert acked_items <= set(check_segments(q))


# -- compaction ------------------------------------------------------------------------


def needed_ids(q: QueueJournal, acked: set[int]) -> set[int]:
    readers = [(cp.head, set(cp.done)) for cp in q.readers.values()]
    return {i for i in acked if any(i > h and i not in done for h, done in readers)}


@pytest.mark.parametrize("kill_after_rewrites", [1, 3, 8, 15])
def test_sigkill_during_compaction_loses_and_duplicates_nothing(
    tmp_path: Path, kill_after_rewrites: int
) -> None:
    """Killed while compacting under appends: every needed acknowledged item stays, once."""
    rng = random.Random(kill_after_rewrites)
    datadir, run = run_and_kill(
        tmp_path, "compact",
        lambda lines: sum(1 for p in lines if p[0] == "K" and int(p[2]) > 0)
        >= kill_after_rewrites,
        "--journal-size", "4096", "--tasks", "4", "--seed", str(kill_after_rewrites),
        jitter=rng.random() * 0.02,
    )
    assert run.exited is None, "the driver finished before its kill point"
    dd = DataDir.open(datadir)
    assert temp_files(datadir) == []
    q = dd.queues[Q]

    # The durable checkpoints are ones the driver wrote, not older than acknowledged.
    attempted = {(int(h), int(u)) for h, u in run.of("c")}
    acked_cps = [(int(h), int(u)) for h, u in run.of("C")]
    cp, cp1 = q.readers[""], q.readers["r1"]
    match = [(h, u) for h, u in attempted if h == cp.head and drv.straggler_done(h, u) == cp.done]
    assert match, f"default reader checkpoint head={cp.head} is not one the driver wrote"
    assert any(u == cp1.head for _, u in attempted) and cp1.done == ()
    if acked_cps:
        assert cp.head >= acked_cps[-1][0] and cp1.head >= acked_cps[-1][1]

    ids = check_segments(q)
    assert len(set(ids)) == len(ids)
    acked = set(run.acked_ids())
    needed = needed_ids(q, acked)
    assert needed, "the stragglers keep something needed"
    missing = needed - set(ids)
    assert not missing, f"compaction lost needed ids {sorted(missing)[:10]}"
    unconsumed = [p.id for p in q.iter_unconsumed("")]
    assert len(unconsumed) == len(set(unconsumed)), "an item would be delivered twice"
    done = set(cp.done)
    still_needed = {i for i in acked if i > cp.head and i not in done}
    assert still_needed <= set(unconsumed)
    assert all(i > cp.head and i not in done for i in unconsumed)


def _journal_config(_name: str) -> JournalConfig:
    return JournalConfig(journal_size=1024, fsync=FsyncPolicy.parse("always"))


async def _compact_with_originals_kept(datadir: Path) -> tuple[dict[str, bytes], set[int], str]:
    """Fill segments, leave stragglers, compact; return the originals' bytes from before."""
    async with open_data_dir(datadir, DataDirConfig(), _journal_config) as dd:
        q = dd.queue(Q)
        for _ in range(30):
            first = q.last_id + 1
            await q.append([drv.data_for(first + k) for k in range(10)], 1)
        last = q.last_id
        done = drv.straggler_done(0, last - 20)
        await q.write_checkpoint("", 0, done)
        originals = {p.name: p.read_bytes() for p in datadir.iterdir() if jf.parse_file_name(
            p.name) and jf.parse_file_name(p.name).role is jf.FileRole.SEGMENT}
        result = await q.compact()
        assert result.rewritten >= 2, result
        output = next(s for s in q.segments if s.compacted_from is not None)
        needed = {i for i in range(1, last + 1) if i not in set(done)}
        assert [p.id for p in q.iter_unconsumed("")] == sorted(needed)
    return originals, needed, output.path.name


async def test_crash_between_rename_and_retire_is_finished_by_recovery(tmp_path: Path) -> None:
    """Compaction output renamed in place, originals still there: recovery retires them."""
    datadir = tmp_path / "data"
    originals, needed, output_name = await _compact_with_originals_kept(datadir)
    output_number = jf.parse_file_name(output_name).number
    first_replaced = DataDir.open(datadir).queues[Q].segments[0].compacted_from
    assert first_replaced is not None
    # The crash came after the rename and before the run's other originals were
    # retired (dead segments were retired before the rewrite started).
    restored = [
        n for n in originals
        if first_replaced <= jf.parse_file_name(n).number < output_number
        and not (datadir / n).exists()
    ]
    assert restored, "compaction removed the originals it replaced"
    for name in restored:
        (datadir / name).write_bytes(originals[name])
    assert (datadir / output_name).read_bytes() != originals[output_name]

    dd = DataDir.open(datadir)
    for name in restored:
        assert not (datadir / name).exists(), f"replaced original {name} left in place"
    q = dd.queues[Q]
    ids = check_segments(q)
    assert len(ids) == len(set(ids))
    assert [p.id for p in q.iter_unconsumed("")] == sorted(needed)
    assert needed <= set(ids)
    # And it stays finished: a second recovery changes nothing.
    again = DataDir.open(datadir)
    assert [s.path.name for s in again.queues[Q].segments] == [s.path.name for s in q.segments]


async def test_crash_before_rename_keeps_the_originals(tmp_path: Path) -> None:
    """The rewritten segment still a `~~` temp: recovery drops it, originals serve reads."""
    datadir = tmp_path / "data"
    originals, needed, output_name = await _compact_with_originals_kept(datadir)
    output = (datadir / output_name).read_bytes()
    for name in os.listdir(datadir):
        if jf.parse_file_name(name).role is jf.FileRole.SEGMENT:
            (datadir / name).unlink()
    for name, data in originals.items():
        (datadir / name).write_bytes(data)
    (datadir / jf.temp_name(output_name)).write_bytes(output[: len(output) // 2])

    dd = DataDir.open(datadir)
    assert temp_files(datadir) == []
    assert sorted(os.listdir(datadir)) == sorted([*originals, jf.checkpoint_name(Q)])
    q = dd.queues[Q]
    ids = check_segments(q)
    assert ids == list(range(1, ids[-1] + 1))
    assert [p.id for p in q.iter_unconsumed("")] == sorted(needed)


async def test_compacting_twice_keeps_what_a_rewritten_segment_still_holds(
    tmp_path: Path,
) -> None:
    """A second compaction with the same checkpoints must not lose the stragglers.

    A rewritten segment holds only the needed ids of its range: the ids between
    them are exactly the reader's done ids. Counting done ids in [first_id, last_id]
    against the segment's count (as if its ids were contiguous) calls it dead.
    """
    datadir = tmp_path / "data"
    async with open_data_dir(datadir, DataDirConfig(), _journal_config) as dd:
        q = dd.queue(Q)
        for _ in range(30):
            first = q.last_id + 1
            await q.append([drv.data_for(first + k) for k in range(10)], 1)
        done = drv.straggler_done(0, q.last_id - 20)
        await q.write_checkpoint("", 0, done)
        expected = [p.id for p in q.iter_unconsumed("")]
        assert (await q.compact()).rewritten >= 2
        assert [p.id for p in q.iter_unconsumed("")] == expected
        rewritten = [s for s in q.segments if s.compacted_from is not None]
        assert rewritten and rewritten[0].count < rewritten[0].last_id - rewritten[0].first_id
        second = await q.compact()
        assert [p.id for p in q.iter_unconsumed("")] == expected, (
            f"second compaction {second} dropped needed items"
        )
    dd2 = DataDir.open(datadir)
    assert [p.id for p in dd2.queues[Q].iter_unconsumed("")] == expected


class FsyncTracker(fileio.FileIO):
    """The storage layer's file calls (queued.storage.fileio): which files hold unfsynced
    writes.

    SIGKILL keeps the page cache, so the subprocess tests cannot see a missing
    fsync; a power cut would. This records, per path, whether bytes were written
    (or cut) since its last fsync, including files closed in that state.
    """

    def __init__(self) -> None:
        self._paths: dict[int, str] = {}
        self.dirty: dict[str, bool] = {}
        self.closed_dirty: list[str] = []

    def open(self, path: fileio.StrPath, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self._paths[fd] = Path(path).name
        return fd

    def _wrote(self, fd: int, n: int) -> int:
        if fd in self._paths and n:
            self.dirty[self._paths[fd]] = True
        return n

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> int:
        return self._wrote(fd, super().write(fd, data))

    def writev(self, fd: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        return self._wrote(fd, super().writev(fd, buffers))

    def ftruncate(self, fd: int, length: int) -> None:
        super().ftruncate(fd, length)
        self._wrote(fd, 1)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        if fd in self._paths:
            self.dirty[self._paths[fd]] = False

    def close(self, fd: int) -> None:
        super().close(fd)
        name = self._paths.pop(fd, None)
        if name is not None and self.dirty.get(name):
            self.closed_dirty.append(name)

    def unsynced(self) -> list[str]:
        return sorted(name for name, dirty in self.dirty.items() if dirty)


async def test_acknowledged_appends_are_fsynced_when_a_round_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync=always: a round that ends segment A and starts B must fsync A too.

    Two appends in one writer round: the first still fits into the active
    segment A, the second must rotate into a new segment B. Both are
    acknowledged, so both files must have been fsynced after their writes
    (a power cut right after the acks would otherwise lose the first one).
    """
    tracker = FsyncTracker()
    monkeypatch.setattr(fileio, "_current", tracker)
    datadir = tmp_path / "data"
    cfg = JournalConfig(journal_size=2048, fsync=FsyncPolicy.parse("always"))
    async with open_data_dir(datadir, DataDirConfig(), lambda _n: cfg) as dd:
        q = dd.queue(Q)
        await q.append([drv.data_for(1)], 1)
        assert tracker.unsynced() == []
        puts1, ticket1 = q.append_nowait([drv.data_for(2)], 1)
        _puts2, ticket2 = q.append_nowait([b"x" * 3000], 1)
        await wait_durable(ticket1)
        await wait_durable(ticket2)
        assert len(q.segments) == 2, "the second append rotated"
        seg_a = q.segments[0].path.name
        assert tracker.unsynced() == [], (
            f"acknowledged appends not fsynced: {tracker.unsynced()} "
            f"(closed unsynced: {tracker.closed_dirty}); "
            f"id {puts1[0].id} is in {seg_a}"
        )


def test_driver_is_bounded_when_never_killed(tmp_path: Path) -> None:
    """The driver stops by itself (item bound) and closes cleanly: nothing to truncate."""
    datadir = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "append", str(datadir), "--max-items", "300",
         "--seconds", "10"],
        capture_output=True, timeout=30, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines()[-1].startswith("END")
    dd = DataDir.open(datadir)
    assert dd.report.truncated_bytes == 0
    check_segments(dd.queues[Q])
    shutil.rmtree(datadir)
