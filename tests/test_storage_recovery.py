"""Recovery of journal files (queued.storage.recovery, through DataDir.open and `queued
check`): no path drops verified (acknowledged) data silently or crashes on bad input.

Each test asserts the behaviour DESIGN.md / docs/durability.md promise; its comment describes
the bug it guards against.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from queued.cli import check
from queued.config import CorruptionPolicy, JournalConfig
from queued.errors import CorruptJournalError
from queued.journal import format as jf
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir
from queued.storage.recovery import inspect_segment, scan_segment

T0 = 1_700_000_000_000


async def _three_batches(tmp_path: Path) -> tuple[Path, list[int]]:
    """One segment with three batches of one 100-byte item each; returns it and batch starts."""
    async with open_data_dir(tmp_path) as dd:
        q = dd.queue("q")
        for i in range(3):
            await q.append([bytes([65 + i]) * 100], T0)
        seg = q.segments[0]
    starts = []
    off = len(jf.segment_head(seg.incarnation))  # magic, seal, the incarnation's batch
    for _ in range(3):
        starts.append(off)
        off += jf.PUT_HEADER_SIZE + 100 + jf.CHECK_RECORD_SIZE
    assert seg.path.stat().st_size == off
    return seg.path, starts


async def test_zero_byte_at_a_batch_start_in_the_middle_is_not_a_zero_tail(
    tmp_path: Path,
) -> None:
    # One byte (the command byte of batch 2) becomes 0x00. Batch 3 still verifies, so
    # this is corruption in the middle: under corruption="refuse" startup must refuse.
    # (The bug: inspect_segment returned ZERO_TAIL and batches 2 and 3 were truncated.)
    path, starts = await _three_batches(tmp_path)
    data = bytearray(path.read_bytes())
    data[starts[1]] = 0
    path.write_bytes(bytes(data))
    found = inspect_segment(path, 1)
    assert found.state.name == "MIDDLE_CORRUPTION", found
    with pytest.raises(CorruptJournalError):
        scan_segment(path, 1, CorruptionPolicy.REFUSE, tmp_path / "quarantine")
    assert path.stat().st_size == len(data), "verified batches were truncated away"


async def test_damaged_leading_empty_check_does_not_wipe_the_segment(tmp_path: Path) -> None:
    # A single flipped byte inside the EMPTY_CHECK at offset 4..17 makes the file look
    # "unsealed" (seed format); the plain scan then stops at offset 4 and recovery cuts
    # the WHOLE segment as a "garbage tail", even under corruption="refuse".
    path, _ = await _three_batches(tmp_path)
    data = bytearray(path.read_bytes())
    data[15] ^= 0x01  # a crc byte of the empty check record
    path.write_bytes(bytes(data))
    size = len(data)
    with pytest.raises(CorruptJournalError):
        DataDir.open(tmp_path)
    assert path.stat().st_size == size, "all three acknowledged items were cut"


async def test_empty_check_command_byte_zeroed_does_not_wipe_the_segment(tmp_path: Path) -> None:
    path, _ = await _three_batches(tmp_path)
    data = bytearray(path.read_bytes())
    data[4] = 0  # zero byte right after the magic -> "ZERO_TAIL" at offset 4
    path.write_bytes(bytes(data))
    size = len(data)
    with pytest.raises(CorruptJournalError):
        DataDir.open(tmp_path)
    assert path.stat().st_size == size


async def test_bad_magic_on_a_sealed_segment_is_reported_not_an_assertion(
    tmp_path: Path,
) -> None:
    # Corrupt magic, intact EMPTY_CHECK: inspect_segment hits
    # `assert dec.last_check_end is not None` (AssertionError), so recovery and
    # `queued check` crash instead of naming the file.
    path, _ = await _three_batches(tmp_path)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    found = inspect_segment(path, 1)  # AssertionError today
    assert found.state.name == "MIDDLE_CORRUPTION"
    out = io.StringIO()
    assert check(tmp_path, out) == 1


def test_non_journal_file_with_a_segment_name_is_not_truncated(tmp_path: Path) -> None:
    # A file that is not a journal at all (bad magic, no check record) but is named like a
    # segment is truncated to 4 bytes at startup (GARBAGE_TAIL of an "unsealed" file),
    # destroying it; the next start then refuses. It must be refused (or left alone) at once.
    path = tmp_path / "q.1700000000000"
    payload = b"this is not a kestrel journal, but somebody's file\n" * 10
    path.write_bytes(payload)
    with pytest.raises(CorruptJournalError):
        DataDir.open(tmp_path)
    assert path.read_bytes() == payload


def test_segment_name_with_leading_zero_does_not_crash_startup(tmp_path: Path) -> None:
    # parse_file_name("q.0123") -> number 123, but recovery opens segment_name(q, 123) =
    # "q.123", which does not exist: FileNotFoundError at startup.
    (tmp_path / "q.0123").write_bytes(jf.WRITER_MAGIC + jf.EMPTY_CHECK)
    DataDir.open(tmp_path)


async def test_damaged_last_batch_of_an_older_segment_is_not_a_torn_tail(tmp_path: Path) -> None:
    # Under fsync="always" a segment is fsynced before the writer rotates away from it, so
    # only the NEWEST segment can have a torn tail. A flipped byte in the last batch of an
    # older segment is corruption of acknowledged data, yet recovery classifies it as a
    # garbage tail and truncates the item away with a warning, even with corruption="refuse".
    conf = JournalConfig(journal_size=620)  # 4 items of 100 bytes per segment
    async with open_data_dir(tmp_path, queue_config=lambda _: conf) as dd:
        q = dd.queue("q")
        for _ in range(5):
            await q.append([b"x" * 100], T0)
        assert [(s.first_id, s.last_id) for s in q.segments] == [(1, 4), (5, 5)]
        first = q.segments[0].path
    data = bytearray(first.read_bytes())
    data[-jf.CHECK_RECORD_SIZE - 10] ^= 0x01  # payload of item 4, the older segment's last batch
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptJournalError):
        DataDir.open(tmp_path)
    assert first.stat().st_size == len(data), "item 4 (acknowledged) was cut"
