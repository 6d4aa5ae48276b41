"""Helpers for the Spark tests: journals written by the real journal code (small segments),
rows read back from a DataFrame or straight from the journal, to compare, and a streaming
read run to its end into a memory table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from queued.config import DataDirConfig, JournalConfig
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

T0 = 1_700_000_000_000
SMALL = JournalConfig(journal_size=8192)


def item(queue: str, i: int) -> bytes:
    return f"{queue}-{i}-".encode() + bytes([i % 256]) * (i % 41)


async def write_items(path: Path, queue: str, first: int, n: int,
                      archive: Path | None = None) -> None:
    async with open_data_dir(path, DataDirConfig(archive_dir=archive),
                             queue_config=lambda _: SMALL) as dd:
        q = dd.queue(queue)
        i = first
        while i < first + n:
            batch = [item(queue, j) for j in range(i, min(first + n, i + 5))]
            if i % 2:
                await q.append(batch, T0 + i, expire_time_ms=T0 + 1000 * i, error_count=i % 3)
            else:
                await q.append(batch, T0 + i)
            i += len(batch)


def rows(df: Any) -> list[tuple[str, int, int, int | None, int, bytes]]:
    """(queue, id, add_ms, expire_ms, error_count, data), sorted; timestamps as epoch ms."""
    out = df.selectExpr("queue", "id", "unix_millis(add_time)", "unix_millis(expire_time)",
                        "error_count", "data").collect()
    return sorted((r[0], r[1], r[2], r[3], r[4], bytes(r[5])) for r in out)


def journal_rows(path: Path, queue: str) -> list[tuple[str, int, int, int | None, int, bytes]]:
    puts = DataDir.open(path).queues[queue].iter_puts(1)
    return [(queue, p.id, p.add_time_ms, p.expire_time_ms, p.error_count, p.data) for p in puts]


def stream_to_table(stream: Any, name: str, checkpoint: Path, timeout: float = 120) -> Any:
    """Run the streaming DataFrame `stream` to its end (trigger availableNow) into the memory
    table `name`, checkpointing in `checkpoint`; the table."""
    q = (stream.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(timeout)
    finally:
        q.stop()
    return stream.sparkSession.table(name)
