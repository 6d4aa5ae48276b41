"""Startup counts a reader's backlog from recovery's segment facts, not by reading it again,
and leaves the items on disk for read-behind.

The fast count (segments past the memory window, without a `done` id inside) must agree
with the slow one (every item decoded) and with what was put.
"""

from __future__ import annotations

from pathlib import Path, PosixPath
from typing import Any

import pytest
from broker_util import make_config, stats, with_default

import queued.broker.registry
from queued.broker.upkeep import open_broker
from queued.reader.open_reads import OpenReads


async def fill(tmp_path: Path) -> tuple[int, int]:
    """3,000 items of varied sizes over many small segments; some confirmed out of order.

    Returns the (items, bytes) that must be waiting after a restart.
    """
    cfg = with_default(make_config(tmp_path), max_memory_size=2048, journal_size=4096)
    sizes = [(i * 37) % 200 + 1 for i in range(3000)]
    async with open_broker(cfg) as broker:
        for i in range(0, 3000, 50):
            await broker.put("q", [b"x" * n for n in sizes[i : i + 50]])
        first = await broker.get("q")  # id 1, consumed
        assert first is not None
        holder = broker.register(OpenReads())
        opened = [await broker.get("q", client=holder, open=True) for _ in range(3)]
        # Confirm the 2nd and 3rd while the 1st stays open: READ_DONE ids 3 and 4.
        assert all(it is not None for it in opened)
        broker.confirm(holder, "q", ids=[opened[1].id, opened[2].id])  # type: ignore[union-attr]
        await broker.checkpoint_all()
    consumed = {1, 3, 4}
    return 3000 - len(consumed), sum(n for i, n in enumerate(sizes, 1) if i not in consumed)


class _CountingPath(PosixPath):
    """A segment's path that notes each time the segment file is opened (to be read)."""

    opened: list[str] = []

    def open(self, *args: Any, **kwargs: Any) -> Any:
        _CountingPath.opened.append(self.name)
        return super().open(*args, **kwargs)


@pytest.mark.parametrize("fast", [True, False])
async def test_restart_counts_the_backlog_exactly(
    tmp_path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    items, nbytes = await fill(tmp_path)
    cfg = with_default(make_config(tmp_path), max_memory_size=2048, journal_size=4096)
    real = queued.broker.registry.count_unconsumed
    decoded = _CountingPath.opened
    decoded.clear()

    # (the function the registry hands to a thread: an interpreted module's, looked up
    # in the registry's globals. Segment reads are counted through each segment's path,
    # which the compiled journal and files code open: their functions call each other
    # directly, so no module name of theirs can be replaced.)
    def counting(journal, head, done):  # type: ignore[no-untyped-def]
        for seg in journal.segments:
            seg.path = _CountingPath(seg.path)
            if not fast:  # as if recovery had not learnt the data bytes: all decoded
                seg.data_bytes = None
        return real(journal, head, done)

    monkeypatch.setattr(queued.broker.registry, "count_unconsumed", counting)
    async with open_broker(cfg) as broker:
        segments = len(broker.queues["q"].journal.segments)
        # Fast: only the segment holding the done ids is decoded to count (read-behind
        # then warms memory from the first segments); slow: every segment.
        assert (1 <= len(decoded) < 5) if fast else (len(decoded) >= segments)
        got = stats(broker)
        assert (got["items"], got["bytes"]) == (items, nbytes)
        assert got["mem_bytes"] <= 2048
        assert len(broker.queues["q"].journal.segments) > 20
        # And the items themselves: id 2 came back (it was open), 1, 3, 4 did not.
        ids = []
        while (it := await broker.get("q")) is not None:
            ids.append(it.id)
        assert ids == [2, *range(5, 3001)]
