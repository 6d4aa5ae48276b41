"""Helpers for the storage tests: item data, configs, segment files, filling a queue."""

from __future__ import annotations

from pathlib import Path

from queued.config import JournalConfig
from queued.journal import format as jf
from queued.storage.datadir import DataDir, open_data_dir

T0 = 1_700_000_000_000


def data_for(i: int) -> bytes:
    """The data of item `i`: variable length, derivable from the id alone."""
    return b"item-%d-" % i + bytes([i % 251]) * (i % 37)


def cfg(**kw: object) -> JournalConfig:
    return JournalConfig(**kw)  # type: ignore[arg-type]


def segments(path: Path, queue: str = "q") -> list[Path]:
    """The segment files of `queue` in `path`, oldest first."""
    found = [p for p in path.iterdir() if (n := jf.parse_file_name(p.name)) and n.queue == queue
             and n.role is jf.FileRole.SEGMENT]
    return sorted(found, key=lambda p: int(p.name.split(".")[1]))


def queue_files(path: Path, queue: str = "q") -> list[str]:
    """Every journal file name of `queue` in `path`, sorted."""
    return sorted(
        p.name for p in path.iterdir()
        if (n := jf.parse_file_name(p.name)) is not None and n.queue == queue
    )


async def fill(path: Path, n: int, *, per_append: int = 1, **kw: object) -> None:
    """Items 1..n into queue "q" of `path`, `per_append` per append, then close."""
    async with open_data_dir(path, queue_config=lambda _: cfg(**kw)) as dd:
        q = dd.queue("q")
        i = 1
        while i <= n:
            await q.append([data_for(j) for j in range(i, min(n, i + per_append - 1) + 1)], T0)
            i += per_append


def all_puts(path: Path, **kw: object) -> list[jf.Put]:
    """Every PUT of queue "q" after recovering `path`."""
    dd = DataDir.open(path, **kw)  # type: ignore[arg-type]
    return list(dd.queues["q"].iter_puts(1))
