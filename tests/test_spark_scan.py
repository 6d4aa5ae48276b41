"""What the `queued` source's readers share (queued.spark.scan), without a SparkSession:
which queues a query reads, segments packed into partitions up to a byte budget (at
least one each, order kept), `minPartitions` cutting at batch boundaries only with every
wanted id read once, a partition read into Arrow batches, and the first id added at or
after a time. Through a real SparkSession: test_spark_source.py, test_spark_stream.py."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from spark_util import T0, write_items

pytest.importorskip("pyspark")

from queued.spark import scan
from queued.storage import journal_scan as js


def test_a_selection_by_names_by_pattern_or_all() -> None:
    assert scan.Selection().wants("anything")
    assert scan.Selection(frozenset({"a"})).wants("a")
    assert not scan.Selection(frozenset({"a"})).wants("b")
    by_pattern = scan.Selection(pattern=re.compile("jobs-.*"))
    assert by_pattern.wants("jobs-1") and not by_pattern.wants("xjobs-1")


@given(st.lists(st.integers(1, 100), max_size=30), st.integers(1, 250))
def test_packing_keeps_order_and_the_budget_with_at_least_one_segment_each(
        sizes: list[int], budget: int) -> None:
    reads = [(scan.SegmentRead("q", f"q.{i}"), n) for i, n in enumerate(sizes)]
    parts = scan.pack(reads, budget)
    groups = [[int(r.path.split(".")[1]) for r in p.segments] for p in parts]  # type: ignore[attr-defined]
    assert list(itertools.chain.from_iterable(groups)) == list(range(len(sizes)))
    for group in groups:
        total = sum(sizes[i] for i in group)
        assert group and (total <= budget or len(group) == 1)
    for a, b in itertools.pairwise(groups):  # a group closes only when the next would not fit
        assert sum(sizes[i] for i in a) + sizes[b[0]] > budget


@given(st.lists(st.lists(st.integers(1, 20), min_size=1, max_size=8), min_size=1, max_size=4),
       st.integers(1, 12))
def test_min_partitions_cuts_at_batch_boundaries_and_reads_every_id_once(
        segments: list[list[int]], wanted: int) -> None:
    reads, next_id = [], 1
    for k, counts in enumerate(segments):
        batches = []
        for c in counts:
            batches.append((next_id, next_id + c - 1, c))
            next_id += c
        reads.append((scan.SegmentRead("q", f"q.{k}"),
                      js.SegmentSummary(sum(counts), batches[0][0], batches[-1][1], 0,
                                        batches=batches)))
    parts = scan.split(reads, wanted)
    summaries = {read.path: summary for read, summary in reads}
    covered: list[int] = []
    for part in parts:
        for r in part.segments:  # type: ignore[attr-defined]
            own = [i for first, last, _ in summaries[r.path].batches
                   for i in range(first, last + 1)]
            covered += [i for i in own if i > r.ids.after and (r.ids.upto <= 0
                                                               or i <= r.ids.upto)]
            # a cut falls after a batch of that segment, never inside one
            assert r.ids.upto <= 0 or r.ids.upto in {b[1] for b in summaries[r.path].batches}
    assert sorted(covered) == list(range(1, next_id))  # every id once


async def test_a_partition_reads_into_arrow_and_the_first_id_at_a_time(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    await write_items(data, "q", 1, 40)
    segments = js.list_segments(data, {"q"})
    part = scan.pack([(scan.segment_read(s, None), s.size) for s in segments], 1 << 30)
    assert len(part) == 1
    batches = await trio.to_thread.run_sync(lambda: list(scan.read_partition(part[0])))
    ids = [i for b in batches for i in b.column("id").to_pylist()]
    assert ids == list(range(1, 41))
    # write_items adds each batch of five at T0 + its first id: 16-20 at T0 + 16
    assert scan.first_id_at(segments, T0 + 16) == 16
    assert scan.first_id_at(segments, T0 + 17) == 21
    assert scan.first_id_at(segments, T0 + 1000) is None
