"""Startup counts a reader's backlog from recovery's segment facts, not by reading it again,
and leaves the items on disk for read-behind.

The fast count (segments past the memory window, without a `done` id inside) must agree
with the slow one (every item decoded) and with what was put.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from broker_util import make_config, stats, with_default

import queued.broker.registry
import queued.storage.journal
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


@pytest.mark.parametrize("fast", [True, False])
async def test_restart_counts_the_backlog_exactly(
    tmp_path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    items, nbytes = await fill(tmp_path)
    cfg = with_default(make_config(tmp_path), max_memory_size=2048, journal_size=4096)
    if not fast:  # as if recovery had not learnt the data bytes: every item is decoded
        real = queued.broker.registry.count_unconsumed

        def slow(journal, head, done):  # type: ignore[no-untyped-def]
            for seg in journal.segments:
                seg.data_bytes = None
            return real(journal, head, done)

        monkeypatch.setattr(queued.broker.registry, "count_unconsumed", slow)
    decoded: list[int] = []
    real_read = queued.storage.journal.read_segment

    def spy(seg, from_id, to_id):  # type: ignore[no-untyped-def]
        decoded.append(seg.number)
        return real_read(seg, from_id, to_id)

    # (the module function QueueJournal.iter_segment calls: a compiled class's methods
    # cannot be replaced, a name it looks up in its module can)
    monkeypatch.setattr(queued.storage.journal, "read_segment", spy)
    async with open_broker(cfg) as broker:
        segments = len(broker.queues["q"].journal.segments)
        # Fast: only the segment holding the done ids is decoded to count (read-behind
        # then warms memory from the first segments); slow: every segment.
        assert (len(decoded) < 5) if fast else (len(decoded) >= segments)
        got = stats(broker)
        assert (got["items"], got["bytes"]) == (items, nbytes)
        assert got["mem_bytes"] <= 2048
        assert len(broker.queues["q"].journal.segments) > 20
        # And the items themselves: id 2 came back (it was open), 1, 3, 4 did not.
        ids = []
        while (it := await broker.get("q")) is not None:
            ids.append(it.id)
        assert ids == [2, *range(5, 3001)]
