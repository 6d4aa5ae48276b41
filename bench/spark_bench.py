"""Spark data source throughput: scan a ~1 GiB journal with local[2] against
`spark.read.parquet` of the same rows in the same run, and the writer into a server.

    .venv/bin/python bench/spark_bench.py [--mb 1024] [--item 200] [--payload json]
                                          [--write-rows 200000] [--ceiling] [--repeat 3]

Prints rows/s and MB/s of each scan (every column is used, so Parquet cannot prune), the
median of `--repeat` runs taken in turns (journal, Parquet, ceiling, journal, ...), their
ratios (and with --ceiling a Markdown table row), and rows/s written into a `queued serve`
subprocess by df.write (default options, after an untimed 10-row write has started the
Python workers).
"""

from __future__ import annotations

import argparse
import base64
import random
import shutil
import tempfile
import time
from pathlib import Path

import trio
from benchlib import QueuedServer, recording, spark_done, spark_session

from queued.config import FsyncPolicy, JournalConfig
from queued.storage.opening import open_data_dir

T0 = 1_700_000_000_000
AGG = ["count(queue)", "sum(id)", "max(add_time)", "count(expire_time)", "sum(error_count)",
       "sum(length(data))"]


KINDS = [b"click", b"view", b"purchase", b"signup", b"refund", b"search"]


def payloads(kind: str, item: int, start: int, k: int, rnd: random.Random) -> list[bytes]:
    """`k` items of `item` bytes. json: an event record with a few repeating fields and a
    random base64 note (compresses about 1.5x, like real messages); random: incompressible;
    repeat: one byte repeated (compresses ~100x: Parquet's best case)."""
    if kind == "repeat":
        return [b"%012d" % (start + j) + b"x" * (item - 12) for j in range(k)]
    if kind == "random":
        blob = rnd.randbytes(item * k)
        return [blob[j * item:(j + 1) * item] for j in range(k)]
    note = base64.b64encode(rnd.randbytes(item * k))
    out = []
    for j in range(k):
        n = start + j
        head = (b'{"seq":%d,"user":"u%05d","kind":"%s","amount":%d.%02d,"note":"'
                % (n, n % 50_000, KINDS[n % len(KINDS)], n % 997, n % 100))
        room = max(0, item - len(head) - 2)
        out.append(head + note[j * item:j * item + room] + b'"}')
    return out


async def make_journal(path: Path, mb: int, item: int, kind: str) -> int:
    n = (mb << 20) // (item + 34)
    cfg = JournalConfig(fsync=FsyncPolicy.parse("never"))
    rnd = random.Random(6)
    async with open_data_dir(path, queue_config=lambda _: cfg) as dd:
        per_queue = n // 4
        for qi in range(4):
            q = dd.queue(f"bench{qi}")
            for i in range(0, per_queue, 2000):
                k = min(2000, per_queue - i)
                await q.append(payloads(kind, item, i, k, rnd), T0 + i)
    return per_queue * 4


