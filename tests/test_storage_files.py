"""Durable file primitives (queued.storage.files) against real files: a reader's
checkpoint written atomically and read back (a torn append after it left out, damage
refused), producer snapshots, the write probe of a data directory, and a segment's sparse
index for seeking. Torn reader-file appends as the writer makes them: test_reader_files.py;
unwritable directories: test_data_dir_writable.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued.errors import CorruptRecordError, DataDirError
from queued.journal import format as jf
from queued.storage import files
from queued.storage.files import Checkpoint, SegmentInfo

ids = st.integers(1, 2**40)


@given(head=st.integers(0, 2**40), more=st.lists(st.integers(1, 1000), max_size=20),
       errors=st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 50)), max_size=5))
def test_a_checkpoint_written_whole_reads_back_the_same(
        tmp_path_factory: pytest.TempPathFactory, head: int, more: list[int],
        errors: list[tuple[int, int]]) -> None:
    path = tmp_path_factory.mktemp("ckpt") / "q.read."
    done = tuple(sorted({head + m for m in more}))
    errs = tuple(sorted({head + i: n for i, n in errors if head + i not in done}.items()))
    checkpoint = Checkpoint(head, done, errs)
    files.write_checkpoint(path, checkpoint)
    assert files.read_checkpoint(path) == checkpoint
    assert not list(path.parent.glob("*~~"))  # the temp file was renamed away


def test_a_torn_append_after_the_checkpoint_is_left_out_and_damage_is_refused(
        tmp_path: Path) -> None:
    whole = files.encode_checkpoint(Checkpoint(10, (12,)))
    cp, end = files.decode_checkpoint(whole + b"\x01\x02")  # a torn append: never acked
    assert cp == Checkpoint(10, (12,)) and end == len(whole)
    flipped = bytearray(whole)
    flipped[-3] ^= 0xFF  # inside the checkpoint's own sealed batch
    with pytest.raises(CorruptRecordError):
        files.decode_checkpoint(bytes(flipped))


def test_producer_snapshots_round_trip_and_a_cut_one_is_damage(tmp_path: Path) -> None:
    path = tmp_path / jf.producers_name("q")
    assert files.read_producers(path) == []  # none yet
    marks = [jf.ProducerMark(b"p1", 3, 10, 2, 1_700_000_000_000),
             jf.ProducerMark(b"p2", 1, 12, 1, 1_700_000_000_001)]
    files.write_producers(path, marks)
    assert files.read_producers(path) == marks
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptRecordError):  # written whole: a cut one is damage
        files.read_producers(path)


def test_the_write_probe_leaves_nothing_and_names_the_step_that_failed(tmp_path: Path) -> None:
    data = tmp_path / "new" / "data"
    files.probe_writable(data)  # creates the directory
    assert data.is_dir() and os.listdir(data) == []
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DataDirError, match="cannot create the directory"):
        files.probe_writable(tmp_path / "file" / "data")


def test_the_sparse_index_finds_a_batch_at_or_before_an_id(tmp_path: Path) -> None:
    seg = SegmentInfo(1, tmp_path / "q.1", jf.MAGIC_SIZE)
    stride = files.INDEX_STRIDE
    for k in range(5):  # batches of 10 items, a stride apart
        seg.note_batch(jf.MAGIC_SIZE + k * stride, jf.MAGIC_SIZE + (k + 1) * stride, 10,
                       1 + 10 * k, 10 + 10 * k, data_bytes=100)
    assert (seg.count, seg.first_id, seg.last_id, seg.data_bytes) == (50, 1, 50, 500)
    assert seg.seek_offset(1) == jf.MAGIC_SIZE
    assert seg.seek_offset(25) == jf.MAGIC_SIZE + 2 * stride  # the batch holding 21-30
    assert seg.seek_offset(10**9) == jf.MAGIC_SIZE + 4 * stride
    seg.note_batch(jf.MAGIC_SIZE + 5 * stride, jf.MAGIC_SIZE + 6 * stride, 1, 51, 51)
    assert seg.data_bytes is None  # a batch noted without its data size: unknown from now
