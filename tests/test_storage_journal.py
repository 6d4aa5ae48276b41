"""The journal of one queue against real files in a temp dir: appends, read-back,
checkpoints, size limits, and the `queued dump` / `queued check` tools.

Recovery and writer rounds: test_storage_datadir.py; compaction: test_storage_compaction.py."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journal_util import T0, all_puts, cfg, data_for, fill, segments

from queued.cli import check, dump
from queued.config import FsyncPolicy, FullPolicy
from queued.errors import JournalFullError
from queued.journal import format as jf
from queued.storage.datadir import DataDir
from queued.storage.files import Checkpoint, SegmentInfo
from queued.storage.journal import wait_durable
from queued.storage.opening import open_data_dir

# -- appends and read-back ---------------------------------------------------------


async def test_append_assigns_increasing_ids_and_survives_restart(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        first = await q.append([b"a", b"b"], T0)
        second = await q.append([b"c"], T0 + 1, expire_time_ms=T0 + 5000, error_count=2)
    assert [p.id for p in first + second] == [1, 2, 3]
    puts = all_puts(tmp_path)
    assert puts == [
        jf.Put(1, b"a", T0), jf.Put(2, b"b", T0), jf.Put(3, b"c", T0 + 1, T0 + 5000, 2)
    ]


async def test_rotation_and_big_item_gets_own_segment(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path, queue_config=lambda _: cfg(journal_size=1000)) as dd:
        q = dd.queue("q")
        for _ in range(40):
            await q.append([b"x" * 90], T0)
        await q.append([b"B" * 5000], T0)
        await q.append([b"after"], T0)
    segs = segments(tmp_path)
    assert len(segs) >= 5
    sizes = [p.stat().st_size for p in segs]
    big = [s for s in sizes if s > 1000]
    assert len(big) == 1  # only the big item's segment passes journal_size
    dd = DataDir.open(tmp_path)
    infos = dd.queues["q"].segments
    big_seg = next(s for s in infos if s.size > 1000)
    assert big_seg.count == 1 and big_seg.first_id == 41
    assert [p.id for p in dd.queues["q"].iter_puts(1)] == list(range(1, 43))


async def test_iter_puts_from_the_middle_uses_the_sparse_index(tmp_path: Path) -> None:
    await fill(tmp_path, 3000, per_append=7, journal_size=200_000)
    dd = DataDir.open(tmp_path)
    q = dd.queues["q"]
    got = list(q.iter_puts(1234, 1300))
    assert [p.id for p in got] == list(range(1234, 1301))
    assert all(p.data == data_for(p.id) for p in got)


# -- checkpoints --------------------------------------------------------------------


async def test_checkpoint_round_trip_and_read_done_not_redelivered(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([data_for(i) for i in range(1, 11)], T0)
        await q.write_checkpoint("", 3, [5, 8, 2])
        await q.write_checkpoint("audit", 0, [])
    assert (tmp_path / "q.read.").exists() and (tmp_path / "q.read.audit").exists()
    dd2 = DataDir.open(tmp_path)
    q2 = dd2.queues["q"]
    assert q2.readers[""] == Checkpoint(3, (5, 8))
    assert [p.id for p in q2.iter_unconsumed("")] == [4, 6, 7, 9, 10]
    assert [p.id for p in q2.iter_unconsumed("audit")] == list(range(1, 11))


# -- size limits ---------------------------------------------------------------------


async def test_max_journal_size_refuse(tmp_path: Path) -> None:
    conf = cfg(journal_size=1000, max_journal_size=3000)
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        stored = 0
        with pytest.raises(JournalFullError, match="max_journal_size"):
            for i in range(1, 1000):
                await q.append([b"y" * 100], T0)
                stored = i
        assert 10 < stored < 40
        # Consuming frees space: compaction runs before refusing.
        await q.write_checkpoint("", stored)
        await q.append([b"fits again"], T0)
    assert all_puts(tmp_path)[-1].data == b"fits again"


async def test_max_journal_size_drop_oldest(tmp_path: Path) -> None:
    conf = cfg(journal_size=1000, max_journal_size=3000, full_policy=FullPolicy.DROP_OLDEST)
    dropped: list[int] = []
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")

        async def note(seg: SegmentInfo) -> None:
            dropped.append(seg.last_id)

        q.before_drop = note
        for _ in range(100):
            await q.append([b"z" * 100], T0)
        assert q.total_bytes <= 3000
        head = q.readers[""].head
    assert dropped and head == dropped[-1]
    dd2 = DataDir.open(tmp_path)
    ids = [p.id for p in dd2.queues["q"].iter_unconsumed("")]
    assert ids[-1] == 100 and ids[0] == head + 1


# -- tools ------------------------------------------------------------------------------


async def test_dump_prints_every_record(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"hello"], T0, expire_time_ms=T0 + 1)
        await q.write_checkpoint("", 0, [1])
    out = io.StringIO()
    assert dump(segments(tmp_path)[0], out) == 0
    text = out.getvalue()
    assert "PUT id=1 size=5" in text and "b'hello'" in text and "expires=" in text
    assert "CHECK covers=" in text and "END (writer file with check records" in text
    out = io.StringIO()
    assert dump(tmp_path / "q.read.", out) == 0
    assert "READ_HEAD id=0" in out.getvalue() and "READ_DONE ids=[1]" in out.getvalue()
    seg = segments(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:-3])
    out = io.StringIO()
    assert dump(seg, out) == 1
    assert "CORRUPT" in out.getvalue() or "TORN" in out.getvalue()


async def test_check_reports_torn_tail_and_bad_checkpoint(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"a"], T0)
        await q.append([b"b"], T0)
        await q.write_checkpoint("", 1)
    out = io.StringIO()
    assert check(tmp_path, out) == 0
    seg = segments(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:-4])
    (tmp_path / "q.read.").write_bytes(b"\x26\x3c\x26")
    out = io.StringIO()
    assert check(tmp_path, out) == 1
    text = out.getvalue()
    assert "torn tail" in text and "recovery cuts" in text
    assert "unreadable checkpoint" in text


def test_cli_main_exit_codes(tmp_path: Path) -> None:
    from queued.cli import main

    assert main(["check", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert main(["dump", str(tmp_path / "missing")]) == 2


def test_journal_page_check_record_example_is_true() -> None:
    """The bytes docs/journal.md shows for a first batch are what we write."""
    put = jf.encode_put(jf.Put(1, b"hello", 1_700_000_000_000))
    assert put.hex() == "86" "05000000" "00000000" "0100000000000000" "0068e5cf8b010000" + \
        b"hello".hex()
    assert jf.encode_check(put, 18).hex() == "d1" "09000000" "01" "1e000000" "3a8449d7"
    assert jf.EMPTY_CHECK.hex() == "d1" "09000000" "01" "00000000" "93d168e1"
    assert jf.OLD_EMPTY_CHECK.hex() == "72" "00000000" "93d168e1"
    page = (Path(__file__).parent.parent / "docs" / "journal.md").read_text()
    assert "d1 09000000 01 1e000000 3a8449d7" in page
    assert "d1 09000000 01 00000000 93d168e1" in page and "72 00000000 93d168e1" in page


def test_journal_page_flags_record_example_is_true() -> None:
    """The FLAGS record docs/journal.md shows before the PUT of `hello` with flags 16."""
    plain = jf.encode_put(jf.Put(1, b"hello", 1_700_000_000_000))
    flagged = jf.encode_put(jf.Put(1, b"hello", 1_700_000_000_000, flags=16))
    assert flagged.hex() == "d1" "05000000" "02" "10000000" + plain.hex()
    page = (Path(__file__).parent.parent / "docs" / "journal.md").read_text()
    assert "d1 05000000 02 10000000" in page and "| 2 | **FLAGS** |" in page


def test_journal_page_incarnation_example_is_true() -> None:
    """The head of a segment docs/journal.md shows: magic, empty check, INCARNATION, check."""
    page = (Path(__file__).parent.parent / "docs" / "journal.md").read_text()
    section = page.split("## The incarnation record")[1].split("```")[1]
    shown = "".join(line.split("  ")[0].replace(" ", "") for line in section.splitlines())
    assert jf.segment_head(1764072371667).hex() == shown


async def test_bad_item_in_a_batch_changes_nothing(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"ok"], T0)
        with pytest.raises(ValueError, match="out of range"):
            await q.append([b"a", b"b"], T0, error_count=1 << 40)
        assert q.last_id == 1 and q.statistics().pending_bytes == 0
        assert (await q.append([b"next"], T0))[0].id == 2
    assert [p.data for p in all_puts(tmp_path)] == [b"ok", b"next"]


# One item in an append: the journal's single-item path (a bytes item) writes what the
# general path (the same item as a bytes subclass, which it copies to bytes) writes, byte
# for byte: FLAGS records, expiry, error counts, a check record per batch, segment rotation.


class _Bytes(bytes):
    """Item data the single-item path leaves to the general one (not exactly bytes)."""


_one_item = st.tuples(
    st.binary(max_size=40) | st.builds(lambda n: b"z" * n, st.sampled_from([4095, 4096, 5000])),
    st.sampled_from([None, T0 + 5_000]),  # expiry
    st.sampled_from([0, 3]),  # error count
    st.sampled_from([0, 7]),  # flags
)


async def _append_one_by_one(path: Path, items: list[tuple[bytes, int | None, int, int]],
                             policy: str, wait: bool, as_bytes: bool) -> list[jf.Put]:
    """`items` appended one per call: each waited for (every append opens a round's
    batch), or none (they share rounds: the first opens the segment)."""
    puts: list[jf.Put] = []
    conf = cfg(journal_size=256, fsync=FsyncPolicy.parse(policy))
    async with open_data_dir(path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for data, expire, errors, flags in items:
            one = data if as_bytes else _Bytes(data)
            got, ticket = q.append_nowait([one], T0, expire, errors, flags)
            puts.extend(got)
            if wait:
                await wait_durable(ticket)
    return puts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_one_item, min_size=1, max_size=30), st.sampled_from(["never", "always"]),
       st.booleans())
def test_single_item_appends_write_what_the_general_path_writes(
    items: list[tuple[bytes, int | None, int, int]], policy: str, wait: bool,
) -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        fast = trio.run(_append_one_by_one, Path(a), items, policy, wait, True)
        general = trio.run(_append_one_by_one, Path(b), items, policy, wait, False)
        assert fast == general
        assert [(p.id, p.data, p.expire_time_ms, p.error_count, p.flags) for p in fast] == [
            (i, d, e, c, f) for i, (d, e, c, f) in enumerate(items, 1)]
        files_a, files_b = segments(Path(a)), segments(Path(b))
        assert len(files_a) == len(files_b) >= 1
        head = len(jf.segment_head(T0))  # (its incarnation differs: a directory's own)
        for fa, fb in zip(files_a, files_b, strict=True):
            assert fa.read_bytes()[head:] == fb.read_bytes()[head:]
        assert [p.data for p in all_puts(Path(a))] == [d for d, *_ in items]


async def test_single_item_append_out_of_range_changes_nothing(tmp_path: Path) -> None:
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        await q.append([b"ok"], T0)
        for bad in ({"error_count": 1 << 40}, {"flags": -1}, {"expire_time_ms": 1 << 70}):
            with pytest.raises(ValueError, match="out of range"):
                q.append_nowait([b"one"], T0, **bad)  # type: ignore[arg-type]
            assert q.last_id == 1 and q.statistics().pending_bytes == 0
        assert (await q.append([b"next"], T0))[0].id == 2
    assert [p.data for p in all_puts(tmp_path)] == [b"ok", b"next"]
