"""libkestrel reads our journal files, and files of earlier releases load after an upgrade.

A port of libkestrel's reader (tests/libkestrel_util.py) reads every kind of file the
storage layer writes: plain, flagged, delayed, headed and expiring items with error counts, a
rotated segment, a compaction's output, a queue's new incarnation after a delete, a
checkpoint written whole and one with appended batches. It must return every item, in
order, with its id, data, add time, expiry and error count, and each reader's head and
out-of-order confirms, under both of libkestrel's rules for skipping a record it does not
know (its released one, and the first one, which skips by data size alone), PRODUCER
records (exactly-once puts) and DEDUP records (deduplication keys) included.

Then a data directory in the format of earlier releases, made here from fixed bytes
(the older forms: command 7 checks, command 4 FLAGS, 5 DELAY, 6 COMPACTED, 12
INCARNATION): the first libkestrel rule reads nothing of it, which is why the forms
changed; this release recovers it with the same items, in the same order, and the same
reader positions, serves appends and compaction on it, and its tools read it.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
from journal_util import T0, cfg, data_for
from libkestrel_util import KPut, Skip, bookmark_state, journal_puts, open_journal

from queued.cli import dump
from queued.cli import main as cli_main
from queued.errors import CorruptJournalError
from queued.journal import format as jf
from queued.journal.headers import encode_headers
from queued.storage.datadir import DataDir
from queued.storage.files import decode_checkpoint, read_checkpoint
from queued.storage.journal import wait_durable
from queued.storage.journal_scan import scan_segment
from queued.storage.opening import open_data_dir

BIG = b"x" * 100  # with journal_size=620, 4 such items fill a segment
#: A headers block (W3C trace context), for items with headers.
TRACE = encode_headers({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})


def as_kestrel(put: jf.Put) -> KPut:
    """What libkestrel must return for one of our items."""
    return KPut(put.id, put.add_time_ms, put.expire_time_ms, put.data, put.error_count)


def our_puts(blob: bytes) -> list[jf.Put]:
    return [d.record for d in jf.decode_all(blob) if isinstance(d.record, jf.Put)]


def segment_paths(data: Path, queue: str) -> list[Path]:
    names = [(n.number, p) for p in data.iterdir()
             if (n := jf.parse_file_name(p.name)) is not None and n.queue == queue
             and n.role is jf.FileRole.SEGMENT]
    return [p for _, p in sorted(names)]


def kestrel_reads_segment(path: Path) -> list[KPut]:
    """The items libkestrel returns from a writer file, the same under both rules; every
    record it does not know is an extension record (command 13), nothing else."""
    blob = path.read_bytes()
    got = {skip: journal_puts(blob, skip) for skip in Skip}
    assert got[Skip.DATA_ONLY] == got[Skip.HEADER_AND_DATA], path.name
    unknown = {r.command for r in open_journal(blob, Skip.DATA_ONLY).records()
               if not isinstance(r, KPut)}
    assert unknown <= {jf.CMD_EXT}, (path.name, unknown)
    return got[Skip.HEADER_AND_DATA]


def kestrel_reads_checkpoint(path: Path) -> tuple[int, set[int]]:
    blob = path.read_bytes()
    got = {skip: bookmark_state(blob, skip) for skip in Skip}
    assert got[Skip.DATA_ONLY] == got[Skip.HEADER_AND_DATA], path.name
    return got[Skip.HEADER_AND_DATA]


async def test_libkestrel_reads_every_kind_of_file_we_write(tmp_path: Path) -> None:
    data = tmp_path / "data"
    small = cfg(journal_size=620)
    sent: list[jf.Put] = []
    async with open_data_dir(data, queue_config=lambda _: small) as dd:
        q = dd.queue("q")
        sent += await q.append([b"plain-1", b"plain-2"], T0)
        sent += await q.append([b"flagged"], T0 + 1, flags=16)
        sent += await q.append([b"expiring, put with errors"], T0 + 2,
                               expire_time_ms=T0 + 10**6, error_count=3)
        puts, ticket = q.append_nowait([b"delayed, flagged"], T0 + 3, flags=7, due_ms=T0 + 60_000)
        await wait_durable(ticket)
        sent += puts
        # Puts of producers (exactly-once): a PRODUCER record after each one's last item.
        for seq, batch in enumerate(([b"produced-1", b"produced-2"], [b"produced-3"]), 1):
            puts, ticket = q.append_nowait(batch, T0 + 3, flags=5, producer=(b"p-1", seq))
            await wait_durable(ticket)
            sent += puts
        # Items with headers: a HEADERS record leads each (before its FLAGS and DELAY).
        sent += await q.append([b"headed", b"not headed"], T0 + 3, headers=[TRACE, b""])
        puts, ticket = q.append_nowait([b"headed, delayed, flagged"], T0 + 3, flags=9,
                                       due_ms=T0 + 60_000, producer=(b"p-1", 3),
                                       headers=[TRACE])
        await wait_durable(ticket)
        sent += puts
        # Puts with deduplication keys: a DEDUP record after each one's last item (a put of
        # its own; puts joined into one append, one without a key among them).
        puts, ticket = q.append_nowait([b"keyed-0"], T0 + 3, dedup=[(0, 1, b"order-0")])
        await wait_durable(ticket)
        sent += puts
        puts, ticket = q.append_nowait(
            [b"keyed-1", b"keyed-2", b"not keyed", b"keyed-3"], T0 + 3, due_ms=T0 + 9,
            dedup=[(0, 2, b"order-1"), (3, 4, b"order/2")])
        await wait_durable(ticket)
        sent += puts
        for i in range(10):  # rotation: several segments
            sent += await q.append([BIG + data_for(i)], T0 + 4 + i,
                                   headers=[TRACE] if i % 3 == 0 else None)
        # A checkpoint written whole: head, out-of-order confirms, an abort's error count,
        # an abort's delay; then batches appended to it.
        await q.write_checkpoint("", 2, [4, 5], [(3, 1)], [(6, T0 + 99)])
        whole = (data / "q.read.").read_bytes()
        await wait_durable(q.note_read("", done=[8], errors=[(7, 2)], delays=[(9, T0 + 5)]))
        await wait_durable(q.note_read("", head=3))
        appended = (data / "q.read.").read_bytes()
        await q.write_checkpoint("r", 0, [1])  # a named reader

        c = dd.queue("c")  # a compaction's output: stragglers 4 and 8 of segments 1-4, 5-8
        for i in range(1, 14):  # (a small header: 4 items and their records fill a segment)
            await c.append([BIG], T0, headers=[encode_headers({"t": b"%d" % i})]
                           if i in (4, 8) else None)
        await c.write_checkpoint("", 0, [1, 2, 3, 5, 6, 7])
        assert (await c.compact()).rewritten == 2

        d = dd.queue("d")  # a new incarnation after a delete
        await d.append([b"first life"], T0)
        first_life = d.file.incarnation
        await dd.delete_queue("d")
        d = dd.queue("d")
        d_puts = await d.append([b"second life"], T0 + 1)
        assert d.file.incarnation > first_life

    # Every item of q, in order, across its segments, as we journaled it.
    q_segments = segment_paths(data, "q")
    assert len(q_segments) >= 3  # rotated
    read = [p for path in q_segments for p in kestrel_reads_segment(path)]
    assert read == [as_kestrel(p) for p in sent]
    for path in q_segments:  # and each file as our own decoder reads it
        assert kestrel_reads_segment(path) == [as_kestrel(p) for p in our_puts(path.read_bytes())]
    ours = [p for path in q_segments for p in our_puts(path.read_bytes())]
    assert [p.flags for p in ours[:5]] == [0, 0, 16, 0, 7]  # (what libkestrel does not see)
    assert [type(p) for p in ours[:5]] == [jf.Put] * 4 + [jf.DelayedPut]
    marks = [d.record for path in q_segments for d in jf.decode_all(path.read_bytes())
             if isinstance(d.record, jf.ProducerMark)]
    assert marks == [jf.ProducerMark(b"p-1", 1, 6, 2, T0 + 3),
                     jf.ProducerMark(b"p-1", 2, 8, 1, T0 + 3),
                     jf.ProducerMark(b"p-1", 3, 11, 1, T0 + 3)]
    # (what libkestrel does not see either) headers, kept in the rewrite too
    assert [(type(p), p.headers) for p in ours[8:11]] == [
        (jf.HeadedPut, TRACE), (jf.Put, b""), (jf.DelayedPut, TRACE)]
    assert ours[:11] == sent[:11] and ours[10].flags == 9
    assert [p.id for p in ours if p.headers] == [9, 11, 17, 20, 23, 26]
    keys = [d.record for path in q_segments for d in jf.decode_all(path.read_bytes())
            if isinstance(d.record, jf.DedupMark)]
    assert keys == [jf.DedupMark(b"order-0", 12, 1, T0 + 3),
                    jf.DedupMark(b"order-1", 13, 2, T0 + 3),
                    jf.DedupMark(b"order/2", 16, 1, T0 + 3)]
    records = [d.record for path in q_segments for d in jf.decode_all(path.read_bytes())]
    after = {r.data: records[i + 1] for i, r in enumerate(records) if isinstance(r, jf.Put)}
    assert after[b"keyed-2"] == keys[1] and after[b"keyed-3"] == keys[2]  # each part's last
    assert isinstance(after[b"keyed-1"], jf.Put) and isinstance(after[b"not keyed"], jf.Put)

    # The compaction's output holds the stragglers; the last segment the one after them.
    c_segments = segment_paths(data, "c")
    heads = [jf.read_segment_head(p.read_bytes()) for p in c_segments]
    assert [h.compacted is not None for h in heads] == [True, False, False]
    assert [[p.id for p in kestrel_reads_segment(path)] for path in c_segments] == [
        [4, 8], [9, 10, 11, 12], [13]]
    assert [p.headers for p in our_puts(c_segments[0].read_bytes())] == [
        encode_headers({"t": b"4"}), encode_headers({"t": b"8"})]

    # The queue deleted and created again: one segment, the new life, its one item.
    (d_segment,) = segment_paths(data, "d")
    assert jf.read_segment_head(d_segment.read_bytes()).incarnation > first_life
    assert kestrel_reads_segment(d_segment) == [as_kestrel(p) for p in d_puts]

    # Checkpoints: the head and the out-of-order confirms, as we mean them.
    for blob in (whole, appended):
        our = decode_checkpoint(blob)[0]
        path = tmp_path / "one.read."
        path.write_bytes(blob)
        assert kestrel_reads_checkpoint(path) == (our.head, set(our.done))
    path.write_bytes(whole)
    assert kestrel_reads_checkpoint(path) == (2, {4, 5})
    assert appended.startswith(whole) and len(appended) > len(whole)  # batches appended
    assert kestrel_reads_checkpoint(data / "q.read.") == (3, {4, 5, 8})
    assert kestrel_reads_checkpoint(data / "q.read.r") == (0, {1})
    assert kestrel_reads_checkpoint(data / "c.read.") == (0, {1, 2, 3, 5, 6, 7})


# -- a data directory of an earlier release, from fixed bytes ------------------------------


def old_check(body: bytes, offset: int) -> bytes:
    """An earlier release's check record: command 7, length and crc as header words."""
    return struct.pack("<BII", 0x72, len(body), zlib.crc32(body, jf.crc_seed(offset)))


