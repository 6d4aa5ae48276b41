"""Journal file names (queued.journal.names, through queued.journal.format): segments
`q.<n>`, checkpoints `q.read.<reader>`, temps; parsed back from a directory entry, the
name rule, and any valid name round-trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from journal_bytes_util import (
    PROPS,
)

from queued.journal import format as jf
from queued.journal.format import (
    FileRole,
    JournalFileName,
)

# -- 8. file names -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("jobs.1321401903634", JournalFileName("jobs", FileRole.SEGMENT, number=1321401903634)),
        ("jobs.0", JournalFileName("jobs", FileRole.SEGMENT, number=0)),
        ("jobs.read.", JournalFileName("jobs", FileRole.CHECKPOINT, reader="")),
        ("jobs.read.indexer", JournalFileName("jobs", FileRole.CHECKPOINT, reader="indexer")),
        ("a-b_c:d.read.x-y", JournalFileName("a-b_c:d", FileRole.CHECKPOINT, reader="x-y")),
        ("jobs.123~~", JournalFileName("jobs", FileRole.TEMP)),
        ("jobs.read.x~~", JournalFileName("jobs", FileRole.TEMP)),
        ("jobs.read.~~", JournalFileName("jobs", FileRole.TEMP)),
        ("jobs.~~compact.5", JournalFileName("jobs", FileRole.TEMP)),  # "contain ~~"
    ],
)
def test_parse_file_name(name: str, parsed: JournalFileName) -> None:
    assert jf.parse_file_name(name) == parsed


@pytest.mark.parametrize(
    "name",
    [
        "jobs",
        ".x",
        ".123",
        "bad name.1",
        "jobs.read.bad/name",
        "jobs.read.bad name",
        "jobs.12a",
        "jobs.123~",
        "jobs.read.x~",
        "jobs.-1",
        "jobs.+1",
        "jobs.",
        "jobs.read",
        "jobs.\u0661\u0662",  # Arabic-Indic digits: isdigit() but not a segment number
        "jobs.1\n",
        "a/b.1",
        "x" * 251 + ".1",
    ],
)
def test_parse_file_name_rejects(name: str) -> None:
    assert jf.parse_file_name(name) is None


def test_valid_name() -> None:
    for good in ("a", "jobs", "A-z_0:9", "x" * 250, "-", "_", ":"):
        assert jf.valid_name(good), good
    for bad in ("", "x" * 251, "a.b", ".", "a/b", "a b", "a+b", "jobs\n", "é", "a~~"):
        assert not jf.valid_name(bad), bad


names = st.from_regex(r"[A-Za-z0-9_:\-]{1,250}", fullmatch=True)


@PROPS
@given(names, names, st.integers(0, 2**63))
def test_file_names_round_trip(queue: str, reader: str, number: int) -> None:
    seg = jf.segment_name(queue, number)
    assert jf.parse_file_name(seg) == JournalFileName(queue, FileRole.SEGMENT, number=number)
    cp = jf.checkpoint_name(queue, reader)
    assert jf.parse_file_name(cp) == JournalFileName(queue, FileRole.CHECKPOINT, reader=reader)
    assert jf.parse_file_name(jf.checkpoint_name(queue)) == JournalFileName(
        queue, FileRole.CHECKPOINT, reader=""
    )
    for final in (seg, cp):
        assert jf.parse_file_name(jf.temp_name(final)) == JournalFileName(queue, FileRole.TEMP)