def ceiling_source(data: Path, partitions: int, rows: int) -> type:
    """A Python data source with the journal source's schema that decodes nothing: each
    task builds its Arrow batches once (from the journal's first segment, before the
    timing matters little: one 8 MiB chunk) and yields them again and again, `rows` in all
    over `partitions` tasks. What is left is PySpark's cost of a Python data source."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from queued.spark.arrow import chunk_to_arrow
    from queued.spark.source import SCHEMA
    from queued.storage import journal_scan as js

    first = str(min(js.list_segments(data), key=lambda s: s.number).path)

    class Part(InputPartition):
        def __init__(self, n: int) -> None:
            self.n = n

    class Reader(DataSourceReader):
        def partitions(self) -> list[Part]:
            each = rows // partitions
            return [Part(each + (rows % partitions if k == 0 else 0))
                    for k in range(partitions)]

        def read(self, partition: Part):  # type: ignore[no-untyped-def]
            batch = chunk_to_arrow("q", next(js.scan_segment(first)))
            left = partition.n
            while left > 0:
                out = batch.slice(0, min(left, batch.num_rows))
                left -= out.num_rows
                yield out

    class Ceiling(DataSource):
        @classmethod
        def name(cls) -> str:
            return "queued_ceiling"

        def schema(self) -> str:
            return SCHEMA

        def reader(self, schema: object) -> Reader:
            return Reader()

    return Ceiling


def timed(spark: object, df: object) -> tuple[float, list[object]]:
    t = time.perf_counter()
    out = df.selectExpr(*AGG).collect()  # type: ignore[attr-defined]
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--item", type=int, default=200)
    ap.add_argument("--payload", choices=["json", "random", "repeat"], default="json")
    ap.add_argument("--write-rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each scan (median)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time a Python data source that decodes nothing (PySpark's share)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="queued-spark-bench-"))
    try:
        data = tmp / "data"
        t = time.perf_counter()
        rows = trio.run(make_journal, data, args.mb, args.item, args.payload)
        size = sum(p.stat().st_size for p in data.iterdir())
        print(f"journal: {rows} rows of {args.item} B {args.payload}, {size / 2**20:.0f} MiB in "
              f"{len(list(data.iterdir()))} files, written in {time.perf_counter() - t:.1f} s")
        spark = spark_session()
        journal_df = spark.read.format("queued").load(str(data))
        journal_df.write.parquet(str(tmp / "parquet"))
        pq_size = sum(p.stat().st_size for p in (tmp / "parquet").rglob("*.parquet"))
        timed(spark, journal_df)  # warm up the Python workers and the JIT
        scans = {"journal": journal_df, "parquet": spark.read.parquet(str(tmp / "parquet"))}
        if args.ceiling:
            nparts = journal_df.rdd.getNumPartitions()
            spark.dataSource.register(ceiling_source(data, nparts, rows))
            scans["ceiling"] = spark.read.format("queued_ceiling").load()
            timed(spark, scans["ceiling"])
            print(f"ceiling: a Python data source that decodes nothing, {nparts} tasks")
        # Rounds of one scan each, in turns, so that a load change hits all of them alike.
        times: dict[str, list[float]] = {name: [] for name in scans}
        for _ in range(args.repeat):
            for name, df in scans.items():
                times[name].append(timed(spark, df)[0])
        results = {}
        for name, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            mb = (size if name == "journal" else pq_size if name == "parquet" else 0) / 2**20
            results[name] = rows / med
            rates = ", ".join(f"{rows / t:,.0f}" for t in ts)
            print(f"{name:8} scan: median {med:6.2f} s  {rows / med:12,.0f} rows/s"
                  + (f"  {mb / med:8.1f} MB/s (of {mb:.0f} MiB on disk)" if mb else "")
                  + f"  [runs: {rates}]")
        print(f"journal/parquet rows/s ratio: {results['journal'] / results['parquet']:.2f}")
        if args.ceiling:
            print(f"ceiling/parquet: {results['ceiling'] / results['parquet']:.2f}, "
                  f"journal/ceiling: {results['journal'] / results['ceiling']:.2f}")
            print("| journal | Parquet | ceiling | journal / Parquet | ceiling / Parquet | "
                  "journal / ceiling |")
            print(f"| {results['journal']:,.0f} | {results['parquet']:,.0f} | "
                  f"{results['ceiling']:,.0f} | "
                  f"{results['journal'] / results['parquet']:.2f} | "
                  f"{results['ceiling'] / results['parquet']:.2f} | "
                  f"{results['journal'] / results['ceiling']:.2f} |")

        if args.write_rows <= 0:
            spark_done(spark)
            return
        with QueuedServer(tmp) as server:
            port = server.ports["rpc"]
            src = spark.range(args.write_rows, numPartitions=2).selectExpr(
                f"cast(repeat('y', {args.item}) as binary) as data")
            src.cache().count()
            sink = src.write.format("queued").mode("append").option(
                "server", f"127.0.0.1:{port}").option("queue", "w")
            src.limit(10).write.format("queued").mode("append").option(
                "server", f"127.0.0.1:{port}").option("queue", "warmup").save()  # workers up
            t = time.perf_counter()
            sink.save()
            dt = time.perf_counter() - t
            print(f"writer: {args.write_rows} rows of {args.item} B in {dt:.2f} s = "
                  f"{args.write_rows / dt:,.0f} rows/s into the server")
        spark_done(spark)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recording("spark_bench"):
        main()
