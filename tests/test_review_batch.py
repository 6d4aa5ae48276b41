"""Review of the batched get/confirm/add paths (20f213b, 463d32c, 18e58c3, 6c2b222):
real brokers over real data directories (tests/test_broker.py's helpers), the pure
reader against the per-item path, and a restart after each scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_broker import T0, FakeClock, datas, make_config
from test_queue import reader, replay, take_open

from queued.broker.upkeep import open_broker
from queued.core.journal_format import DelayedPut, Put
from queued.core.open_reads import OpenReads
from queued.core.queue import Reader


async def test_confirmed_due_item_is_not_delivered_again_after_a_restart(
    tmp_path: Path,
) -> None:
    # A due item is delivered before a plain item with a lower id still held. A
    # checkpoint while it is open finds nothing delayed any more; its confirm then
    # moved the reader's head past the held item and listed it nowhere, so the next
    # checkpoint (head below the held item) forgot it was consumed.
    cfg = make_config(tmp_path)
    clock = FakeClock(T0)
    async with open_broker(cfg, clock=clock) as broker:
        await broker.put("q", [b"plain"])
        await broker.put("q", [b"delayed"], delay_ms=10)
        clock.now += 20
        c = broker.register(OpenReads())
        assert datas(await broker.get_many("q", max_items=1, client=c, open=True)) == [b"delayed"]
        await broker.checkpoint_all(force=True)
        assert broker.confirm(c, "q") == 1
        await broker.put("q", [b"later"])  # (a writer round: the confirm is journaled)
        await broker.checkpoint_all(force=True)
    async with open_broker(cfg, clock=clock) as broker:
        got = datas(await broker.get_many("q", max_items=10))
        got += datas(await broker.get_many("q", max_items=10))
        assert sorted(got) == [b"later", b"plain"]


def _due_before_plain(bulk: bool) -> tuple[dict[int, Put], Reader]:
    store: dict[int, Put] = {
        1: Put(1, b"a" * 10, T0, None),
        2: DelayedPut(2, b"b" * 10, T0, None, due_ms=T0 + 5),
        3: DelayedPut(3, b"c" * 10, T0, None, due_ms=T0 + 5),
    }
    r = reader()
    r.add(list(store.values()))
    a, b = take_open(r, T0 + 10), take_open(r, T0 + 10)
    assert (a.id, b.id) == (2, 3)  # due first, ahead of the plain item 1
    assert (r.confirm_many([2]) if bulk else [2] * r.confirm(2)) == [2]
    r.checkpoint()  # finds nothing delayed any more
    assert (r.confirm_many([3]) if bulk else [3] * r.confirm(3)) == [3]
    return store, r


@pytest.mark.parametrize("bulk", [False, True], ids=["confirm", "confirm_many"])
def test_reader_confirm_of_a_due_item_ahead_of_a_held_one_is_checkpointed(bulk: bool) -> None:
    store, r = _due_before_plain(bulk)
    head, done = r.checkpoint()
    assert replay(store, head, done) == {1}
