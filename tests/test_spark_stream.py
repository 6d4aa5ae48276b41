"""The `queued` source's Kafka-style options, lost-data checks and lag, and the streaming
sink, against the real local SparkSession of tests/test_spark_source.py (one for the whole run):
a queue deleted and created again under a running stream, compaction without an archive,
per-queue JSON offsets, timestamps, subscribePattern picking up a new queue, min and max
items per trigger, lag in the progress, unknown options, and writeStream stopped mid-way
and restarted from its checkpoint (each row once)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from server_util import ServerProcess
from spark_util import SMALL, T0, item, journal_rows, rows, write_items

from queued.client import Client
from queued.config import JournalConfig
from queued.storage import journal_scan as js
from queued.storage.opening import open_data_dir

try:
    from queued.spark.stream import QueuedStreamReader
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"pyspark/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)


def stream(spark: Any, data: Path, ckpt: Path, name: str, trigger: dict[str, Any],
           **options: str) -> Any:
    """A query reading `data` with `options` into the memory table `name`, or with
    `ckpt` given twice (restarts: the memory sink cannot), into Parquet files there."""
    df = spark.readStream.format("queued").options(**options).load(str(data))
    out = df.writeStream.option("checkpointLocation", str(ckpt)).trigger(**trigger)
    if name.startswith("/"):
        return out.format("parquet").option("path", name).start()
    return out.format("memory").queryName(name).start()


def ids(spark: Any, table: str, queue: str | None = None) -> list[int]:
    df = spark.read.parquet(table) if table.startswith("/") else spark.table(table)
    if queue is not None:
        df = df.where(f"queue = '{queue}'")
    return sorted(r[0] for r in df.select("id").collect())


async def recreate(data: Path, queue: str, n: int) -> None:
    """Delete the queue, then put n items into it again (ids restart at 1)."""
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        await dd.queue(queue).append([b"x"], T0)
        await dd.delete_queue(queue)
    await write_items(data, queue, 1, n)


RUN = {"processingTime": "50 milliseconds"}


async def write_at_once(data: Path, queue: str, first: int, n: int) -> None:
    """Items first..first+n-1 in one append (one batch): a running stream sees all or none
    of them (write_items appends five at a time, each batch visible as it lands)."""
    async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
        await dd.queue(queue).append([item(queue, i) for i in range(first, first + n)], T0)


def test_a_queue_deleted_and_created_again_under_a_running_stream(
        spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "q", 1, 40)
    strict = stream(spark, data, tmp_path / "c1", "strict", RUN)
    lenient = stream(spark, data, tmp_path / "c2", "lenient", RUN, failOnDataLoss="false")
    try:
        strict.processAllAvailable()
        lenient.processAllAvailable()
        trio.run(recreate, data, "q", 25)
        # The stream polls every 50 ms: if it saw item 41 (put just before the delete)
        # and plans its batch once the queue is gone, that batch's items are reported
        # gone; else the new incarnation is. Both are the loss, naming the queue.
        with pytest.raises(Exception, match=r"queue 'q' was deleted and created again|"
                           r"queue 'q' up to id 41 that this micro-batch was to read "
                           r"are gone \(the queue was deleted\)"):
            strict.processAllAvailable()
        lenient.processAllAvailable()  # a warning, then the new queue from its first item
        got = sorted((r[0], bytes(r[1])) for r in spark.table("lenient").select(
            "id", "data").collect())
    finally:
        strict.stop()
        lenient.stop()
    assert got == sorted([(i, item("q", i)) for i in range(1, 41)]
                         + [(i, item("q", i)) for i in range(1, 26)])


def test_compaction_without_an_archive_under_a_stream(spark: Any, tmp_path: Path) -> None:
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    trio.run(write_items, data, "q", 1, 100)
    out = str(tmp_path / "out")
    q = stream(spark, data, ckpt, out, {"availableNow": True})
    assert q.awaitTermination(120)
    assert ids(spark, out) == list(range(1, 101))
    trio.run(write_items, data, "q", 101, 300)

    async def consume_and_compact() -> None:
        async with open_data_dir(data, queue_config=lambda _: SMALL) as dd:
            await dd.queue("q").write_checkpoint("", 250)
            assert (await dd.queue("q").compact()).removed > 0

    trio.run(consume_and_compact)
    oldest = js.summarize_segment(js.list_segments(data)[0].path).first_id
    assert 101 < oldest <= 251
    q = stream(spark, data, ckpt, out, {"availableNow": True})
    with pytest.raises(Exception, match=rf"ids 101..{oldest - 1} of queue 'q' are gone"):
        q.awaitTermination(120)
    q = stream(spark, data, ckpt, out, {"availableNow": True}, failOnDataLoss="false")
    assert q.awaitTermination(120)
    assert ids(spark, out) == list(range(1, 101)) + list(range(oldest, 401))


def test_json_offsets_and_timestamps(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "a", 1, 300)  # add_time T0 + i for each batch of 5 from i
    trio.run(write_items, data, "b", 1, 30)

    def read(**options: str) -> dict[str, list[int]]:
        got = rows(spark.read.format("queued").options(**options).load(str(data)))
        return {q: [r[1] for r in got if r[0] == q] for q in ("a", "b")}

    both = read(startingOffsets='{"a": 100, "b": -2}', endingOffsets='{"a": 200}')
    assert both == {"a": list(range(100, 200)), "b": list(range(1, 31))}
    assert read(startingTimestamp=str(T0 + 150), endingTimestamp=str(T0 + 200)) == {
        "a": list(range(151, 201)), "b": []}
    assert read(startingOffsetsByTimestamp=json.dumps({"a": T0 + 10}), subscribe="a,b") == {
        "a": list(range(11, 301)), "b": list(range(1, 31))}
    assert read(queues="b", min_id="5", max_id="6") == {"a": [], "b": [5, 6]}  # old names
    split = spark.read.format("queued").option("minPartitions", 4).option(
        "subscribe", "a").load(str(data))
    assert split.rdd.getNumPartitions() >= 4 and sorted(
        r[0] for r in split.select("id").collect()) == list(range(1, 301))
    with pytest.raises(Exception, match=r"startingOffsets must be .*earliest"):
        read(startingOffsets='{"a": 0}')
    with pytest.raises(Exception, match="subscribe or subscribePattern, not both"):
        read(subscribe="a", subscribePattern="a")
    # Where a stream starts, by time: the offset is the last id before the first item
    # added at or after it ("b" has none: it starts at its latest).
    by_time = QueuedStreamReader({"path": str(data), "startingTimestamp": str(T0 + 150)})
    assert {q: p["id"] for q, p in by_time.initialOffset().items()} == {"a": 150, "b": 30}
    by_queue = QueuedStreamReader({"path": str(data), "startingOffsetsByTimestamp": json.dumps(
        {"a": T0 + 10}), "startingOffsets": "latest"})
    assert {q: p["id"] for q, p in by_queue.initialOffset().items()} == {"a": 10, "b": 30}
    # A stream from per-queue offsets: "a" from id 250, "b" (not named) from its earliest.
    q = stream(spark, data, tmp_path / "ck", "from_json", {"availableNow": True},
               startingOffsets='{"a": 250}')
    assert q.awaitTermination(120)
    assert ids(spark, "from_json", "a") == list(range(250, 301))
    assert ids(spark, "from_json", "b") == list(range(1, 31))


def test_subscribe_pattern_picks_up_a_new_queue(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "ev-1", 1, 20)
    trio.run(write_items, data, "other", 1, 5)
    q = stream(spark, data, tmp_path / "ck", "pattern", RUN, subscribePattern="ev-.*")
    try:
        q.processAllAvailable()
        trio.run(write_items, data, "ev-2", 1, 12)  # a queue created while the query runs
        q.processAllAvailable()
    finally:
        q.stop()
    got = rows(spark.table("pattern"))
    assert got == sorted(journal_rows(data, "ev-1") + journal_rows(data, "ev-2"))


def test_min_and_max_items_per_trigger_and_the_lag_in_progress(
        spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "m", 1, 30)
    q = stream(spark, data, tmp_path / "c1", "min_rows", RUN, minOffsetsPerTrigger="50",
               maxTriggerDelay="1h")
    try:
        q.processAllAvailable()
        assert ids(spark, "min_rows") == []  # 30 < 50: waits (up to an hour)
        # At once: written five at a time, 50 could be seen before the last 10 landed.
        trio.run(write_at_once, data, "m", 31, 30)
        q.processAllAvailable()
        sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    finally:
        q.stop()
    assert sizes == [60] and ids(spark, "min_rows") == list(range(1, 61))
    # maxTriggerDelay passed (0 s): what there is, however few.
    reader = QueuedStreamReader({"path": str(data), "minOffsetsPerTrigger": "1000",
                                 "maxTriggerDelay": "0s"})
    assert reader.latestOffset(reader.initialOffset(), None)["m"]["id"] == 60

    trio.run(write_items, data, "n", 1, 200)
    q = stream(spark, data, tmp_path / "c2", "max_rows", RUN, maxOffsetsPerTrigger="40",
               subscribe="n")
    try:
        q.processAllAvailable()
        progress = [p for p in q.recentProgress if p["numInputRows"]]
    finally:
        q.stop()
    assert [p["numInputRows"] for p in progress] == [40] * 5
    lag = [json.loads(p["sources"][0]["latestOffset"])["n"]["offsetsBehindLatest"]
           if isinstance(p["sources"][0]["latestOffset"], str)
           else p["sources"][0]["latestOffset"]["n"]["offsetsBehindLatest"]
           for p in progress]
    assert lag == [160, 120, 80, 40, 0]


def test_unknown_options_are_errors_that_list_the_valid_ones(
        spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    trio.run(write_items, data, "u", 1, 5)
    with pytest.raises(Exception, match=r"unknown option pendng for spark\.read.*valid "
                                        r"options: .*pending"):
        spark.read.format("queued").option("pendng", "true").load(str(data)).count()
    with pytest.raises(Exception, match=r"unknown option maxoffsetspertriger .*"
                                        r"maxOffsetsPerTrigger"):
        spark.readStream.format("queued").option("maxOffsetsPerTriger", 5).load(
            str(data)).writeStream.format("memory").queryName("bad").start().awaitTermination(60)
    df = spark.createDataFrame([("q", b"x")], "queue string, data binary")
    with pytest.raises(Exception, match=r"unknown option kafka\.bootstrap\.servers for "
                                        r"df\.write.*server"):
        df.write.format("queued").mode("append").option("kafka.bootstrap.servers", "x").save()
    with pytest.raises(Exception, match=r"unknown option srever for df\.writeStream"):
        (spark.readStream.format("queued").load(str(data)).select("data")
         .writeStream.format("queued").option("srever", "x")
         .option("checkpointLocation", str(tmp_path / "ck")).start().awaitTermination(60))
    with pytest.raises(Exception, match="maxOffsetsPerTrigger and max_items_per_trigger"):
        QueuedStreamReader({"path": str(data), "maxOffsetsPerTrigger": "5",
                            "max_items_per_trigger": "6"})


def test_write_stream_stopped_midway_and_restarted_stores_each_row_once(
        spark: Any, tmp_path: Path) -> None:
    data, ckpt = tmp_path / "journal", tmp_path / "ckpt"
    n, per_batch = 3000, 300

    async def source() -> None:
        async with open_data_dir(data, queue_config=lambda _: JournalConfig(
                journal_size=64 << 10)) as dd:
            for i in range(0, n, 100):
                await dd.queue("src").append([b"row-%d" % k for k in range(i, i + 100)], T0)

    trio.run(source)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log").start()
    addr = f"127.0.0.1:{server.rpc}"

    def start(trigger: dict[str, Any]) -> Any:
        df = spark.readStream.format("queued").option("maxOffsetsPerTrigger", per_batch).load(
            str(data)).selectExpr("'dst' as queue", "data")
        return (df.writeStream.format("queued").option("server", addr)
                .option("batch_size", "50").option("checkpointLocation", str(ckpt))
                .trigger(**trigger).start())

    try:
        q = start(RUN)
        try:
            for _ in range(600):  # bounded: until a few micro-batches are in
                if len(q.recentProgress) >= 3 or not q.isActive:
                    break
                time.sleep(0.05)
        finally:
            q.stop()  # mid-way: usually inside a micro-batch
        q = start({"availableNow": True})
        assert q.awaitTermination(180)
        got: list[bytes] = []
        with Client(addr) as c:
            for _ in range(100):
                items = c.get("dst", 5000, timeout_ms=0)
                if not items:
                    break
                got += [it.data for it in items]
    finally:
        server.kill()
    counts = Counter(got)
    assert set(counts) == {b"row-%d" % k for k in range(n)}  # every row
    # Exactly-once: the micro-batch the stop interrupted ran again, and stored only the rest.
    assert all(k == 1 for k in counts.values())


def test_segments_naming_no_incarnation_belong_to_the_life_before_them(tmp_path: Path) -> None:
    # q.1000: written before incarnations (ids 1-3); q.2000: the queue created again
    # (incarnation 777, ids 1-2); q.3000: a header recovery rewrote (names none).
    from queued.journal import format as jf

    def segment(number: int, head: bytes, ids: range) -> None:
        body = b"".join(jf.encode_put(jf.Put(i, b"d%d" % i, T0)) for i in ids)
        (tmp_path / jf.segment_name("q", number)).write_bytes(head + jf.seal(body, len(head)))

    segment(1000, jf.segment_head(0), range(1, 4))
    segment(2000, jf.segment_head(777), range(1, 3))
    (tmp_path / jf.segment_name("q", 3000)).write_bytes(jf.segment_head(0))
    reader = QueuedStreamReader({"path": str(tmp_path)})
    start = reader.initialOffset()
    assert start == {"q": {"id": 0, "incarnation": 777, "segment": 0}}
    assert reader.latestOffset(start, None)["q"] == {"id": 2, "incarnation": 777,
                                                     "segment": 2000}
    with pytest.raises(Exception, match=r"incarnation 0 -> 777"):
        reader.latestOffset({"q": 3}, None)  # an offset from before incarnations
