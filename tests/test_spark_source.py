"""The `queued` Spark data source against a real local SparkSession (one per test session,
local[2], UI off): journals written by the real journal code and by a running server,
the pending-only option against what the server still delivers, streaming with restarts,
and the writer into a real server."""

from __future__ import annotations

import pkgutil
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from server_util import ServerProcess
from spark_util import SMALL, T0, item, journal_rows, rows, stream_to_table, write_items

from queued.client import Client
from queued.config import DataDirConfig
from queued.journal import format as jf
from queued.storage import journal_scan as js
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

try:
    from queued.spark import QueuedDataSourceError, register
    from queued.spark.source import QueuedBatchReader, QueuedStreamReader
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"pyspark/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)

def test_registration_and_an_empty_directory(spark: Any, tmp_path: Path) -> None:
    # What PySpark's lookup does (pyspark/sql/worker/lookup_data_sources.py): the module
    # must be visible to pkgutil (an editable install needs editable_mode=compat).
    found = [m.name for m in pkgutil.iter_modules() if m.name.startswith("pyspark_")]
    assert "pyspark_queued" in found
    empty = tmp_path / "empty"
    empty.mkdir()
    df = spark.read.format("queued").load(str(empty))
    assert df.columns == ["queue", "id", "add_time", "expire_time", "error_count", "data"]
    assert df.count() == 0
    register(spark)  # explicit registration as well: the same source
    assert spark.read.format("queued").load(str(empty)).count() == 0


def test_batch_read_matches_the_journal(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "jobs", 1, 400)
    trio.run(write_items, data, "mail", 1, 30)
    (data / "jobs.123~~").write_bytes(b"a temp file")
    (data / jf.checkpoint_name("jobs")).write_bytes(jf.encode_checkpoint(10, [12, 17]))
    expected = journal_rows(data, "jobs") + journal_rows(data, "mail")
    assert len(expected) == 430

    df = spark.read.format("queued").load(str(data))
    assert [f.name for f in df.schema.fields] == [
        "queue", "id", "add_time", "expire_time", "error_count", "data"]
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "string", "bigint", "timestamp", "timestamp", "int", "binary"]
    segments = js.list_segments(data)
    assert df.rdd.getNumPartitions() == 1  # small segments: read several to a task
    one_each = spark.read.format("queued").option("max_partition_bytes", 1).load(str(data))
    assert one_each.rdd.getNumPartitions() == len(segments) > 2
    assert rows(one_each) == expected
    sizes = [s.size for s in segments]
    assert spark.read.format("queued").option("max_partition_bytes", 2 * max(sizes)).load(
        str(data)).rdd.getNumPartitions() == len(_pack_sizes(sizes, 2 * max(sizes)))
    assert rows(df) == expected
    only = spark.read.format("queued").option("queues", "mail").load(str(data))
    assert rows(only) == journal_rows(data, "mail")
    # Pending only: the default reader's checkpoint (head 10, 12 and 17 done) leaves 11, 13...
    # but not the items already expired (the odd batches expired in 2023).
    pending = spark.read.format("queued").option("pending", "true").option(
        "queues", "jobs").load(str(data))
    live = [r[1] for r in expected if r[0] == "jobs" and r[3] is None]
    assert len(live) == 200 and live[:6] == [6, 7, 8, 9, 10, 16]  # 1-5, 11-15... expired
    assert [r[1] for r in rows(pending)] == [i for i in live if i > 10 and i != 17]