def old_file(magic: bytes, batches: list[bytes]) -> bytes:
    out = bytearray(magic + b"\x72" + bytes(4) + struct.pack("<I", jf.crc_seed(4)))
    for body in batches:
        out += body + old_check(body, len(out))
    return bytes(out)


def put(xid: int, data: bytes, added: int, *, errors: int = 0, expire: int | None = None) -> bytes:
    if expire is None:
        return struct.pack("<Biiqq", 0x86, len(data), errors, xid, added) + data
    return struct.pack("<Biiqqq", 0x88, len(data), errors, xid, added, expire) + data


def old_flags(flags: int) -> bytes:
    return struct.pack("<BI", 0x41, flags)


def old_delay(due: int) -> bytes:
    return struct.pack("<Bq", 0x52, due)


def old_incarnation(incarnation: int) -> bytes:
    return struct.pack("<Biq", 0xC3, 0, incarnation)


def old_compacted(first: int, last: int) -> bytes:
    return struct.pack("<Bqq", 0x64, first, last)


INCARNATION = T0 - 5000
#: Segment 1000, a compaction's output (it replaced 900..1000); segment 2000 after it.
OLD_SEGMENTS = {
    "q.1000": old_file(jf.WRITER_MAGIC, [
        old_compacted(900, 1000) + old_incarnation(INCARNATION),
        put(1, b"one", T0) + old_flags(16) + put(2, b"two", T0 + 1)
        + old_delay(T0 + 60_000) + put(3, b"three", T0 + 2),
        put(4, b"four", T0 + 3, errors=2, expire=T0 + 10**6),
    ]),
    "q.2000": old_file(jf.WRITER_MAGIC, [
        old_incarnation(INCARNATION),
        put(5, b"five", T0 + 4) + old_flags(7) + old_delay(T0 + 70_000) + put(6, b"six", T0 + 5),
    ]),
}
OLD_CHECKPOINTS = {
    # head 1; 3 confirmed out of order; an abort gave 2 an error count, one gave 4 a delay;
    # then a confirm of 5 appended.
    "q.read.": old_file(jf.READER_MAGIC, [
        jf.encode_reader_records(1, [3], {2: 1}, {4: T0 + 5000}),
        jf.encode_reader_records(None, [5], {}),
    ]),
    "q.read.r": old_file(jf.READER_MAGIC, [jf.encode_reader_records(0, [], {})]),
}
#: What the old files hold: (id, data, add time, expiry, error count, flags, due).
OLD_ITEMS = [
    (1, b"one", T0, None, 0, 0, None),
    (2, b"two", T0 + 1, None, 0, 16, None),
    (3, b"three", T0 + 2, None, 0, 0, T0 + 60_000),
    (4, b"four", T0 + 3, T0 + 10**6, 2, 0, None),
    (5, b"five", T0 + 4, None, 0, 0, None),
    (6, b"six", T0 + 5, None, 0, 7, T0 + 70_000),
]


