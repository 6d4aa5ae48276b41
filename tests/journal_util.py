"""Helpers for the storage tests: item data, configs, segment files, filling a queue, a
server's journals compacted away, and `queued check` / `queued dump` read back."""

from __future__ import annotations

import io
import struct
from collections import Counter
from pathlib import Path

from wait_util import wait_until

from queued.cli import check, dump
from queued.config import JournalConfig
from queued.journal import format as jf
from queued.storage.datadir import DataDir
from queued.storage.opening import open_data_dir

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


#: A server's config (TOML) whose journals roll every KiB and whose checkpoints, every
#: 20 ms, compact the consumed segments away.
COMPACTING = """
[server]
checkpoint_interval = "20ms"

[default]
journal_size = "1KiB"
"""


async def wait_compacted(path: Path, queue: str = "q") -> None:
    """Wait for a running server's checkpoint, then the compaction it starts, to leave
    `queue` at most one segment in `path`."""
    await wait_until(lambda: len(segments(path, queue)) <= 1,
                     why="the checkpoint, then the compaction it starts")


def checked(path: Path) -> str:
    """`queued check`'s report on the data directory `path`, which must pass."""
    report = io.StringIO()
    assert check(path, report) == 0, report.getvalue()
    return report.getvalue()


def dumped(path: Path) -> str:
    """`queued dump` of one journal file."""
    out = io.StringIO()
    dump(path, out)
    return out.getvalue()


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


def seed_reader(blob: bytes) -> tuple[list[tuple[int, int, bytes]], Counter[int]]:
    """Read a writer file the way seeds/002 describes it, and nothing more: the PUTs
    (id, error_count, data), and a count of the other commands, which it skips by their
    header words and (commands 8-15) data block."""
    assert blob[:4] == b"\x27\x64\x26\x03"
    puts: list[tuple[int, int, bytes]] = []
    skipped: Counter[int] = Counter()
    pos = 4
    while pos < len(blob) and blob[pos] != 0:
        command, words = blob[pos] >> 4, blob[pos] & 0x0F
        header = blob[pos + 1 : pos + 1 + 4 * words]
        assert len(header) == 4 * words
        size = struct.unpack_from("<i", header)[0] if command >= 8 else 0
        data = blob[pos + 1 + 4 * words : pos + 1 + 4 * words + size]
        assert len(data) == size
        if command == 8:
            assert words in (6, 8)
            _, errors, xid, _ = struct.unpack_from("<iiqq", header)
            puts.append((xid, errors, data))
        else:
            skipped[command] += 1
        pos += 1 + 4 * words + size
    assert pos == len(blob)
    return puts, skipped
