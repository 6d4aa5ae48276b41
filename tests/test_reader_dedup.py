"""The deduplication key table (queued.reader.dedup) and the DEDUP record, pure.

The rule (a key stored within the window: a duplicate, answered as its put; past the
window, or unknown: stored), the bounds (max_keys, oldest first out) with their
counters, restore from marks, snapshot marks of durable puts only; a model-based
property test of any sequence of puts and clock steps; the record's round trip and
corruption.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued.errors import CorruptRecordError
from queued.journal import format as jf
from queued.reader.dedup import DedupCounters, DedupTable

WINDOW = 1000


def test_a_key_within_the_window_is_a_duplicate_past_it_stored_again() -> None:
    counters = DedupCounters()
    t = DedupTable(window_ms=WINDOW, counters=counters)
    assert t.check(b"k", 0) is None
    t.store(b"k", 1, 2, 0)
    e = t.check(b"k", WINDOW)  # the window's last millisecond
    assert e is not None and (e.first_id, e.count) == (1, 2)
    assert t.seen(b"k", WINDOW) and not t.seen(b"k", WINDOW + 1)
    assert t.check(b"k", WINDOW + 1) is None  # forgotten: store it again
    assert counters == DedupCounters(evicted=0, expired=1, duplicates=1)
    t.store(b"k", 5, 1, WINDOW + 1)
    assert t.check(b"k", 2 * WINDOW).first_id == 5  # type: ignore[union-attr]


def test_max_keys_evicts_the_oldest_and_the_window_trims_from_the_oldest() -> None:
    counters = DedupCounters()
    t = DedupTable(max_keys=2, window_ms=WINDOW, counters=counters)
    t.store(b"a", 1, 1, 0)
    t.store(b"b", 2, 1, 10)
    assert t.check(b"a", 20) is not None  # a duplicate does not make a key newer
    t.store(b"c", 3, 1, 20)
    assert list(t.entries) == [b"b", b"c"] and counters.evicted == 1
    t.store(b"d", 4, 1, 10 + WINDOW + 1)  # b is past its window: expired, not evicted
    assert list(t.entries) == [b"c", b"d"] and (counters.evicted, counters.expired) == (1, 1)
    t.trim(20 + WINDOW + 1)
    assert list(t.entries) == [b"d"] and counters.expired == 2


def test_restore_keeps_the_newest_mark_per_key_and_drops_keys_past_the_window() -> None:
    t = DedupTable(max_keys=2, window_ms=WINDOW)
    marks = [jf.DedupMark(b"a", 50, 1, 500), jf.DedupMark(b"b", 10, 1, 100),
             jf.DedupMark(b"a", 40, 2, 400), jf.DedupMark(b"old", 5, 1, 0),
             jf.DedupMark(b"c", 90, 1, 50)]
    t.restore(marks, now_ms=WINDOW + 60)  # old is past its window (c is not)
    # Oldest first, then the cap: c (time 50) goes.
    assert [(k, e.first_id) for k, e in t.entries.items()] == [(b"b", 10), (b"a", 50)]


def test_marks_leave_out_puts_not_yet_durable_and_forget_drops_a_failed_one() -> None:
    t = DedupTable()
    t.store(b"a", 1, 1, 0)
    e = t.store(b"b", 2, 1, 0, pending="ticket")
    assert [m.key for m in t.marks(lambda p: False)] == [b"a"]
    assert not t.all_durable(lambda p: False)
    assert t.marks(lambda p: True) == [jf.DedupMark(b"a", 1, 1, 0), jf.DedupMark(b"b", 2, 1, 0)]
    before = t.changes
    t.forget(b"b", e)
    assert b"b" not in t.entries and t.changes == before + 1
    t.forget(b"a", e)  # not a's entry: nothing
    assert b"a" in t.entries


OPS = st.lists(st.tuples(st.sampled_from(["put", "tick"]), st.integers(0, 5),
                         st.integers(0, 2 * WINDOW)), max_size=60)


@given(ops=OPS, max_keys=st.integers(1, 6))
def test_table_against_a_model(ops: list[tuple[str, int, int]], max_keys: int) -> None:
    """Any puts and clock steps: a put is a duplicate exactly when its key was stored
    within the window and is among the max_keys newest stored (the model: a list of
    (key, time) stored, newest last); otherwise it is stored."""
    t = DedupTable(max_keys=max_keys, window_ms=WINDOW)
    stored: list[tuple[bytes, int]] = []
    now, next_id = 0, 1
    for op, key, step in ops:
        if op == "tick":
            now += step
            continue
        k = b"k%d" % key
        alive = [s for s in stored[-max_keys:] if now - s[1] <= WINDOW]
        e = t.check(k, now)
        if any(s[0] == k for s in alive):
            assert e is not None
        else:
            assert e is None
            t.store(k, next_id, 1, now)
            stored = [s for s in stored if s[0] != k] + [(k, now)]
            next_id += 1
        assert len(t) <= max_keys


@given(key=st.binary(min_size=1, max_size=jf.MAX_DEDUP_KEY), first=st.integers(1, jf.MAX_ID),
       count=st.integers(1, 2**32 - 1), at=st.integers(0, 2**62))
def test_dedup_record_round_trip(key: bytes, first: int, count: int, at: int) -> None:
    mark = jf.DedupMark(key, first, count, at)
    rec = jf.dedup_record(mark)
    assert len(rec) == 27 + len(key) and rec[0] == jf.EXT_BYTE and rec[5] == jf.EXT_DEDUP == 8
    data = jf.WRITER_MAGIC + jf.seal(b"", 4)
    batch = jf.encode_put(jf.Put(first, b"x", at)) + rec
    data += jf.seal(batch, len(data))
    assert [d.record for d in jf.decode_all(data)][2] == mark
    dec = jf.RecordDecoder(jf.FileKind.WRITER)
    dec.receive_data(data)
    dec.receive_data(b"")
    found = dec.next_batch()
    assert isinstance(found, jf.Batch) and found.marks == 0  # (the empty seal's batch)
    found = dec.next_batch()
    assert isinstance(found, jf.Batch) and (found.count, found.marks) == (1, 1)


def test_dedup_record_whose_fields_do_not_add_up_is_corrupt() -> None:
    rec = bytearray(jf.dedup_record(jf.DedupMark(b"abc", 1, 1, 0)))
    rec[6] = 4  # the key length says 4, the data size says 3
    data = jf.WRITER_MAGIC + jf.seal(b"", 4)
    data += jf.seal(bytes(rec), len(data))
    with pytest.raises(CorruptRecordError, match="DEDUP"):
        jf.decode_all(data)
    dec = jf.RecordDecoder(jf.FileKind.WRITER)
    dec.receive_data(data)
    dec.receive_data(b"")
    with pytest.raises(CorruptRecordError, match="DEDUP"):
        while not isinstance(dec.next_batch(), jf.EndOfData):
            pass
    for bad in (b"", b"x" * 65):
        with pytest.raises(ValueError):
            jf.dedup_record(jf.DedupMark(bad, 1, 1, 0))