def test_include_flags_adds_each_items_memcache_flags(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"

    async def write() -> None:
        async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
            q = dd.queue("f")
            for i in range(1, 301):
                await q.append([item("f", i)], T0 + i, flags=(0, 16, 2**32 - 1)[i % 3])

    trio.run(write)
    puts = list(DataDir.open(data).queues["f"].iter_puts(1))
    assert len(js.list_segments(data)) > 2 and {p.flags for p in puts} == {0, 16, 2**32 - 1}
    plain = spark.read.format("queued").load(str(data))
    assert plain.columns == ["queue", "id", "add_time", "expire_time", "error_count", "data"]
    df = spark.read.format("queued").option("include_flags", "true").load(str(data))
    assert df.columns[-1] == "flags" and df.schema["flags"].dataType.simpleString() == "bigint"
    got = sorted((r[0], r[1], bytes(r[2])) for r in df.select("id", "flags", "data").collect())
    assert got == [(p.id, p.flags, p.data) for p in puts]
    stream = (spark.readStream.format("queued").option("include_flags", "true")
              .option("max_items_per_trigger", "120").load(str(data)))
    streamed = (stream_to_table(stream, "flags_stream", tmp_path / "ckpt")
                .select("id", "flags", "data").collect())
    assert sorted((r[0], r[1], bytes(r[2])) for r in streamed) == got

def _pack_sizes(sizes: list[int], budget: int) -> list[list[int]]:
    """The packing the reader should do: consecutive segments up to `budget` bytes."""
    groups: list[list[int]] = []
    for size in sizes:
        if groups and sum(groups[-1]) + size <= budget:
            groups[-1].append(size)
        else:
            groups.append([size])
    return groups


def test_id_range_options_skip_segments(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "jobs", 1, 2000)
    trio.run(write_items, data, "mail", 1, 30)
    base = spark.read.format("queued").load(str(data))
    n_jobs = len(js.list_segments(data, {"jobs"}))
    assert n_jobs > 10

    def read(**options: str) -> Any:  # one partition per segment: counts what is read
        return spark.read.format("queued").option("max_partition_bytes", 1).options(
            **options).load(str(data))

    for lo, hi in [("1", "2000"), ("1751", "0"), ("350", "359"), ("7", "7"), ("1", "3"),
                   ("11", "4"), ("1995", "3000")]:
        opts = {"min_id": lo} | ({"max_id": hi} if hi != "0" else {})
        cond = f"id >= {lo}" + (f" and id <= {hi}" if hi != "0" else "")
        assert rows(read(**opts)) == rows(base.where(cond)), opts
    # ids ascend through a queue's segments: only the last few can hold ids above 1750.
    late = read(min_id="1751", queues="jobs").rdd.getNumPartitions()
    assert 1 <= late < n_jobs / 2
    early = read(max_id="20", queues="jobs").rdd.getNumPartitions()
    assert 1 <= early < n_jobs / 2
    # The same pruning serves pending reads (above the checkpoint's head only).
    (data / jf.checkpoint_name("jobs")).write_bytes(jf.encode_checkpoint(1800, []))
    pending = read(pending="true", queues="jobs")
    assert pending.rdd.getNumPartitions() < n_jobs / 2
    assert [r[1] for r in rows(pending)] == [
        r[1] for r in journal_rows(data, "jobs") if r[1] > 1800 and r[3] is None]
    with pytest.raises(Exception, match="min_id must be an integer"):
        read(min_id="ten").count()
    with pytest.raises(Exception, match="pending must be true or false"):
        read(pending="maybe").count()


def test_prune_keeps_segments_it_cannot_place(tmp_path: Path) -> None:
    from queued.spark.source import _prune

    def segment(number: int, ids: range) -> js.SegmentRef:
        body = b"".join(jf.encode_put(jf.Put(i, b"x", T0)) for i in ids)
        blob = jf.WRITER_MAGIC + jf.EMPTY_CHECK
        blob += jf.seal(body, len(blob)) if body else b""
        path = tmp_path / jf.segment_name("q", number)
        path.write_bytes(blob)
        return js.SegmentRef("q", number, str(path), len(blob))

    a, b, c = segment(1, range(1, 11)), segment(2, range(11, 21)), segment(3, range(21, 31))
    empty = segment(4, range(0))  # just rotated: no PUT yet
    segs = [a, b, c, empty]
    assert js.first_id(empty.path) is None
    assert _prune(segs, js.IdFilter()) == segs
    assert _prune(segs, js.IdFilter(after=15)) == [b, c, empty]
    assert _prune(segs, js.IdFilter(after=20)) == [c, empty]
    assert _prune(segs, js.IdFilter(after=30)) == [c, empty]  # c's end is not known
    assert _prune(segs, js.IdFilter(upto=12)) == [a, b]
    assert _prune(segs, js.IdFilter(after=10, upto=20)) == [b]
    # An unknown first id in the middle: the next known one bounds what comes before.
    assert _prune([a, empty, b, c], js.IdFilter(after=15)) == [b, c]
    assert _prune([a, empty, b, c], js.IdFilter(upto=5)) == [a, empty]
    # First ids out of order (not our files): nothing is pruned.
    assert _prune([b, a, c], js.IdFilter(after=15)) == [b, a, c]


def test_pending_reader_matches_what_the_server_still_delivers(
        spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    server = ServerProcess(data, tmp_path / "server.log").start()
    try:
        addr = f"127.0.0.1:{server.rpc}"
        with Client(addr) as c:
            # Two fanout readers from the start (the first takes over the default reader).
            assert c.get("work+ops", 1, timeout_ms=0) == []
            assert c.get("work+audit", 1, timeout_ms=0) == []
            for k in range(10):
                # Every fourth put expires within 1 ms: neither side may list those.
                c.put("work", [b"w%d" % (k * 20 + j) for j in range(20)],
                      expiration_ms=1 if k % 4 == 3 else 0)
            assert [it.id for it in c.get("work+audit", 1, timeout_ms=1000)] == [1]
            taken = c.get("work+ops", 50, timeout_ms=1000, auto_abort_ms=60_000)
            # Confirm out of order: ids 1..30 and 41..50; 31..40 go back.
            c.confirm([it for it in taken if not 31 <= it.id <= 40])
            c.abort([it for it in taken if 31 <= it.id <= 40])
        server.signal(signal.SIGTERM)  # a clean stop writes every checkpoint
        assert server.wait() == 0
        ops = spark.read.format("queued").option("reader", "ops").load(str(data))
        got = [(r.id, bytes(r.data)) for r in ops.orderBy("id").collect()]
        audit = spark.read.format("queued").option("reader", "audit").load(str(data))
        audit_ids = sorted(r.id for r in audit.select("id").collect())
        server.start()
        with Client(f"127.0.0.1:{server.rpc}") as c:
            delivered = [(it.id, it.data) for it in c.get("work+ops", 1000, timeout_ms=1000)]
            audit_delivered = [it.id for it in c.get("work+audit", 1000, timeout_ms=1000)]
        expired = set(range(61, 81)) | set(range(141, 161))  # the puts k = 3 and 7
        assert [i for i, _ in got] == [
            i for i in [*range(31, 41), *range(51, 201)] if i not in expired]
        assert sorted(got) == sorted(delivered)
        assert audit_ids == sorted(audit_delivered) == [
            i for i in range(2, 201) if i not in expired]
    finally:
        server.kill()


def test_writer_rows_come_out_of_the_server(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    server = ServerProcess(data, tmp_path / "server.log").start()
    try:
        addr = f"127.0.0.1:{server.rpc}"
        n = 2500
        df = spark.createDataFrame(
            [("a" if i % 3 else "b", bytes(f"row-{i}", "ascii")) for i in range(n)],
            "queue string, data binary").repartition(3)
        df.write.format("queued").mode("append").option("server", addr).option(
            "batch_size", "100").save()
        plain = spark.createDataFrame([(f"s{i}",) for i in range(10)], "data string")
        plain.write.format("queued").mode("append").option("server", addr).option(
            "queue", "c").save()
        with Client(addr) as c:
            got = {q: sorted(it.data for it in c.get(q, 5000, timeout_ms=1000))
                   for q in ("a", "b", "c")}
        assert got["a"] == sorted(bytes(f"row-{i}", "ascii") for i in range(n) if i % 3)
        assert got["b"] == sorted(bytes(f"row-{i}", "ascii") for i in range(n) if not i % 3)
        assert got["c"] == sorted(b"s%d" % i for i in range(10))
        with pytest.raises(Exception, match="append"):
            plain.write.format("queued").mode("overwrite").option("server", addr).option(
                "queue", "c").save()
    finally:
        server.kill()


def test_stream_picks_up_new_items_and_resumes_without_duplicates(
        spark: Any, tmp_path: Path) -> None:
    data, sink, ckpt = tmp_path / "data", tmp_path / "sink", tmp_path / "ckpt"
    trio.run(write_items, data, "s", 1, 120)
    trio.run(write_items, data, "t", 1, 15)

    def start(trigger: dict[str, Any]) -> Any:
        stream = (spark.readStream.format("queued").option("max_items_per_trigger", "50")
                  .load(str(data)))
        return (stream.writeStream.format("parquet").option("path", str(sink))
                .option("checkpointLocation", str(ckpt)).trigger(**trigger).start())

    q = start({"processingTime": "0 seconds"})
    try:
        q.processAllAvailable()
        trio.run(write_items, data, "s", 121, 60)  # appended while the query runs
        q.processAllAvailable()
        sizes = [p["numInputRows"] for p in q.recentProgress]
    finally:
        q.stop()
    assert max(sizes) <= 50 and sum(sizes) == 195
    trio.run(write_items, data, "s", 181, 40)
    trio.run(write_items, data, "u", 1, 7)
    q = start({"availableNow": True})  # a restart from the same checkpoint
    assert q.awaitTermination(120)
    out = rows(spark.read.parquet(str(sink)))
    expected = sorted(journal_rows(data, "s") + journal_rows(data, "t") + journal_rows(data, "u"))
    assert out == expected  # everything, each row once


def test_stream_refuses_to_skip_compacted_segments(tmp_path: Path) -> None:
    data, archive = tmp_path / "data", tmp_path / "archive"
    trio.run(write_items, data, "q", 1, 300, archive)

    async def consume_and_compact() -> None:
        async with open_data_dir(data, DataDirConfig(archive_dir=archive),
                                 queue_config=lambda _: SMALL) as dd:
            q = dd.queue("q")
            await q.write_checkpoint("", 250)
            result = await q.compact()
            assert result.removed > 0

    trio.run(consume_and_compact)
    inc = js.summarize_segment(js.list_segments(data)[-1].path).incarnation
    start, end = {"q": {"id": 100, "incarnation": inc}}, {"q": {"id": 300, "incarnation": inc}}
    reader = QueuedStreamReader({"path": str(data)})
    with pytest.raises(QueuedDataSourceError, match=r"ids 101\.\.[0-9]+ of queue 'q' are gone"):
        reader.latestOffset(start, None)
    with pytest.raises(QueuedDataSourceError, match="archive_dir"):
        reader.partitions(start, end)
    # failOnDataLoss=false: a warning, and the stream goes on from the earliest item.
    lenient = QueuedStreamReader({"path": str(data), "failOnDataLoss": "false"})
    assert lenient.latestOffset(start, None)["q"]["id"] == 300
    kept = [i for part in lenient.partitions(start, end)
            for batch in lenient.read(part) for i in batch.column("id").to_pylist()]
    assert kept and kept == sorted(kept) and kept[-1] == 300 and 101 not in kept
    # With the archive, the stream reads the retired segments from there.
    reader = QueuedStreamReader({"path": str(data), "archive_dir": str(archive)})
    ids = [i for part in reader.partitions(start, end)
           for batch in reader.read(part) for i in batch.column("id").to_pylist()]
    assert ids == list(range(101, 301))
    assert reader.latestOffset(start, None)["q"]["id"] == 300


def test_batch_read_with_the_archive_sees_every_record(spark: Any, tmp_path: Path) -> None:
    data, archive = tmp_path / "data", tmp_path / "archive"
    trio.run(write_items, data, "q", 1, 800, archive)
    everything = journal_rows(data, "q")

    async def consume_and_compact() -> None:
        async with open_data_dir(data, DataDirConfig(archive_dir=archive),
                                 queue_config=lambda _: SMALL) as dd:
            q = dd.queue("q")
            # Consumed: up to 100, then all but 150-152 up to 700 (the stragglers).
            await q.write_checkpoint("", 100, [i for i in range(101, 701)
                                               if i not in (150, 151, 152)])
            result = await q.compact()
            assert result.removed > 0 and result.rewritten > 0

    trio.run(consume_and_compact)
    in_data = {Path(s.path).name for s in js.list_segments(data)}
    in_archive = {Path(s.path).name for s in js.list_segments(archive)}
    assert in_data & in_archive  # a compaction output kept its original's name
    merged = js.list_segments_with_archive(data, archive)
    assert sorted(Path(s.path).name for s in merged) == sorted(in_data | in_archive)
    assert all(Path(s.path).parent == archive for s in merged
               if Path(s.path).name in in_archive)
    df = spark.read.format("queued").option("archive_dir", str(archive)).load(str(data))
    assert rows(df) == everything  # each record once: no straggler twice
    alone = {r[1] for r in rows(spark.read.format("queued").load(str(data)))}
    assert {150, 151, 152} <= alone and 100 not in alone and 300 not in alone

    # A segment the server retires after planning is read from the archive.
    reader = QueuedBatchReader({"path": str(data), "archive_dir": str(archive)})
    parts = reader.partitions()
    live = [seg for p in parts for seg in p.segments  # type: ignore[attr-defined]
            if Path(seg.path).parent == data]
    assert live
    moved = Path(live[-1].path)
    moved.rename(archive / moved.name)
    got = [i for p in parts for b in reader.read(p) for i in b.column("id").to_pylist()]
    assert got == [r[1] for r in everything]
    # Without the archive option, the same is a clear error.
    without = QueuedBatchReader({"path": str(data)})
    parts = without.partitions()
    moved = Path(parts[-1].segments[-1].path)  # type: ignore[attr-defined]
    moved.rename(tmp_path / moved.name)
    with pytest.raises(QueuedDataSourceError, match=r"removed while the query ran.*archive_dir"):
        list(without.read(parts[-1]))


def test_journal_to_parquet_job(spark: Any, tmp_path: Path) -> None:
    import importlib.util

    job_path = Path(__file__).parent.parent / "deploy" / "spark" / "journal_to_parquet.py"
    spec = importlib.util.spec_from_file_location("journal_to_parquet", job_path)
    assert spec is not None and spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    archive, out = tmp_path / "archive", tmp_path / "out"
    trio.run(write_items, archive, "x", 1, 50)
    trio.run(write_items, archive, "y", 1, 20)
    summary = {r["queue"]: r for r in job.convert(spark, str(archive), str(out))}
    assert {q: r["items"] for q, r in summary.items()} == {"x": 50, "y": 20}
    assert summary["y"]["bytes"] == sum(len(item("y", i)) for i in range(1, 21))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["queue=x", "queue=y"]
    assert [p.name for p in (out / "queue=x").iterdir()] == ["day=2023-11-14"]
    back = spark.read.parquet(str(out))
    assert sorted((r.queue, r.id, bytes(r.data)) for r in back.collect()) == sorted(
        (q, i, item(q, i)) for q, n in (("x", 50), ("y", 20)) for i in range(1, n + 1))
