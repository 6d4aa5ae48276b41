"""The producer table (queued.reader.producers) and the PRODUCER record, pure.

The rule (next: store; at or below the last: a repeat; ahead, or not 1 for a producer
unknown: a gap), the least-recently-used bound and the expiry with their counters,
restore from marks in any order, the snapshot's marks leaving out puts not durable; the
record's round trip and what the decoder refuses.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queued.errors import CorruptRecordError
from queued.journal import format as jf
from queued.reader.producers import ProducerCounters, ProducerTable, Verdict

DAY = 86_400_000


def test_next_is_stored_repeat_is_a_duplicate_ahead_is_a_gap() -> None:
    t = ProducerTable()
    assert t.check(b"p", 2, 0)[0] is Verdict.GAP  # unknown: starts at 1
    assert t.check(b"p", 1, 0) == (Verdict.STORE, None)
    t.store(b"p", 1, 10, 3, 0)
    verdict, e = t.check(b"p", 1, 5)
    assert verdict is Verdict.DUPLICATE and e is not None and (e.first_id, e.count) == (10, 3)
    assert t.check(b"p", 3, 5)[0] is Verdict.GAP
    assert t.check(b"p", 2, 5)[0] is Verdict.STORE
    assert t.verdict(b"p", 2, 5) is Verdict.STORE and t.verdict(b"q", 7, 5) is Verdict.GAP
    assert (t.counters.duplicates, t.counters.gaps) == (1, 2)  # (verdict counts nothing)


def test_least_recently_used_goes_first_and_expired_ones_are_forgotten() -> None:
    counters = ProducerCounters()
    t = ProducerTable(max_producers=2, expiry_ms=DAY, counters=counters)
    t.store(b"a", 1, 1, 1, 0)
    t.store(b"b", 1, 2, 1, 1)
    assert t.check(b"a", 1, 2)[0] is Verdict.DUPLICATE  # a is the most recent now
    t.store(b"c", 1, 3, 1, 3)
    assert list(t.entries) == [b"a", b"c"] and counters.evicted == 1
    assert t.check(b"a", 2, 3 + DAY + 1)[0] is Verdict.GAP  # expired: unknown, 1 first
    assert counters.expired == 1 and list(t.entries) == [b"c"]
    t.store(b"d", 1, 4, 1, 3 + 2 * DAY)  # c, unused for a day, goes as d comes
    assert list(t.entries) == [b"d"] and counters.expired == 2


def test_restore_keeps_the_newest_mark_per_producer_in_recency_order() -> None:
    t = ProducerTable(max_producers=2)
    marks = [jf.ProducerMark(b"a", 5, 50, 1, 500), jf.ProducerMark(b"b", 1, 10, 1, 100),
             jf.ProducerMark(b"a", 4, 40, 2, 400), jf.ProducerMark(b"c", 9, 90, 1, 50)]
    t.restore(marks, 600)
    assert {p: e.sequence for p, e in t.entries.items()} == {b"b": 1, b"a": 5}  # c evicted
    assert list(t.entries) == [b"b", b"a"]


def test_snapshot_marks_leave_out_puts_not_durable() -> None:
    t = ProducerTable()
    t.store(b"a", 1, 1, 1, 0)
    t.store(b"b", 1, 2, 1, 0, pending="ticket")
    assert [m.producer for m in t.marks(lambda p: False)] == [b"a"]
    assert not t.all_durable(lambda p: False)
    assert [m.producer for m in t.marks(lambda p: True)] == [b"a", b"b"]
    e = t.entries[b"b"]
    t.forget(b"b", e)
    assert b"b" not in t.entries


@given(producer=st.binary(min_size=1, max_size=jf.MAX_PRODUCER_ID),
       sequence=st.integers(1, jf.MAX_SEQUENCE), first=st.integers(1, jf.MAX_ID),
       count=st.integers(1, 2**32 - 1), at=st.integers(0, 2**62))
def test_producer_record_round_trip(producer: bytes, sequence: int, first: int, count: int,
                                    at: int) -> None:
    mark = jf.ProducerMark(producer, sequence, first, count, at)
    rec = jf.producer_record(mark)
    assert len(rec) == 35 + len(producer) and rec[0] == jf.EXT_BYTE and rec[5] == 6
    data = jf.WRITER_MAGIC + jf.seal(b"", 4)
    data += jf.seal(rec, len(data))
    assert [d.record for d in jf.decode_all(data)][1] == mark


def test_producer_record_whose_fields_do_not_add_up_is_corrupt() -> None:
    rec = bytearray(jf.producer_record(jf.ProducerMark(b"abc", 1, 1, 1, 0)))
    rec[6] = 4  # the id length says 4, the data size says 3
    data = jf.WRITER_MAGIC + jf.seal(b"", 4)
    data += jf.seal(bytes(rec), len(data))
    with pytest.raises(CorruptRecordError, match="PRODUCER"):
        jf.decode_all(data)
    with pytest.raises(ValueError):
        jf.producer_record(jf.ProducerMark(b"x" * 65, 1, 1, 1, 0))