def write_old_dir(data: Path) -> None:
    data.mkdir()
    for name, blob in {**OLD_SEGMENTS, **OLD_CHECKPOINTS}.items():
        (data / name).write_bytes(blob)


def item_of(p: jf.Put) -> tuple[object, ...]:
    return (p.id, p.data, p.add_time_ms, p.expire_time_ms, p.error_count, p.flags,
            p.due_ms if isinstance(p, jf.DelayedPut) else None)


def test_old_fixture_bytes_are_the_older_forms() -> None:
    """The fixture is what earlier releases wrote, byte for byte (spot checks)."""
    seg = OLD_SEGMENTS["q.1000"]
    assert seg[:13].hex() == "27642603" "72" "00000000" "93d168e1"
    assert seg[13:30].hex() == "64" "8403000000000000" "e803000000000000"  # COMPACTED
    assert seg[30:43].hex() == "c3" "00000000" + struct.pack("<q", INCARNATION).hex()
    assert seg[43] == 0x72
    assert old_flags(16).hex() == "4110000000" and old_delay(2000).hex() == "52d007000000000000"


@pytest.mark.parametrize("skip", list(Skip))
def test_libkestrel_on_files_of_earlier_releases(skip: Skip) -> None:
    """The older forms: libkestrel's released reader reads them; its first rule, skipping
    an unknown record by its data size alone, stops at the first check record (a zero
    byte of its covered length), as the issue found: no item, no reader position."""
    want = [KPut(i, a, e, d, n) for i, d, a, e, n, _, _ in OLD_ITEMS]
    got = [p for blob in OLD_SEGMENTS.values() for p in journal_puts(blob, skip)]
    head, done = bookmark_state(OLD_CHECKPOINTS["q.read."], skip)
    if skip is Skip.HEADER_AND_DATA:
        assert got == want
        assert (head, done) == (1, {3, 5})
    else:
        assert got == []
        assert (head, done) == (0, set())


