"""Item headers in the Spark data source (a real local SparkSession, the one of
tests/test_spark.py): `includeHeaders` gives the Kafka source's `headers` column
(array<struct<key: string, value: binary>>, null for an item without) on batch and
stream reads, expired items left out alike; the writer takes such a column and the
items carry it (read back from a real `queued serve`); a bad headers column is refused
with what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from server_util import ServerProcess
from spark_util import stream_to_table

from queued.client import Client
from queued.config import JournalConfig
from queued.journal.headers import encode_headers
from queued.storage.opening import open_data_dir

try:
    import pyarrow as pa

    from queued.spark.arrow import HEADERS_TYPE, chunk_to_arrow
    from queued.storage import journal_scan as js
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"pyspark/pyarrow not installed ({exc}); pip install -e '.[spark]'",
                allow_module_level=True)

T0 = 1_700_000_000_000
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def headers_of(i: int) -> dict[str, bytes | str]:
    """Item i's headers: none for every third item."""
    return {} if i % 3 == 0 else {"traceparent": TRACEPARENT, "i": b"%d" % i}


def as_column(headers: dict[str, bytes | str]) -> list[tuple[str, bytes]] | None:
    """What the headers column holds for them (strings as their UTF-8)."""
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in headers.items()] or None


def write_journal(data: Path, n: int) -> None:
    async def write() -> None:
        async with open_data_dir(data, queue_config=lambda _: JournalConfig(
                journal_size=4096)) as dd:
            q = dd.queue("h")
            for i in range(1, n + 1, 4):
                ids = range(i, min(n, i + 3) + 1)
                expire = T0 + 1 if i % 8 == 5 else None  # long expired: pending reads skip
                await q.append([b"item-%d" % j for j in ids], T0 + i, expire_time_ms=expire,
                               headers=[encode_headers(headers_of(j)) for j in ids])
    trio.run(write)


def collected(df: Any) -> list[tuple[int, list[tuple[str, bytes]] | None]]:
    return sorted((r[0], None if r[1] is None else [(h[0], bytes(h[1])) for h in r[1]])
                  for r in df.select("id", "headers").collect())


def test_include_headers_adds_the_kafka_sources_column(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    n = 120
    write_journal(data, n)
    assert len(js.list_segments(data)) > 2
    plain = spark.read.format("queued").load(str(data))
    assert "headers" not in plain.columns
    df = spark.read.format("queued").option("includeHeaders", "true").load(str(data))
    assert df.columns[-1] == "headers"
    assert df.schema["headers"].dataType.simpleString() == (
        "array<struct<key:string,value:binary>>")
    want = [(i, as_column(headers_of(i))) for i in range(1, n + 1)]
    assert collected(df) == want
    both = (spark.read.format("queued").option("includeHeaders", "true")
            .option("include_flags", "true").option("minPartitions", "5").load(str(data)))
    assert both.columns[-2:] == ["flags", "headers"] and collected(both) == want
    stream = (spark.readStream.format("queued").option("includeHeaders", "true")
              .option("maxOffsetsPerTrigger", "50").load(str(data)))
    assert collected(stream_to_table(stream, "headers_stream", tmp_path / "ckpt")) == want


def test_the_column_leaves_out_expired_items_alike(tmp_path: Path) -> None:
    """chunk_to_arrow with live_at_ms: the headers stay with their rows."""
    data = tmp_path / "data"
    write_journal(data, 40)
    rows = [chunk_to_arrow("h", chunk, T0 + 10**6, include_headers=True)
            for seg in js.list_segments(data) for chunk in js.scan_segment(seg.path)]
    table = pa.Table.from_batches(rows)
    assert table.schema.field("headers").type == HEADERS_TYPE
    ids = table.column("id").to_pylist()
    assert ids and all(i % 8 not in (5, 6, 7, 0) for i in ids)  # the expired puts' items
    got = [(i, None if h is None else [(d["key"], d["value"]) for d in h])
           for i, h in zip(ids, table.column("headers").to_pylist(), strict=True)]
    assert got == [(i, as_column(headers_of(i))) for i in ids]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("headers-server")
    proc = ServerProcess(root / "data", root / "server.log").start()
    try:
        yield proc
    finally:
        proc.kill()


def test_the_writer_takes_a_headers_column(spark: Any, server: ServerProcess,
                                           tmp_path: Path) -> None:
    addr = f"127.0.0.1:{server.rpc}"
    rows = [(b"d%d" % i, [("traceparent", TRACEPARENT.encode()), ("i", b"%d" % i)]
             if i % 2 else None) for i in range(30)]
    df = spark.createDataFrame(rows, "data binary, headers array<struct<key: string, "
                                     "value: binary>>").repartition(1)
    df.write.format("queued").mode("append").option("server", addr).option(
        "queue", "written").option("batch_size", "7").save()
    with Client(addr) as c:
        got = c.get("written", 100, 1000, with_headers=True)
    assert [(it.data, it.headers) for it in got] == [
        (d, dict(h) if h else {}) for d, h in rows]
    # A read with includeHeaders written on: the headers go along (values as bytes).
    data = tmp_path / "data"
    write_journal(data, 12)
    (spark.read.format("queued").option("includeHeaders", "true").load(str(data))
     .select("data", "headers").write.format("queued").mode("append")
     .option("server", addr).option("queue", "copied").save())
    with Client(addr) as c:
        copied = c.get("copied", 100, 1000, with_headers=True)
    assert sorted((it.data, sorted(it.headers.items())) for it in copied if it.headers) == sorted(
        (b"item-%d" % i, sorted(dict(as_column(headers_of(i)) or []).items()))
        for i in range(1, 13) if headers_of(i))


def test_a_bad_headers_column_is_refused(spark: Any, server: ServerProcess) -> None:
    addr = f"127.0.0.1:{server.rpc}"
    wrong = spark.createDataFrame([(b"x", {"k": "v"})], "data binary, headers map<string,string>")
    with pytest.raises(Exception, match="must be array<struct<key: string, value: binary>>"):
        wrong.write.format("queued").mode("append").option("server", addr).option(
            "queue", "bad").save()
    twice = spark.createDataFrame([(b"x", [("k", b"1"), ("k", b"2")])],
                                  "data binary, headers array<struct<key: string, "
                                  "value: binary>>")
    with pytest.raises(Exception, match="gives a key twice"):
        twice.write.format("queued").mode("append").option("server", addr).option(
            "queue", "bad").save()
    too_many = spark.createDataFrame([(b"x", [(f"k{i}", b"") for i in range(65)])],
                                     "data binary, headers array<struct<key: string, "
                                     "value: binary>>")
    with pytest.raises(Exception, match="over the limit of 64"):
        too_many.write.format("queued").mode("append").option("server", addr).option(
            "queue", "bad").save()
    with Client(addr) as c:
        assert c.get("bad", 10) == []