async def test_a_data_directory_of_an_earlier_release_upgrades(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_old_dir(data)
    # The tools read it as it is.
    out = io.StringIO()
    assert cli_main(["check", str(data)]) == 0
    for name in [*OLD_SEGMENTS, *OLD_CHECKPOINTS]:
        assert dump(data / name, out) == 0, out.getvalue()
    assert "COMPACTED replaces segments 900..1000" in out.getvalue()
    assert f"INCARNATION {INCARNATION}" in out.getvalue()
    scanned = [(i, d, f) for name in OLD_SEGMENTS for chunk in scan_segment(data / name)
               for c in [chunk.columns()] for i, d, f in zip(c.ids, c.data, c.flags, strict=True)]
    assert scanned == [(i, d, f) for i, d, _, _, _, f, _ in OLD_ITEMS]

    # Recovery: the same items, in the same order, the same reader positions.
    dd = DataDir.open(data)
    q = dd.queues["q"]
    assert [item_of(p) for p in q.iter_puts(1)] == OLD_ITEMS
    assert q.file.incarnation == INCARNATION
    assert [s.compacted_from for s in q.segments] == [900, None]
    assert q.readers[""] == read_checkpoint(data / "q.read.")
    cp = q.readers[""]
    assert (cp.head, cp.done, cp.errors, cp.delays) == (1, (3, 5), ((2, 1),), ((4, T0 + 5000),))
    assert q.readers["r"].head == 0 and not q.readers["r"].done
    assert [p.id for p in q.iter_unconsumed("")] == [2, 4, 6]

    # Serving on: new items go to a new segment, in the new form, beside the old ones; a
    # restart reads both.
    async with open_data_dir(data, queue_config=lambda _: cfg(journal_size=620)) as dd2:
        q2 = dd2.queue("q")
        new = await q2.append([b"seven", b"eight"], T0 + 6)
        await wait_durable(q2.note_read("", done=[7]))
    assert [p.id for p in new] == [7, 8]
    *old, last = segment_paths(data, "q")
    assert [(p.name, p.read_bytes()) for p in old] == list(OLD_SEGMENTS.items())
    blob = last.read_bytes()
    assert blob[4:18] == jf.EMPTY_CHECK
    assert {blob[d.offset] for d in jf.decode_all(blob)} <= {jf.PUT_BYTE, jf.EXT_BYTE}
    assert [p.id for p in kestrel_reads_segment(last)] == [7, 8]
    dd3 = DataDir.open(data)
    q3 = dd3.queues["q"]
    assert [item_of(p) for p in q3.iter_puts(1)][:6] == OLD_ITEMS
    assert [p.data for p in q3.iter_puts(7)] == [b"seven", b"eight"]
    assert q3.readers[""].done == (3, 5, 7) and q3.readers[""].head == 1
    assert [p.id for p in q3.iter_unconsumed("")] == [2, 4, 6, 8]

    # Compaction: every reader past segment 1000 but for straggler 2; its output is new.
    async with open_data_dir(data, queue_config=lambda _: cfg(compact_live_ratio=0.5)) as dd4:
        q4 = dd4.queue("q")
        await q4.write_checkpoint("", 1, [3, 4, 5, 6, 7])
        await q4.write_checkpoint("r", 1, [3, 4, 5, 6, 7])
        assert (await q4.compact()).rewritten == 1
        kept = [item_of(p) for p in q4.iter_unconsumed("")]
    assert kept == [item_of(p) for p in DataDir.open(data).queues["q"].iter_unconsumed("")]
    assert [k[0] for k in kept] == [2, 8]
    assert kept[0] == OLD_ITEMS[1]  # its flags kept
    first = segment_paths(data, "q")[0]
    assert first.read_bytes()[4:18] == jf.EMPTY_CHECK  # rewritten in the new form
    assert [p.id for p in kestrel_reads_segment(first)] == [2]
    assert kestrel_reads_checkpoint(data / "q.read.") == (1, {3, 4, 5, 6, 7})
    assert cli_main(["check", str(data)]) == 0


def test_damage_in_files_of_earlier_releases_is_told_apart(tmp_path: Path) -> None:
    """A torn tail after the older forms is cut to the last verified batch; damage with a
    verified (older form) batch after it is corruption in the middle: refused."""
    torn = tmp_path / "torn"
    write_old_dir(torn)
    seg = torn / "q.2000"
    seg.write_bytes(OLD_SEGMENTS["q.2000"] + put(7, b"seven", T0 + 6)[:20])  # a write cut short
    q = DataDir.open(torn).queues["q"]
    assert [item_of(p) for p in q.iter_puts(1)] == OLD_ITEMS
    assert seg.read_bytes() == OLD_SEGMENTS["q.2000"]

    middle = tmp_path / "middle"
    write_old_dir(middle)
    blob = bytearray(OLD_SEGMENTS["q.1000"])
    blob[blob.index(b"three")] ^= 0x01  # item 3's data, in the second batch of three
    (middle / "q.1000").write_bytes(bytes(blob))
    with pytest.raises(CorruptJournalError):
        DataDir.open(middle)
