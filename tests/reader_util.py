"""Helpers for the tests of the pure reader (queued.reader.state.Reader): items, limits,
taking and aborting as the broker does, and read-behind over an in-memory journal."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from queued.journal.format import DelayedPut, Put
from queued.reader.state import Reader

T0 = 1_700_000_000_000


@dataclass(frozen=True)
class Limits:
    max_items: int = 0
    max_size: int = 0
    max_memory_size: int = 1 << 20
    discard_old_when_full: bool = False


def small_pack_reader(*args: Any, **kwargs: Any) -> Reader:
    """A Reader that packs as the server does, in blocks of 2 once 3 items wait (the state
    machine rarely holds 256). Set on the instance, not in a subclass: a compiled Reader
    takes no interpreted subclass."""
    r = Reader(*args, **kwargs)
    r.pack_at = 3
    r.pack_block = 2
    return r


def held(r: Reader) -> list[Put]:
    """The items a reader holds in memory, in delivery order."""
    return [*r.front, *reversed(r.unpacked), *(r.packed or ()), *r.mem]


def item(i: int, size: int = 10, *, expire: int | None = None, add: int = T0) -> Put:
    return Put(i, bytes([i % 256]) * size, add, expire)


def items(ids: Iterable[int], size: int = 10, **kw: int | None) -> list[Put]:
    return [item(i, size, **kw) for i in ids]  # type: ignore[arg-type]


def reader(**limits: int | bool) -> Reader:
    return Reader("q", "", Limits(**limits))  # type: ignore[arg-type]


def take_id(r: Reader, now: int = T0) -> int | None:
    expired: list[Put] = []
    it = r.take(now, expired)
    assert not expired
    return None if it is None else it.id


def take_open(r: Reader, now: int = T0) -> Put:
    expired: list[Put] = []
    it = r.take(now, expired)
    assert it is not None and not expired
    r.open_read(it)
    return it


def take_consume(r: Reader, now: int = T0) -> Put:
    it = take_open(r, now)
    assert r.confirm(it.id)
    return it


def abort_ids(r: Reader, ids: Iterable[int], *, count_error: bool = True) -> None:
    """What Broker.abort does: highest id first, so the lowest ends up at the head."""
    for i in sorted(ids, reverse=True):
        it = r.abort(i, count_error=count_error)
        assert it is not None
        r.put_back(it)


def read_range(journal: dict[int, Put], start: int, end: int, budget: int) -> tuple[list[Put], int]:
    """queued.broker.readback.read_range over an in-memory journal."""
    out: list[Put] = []
    nbytes = 0
    for i in sorted(journal):
        if not start <= i <= end:
            continue
        put = journal[i]
        if out and nbytes + len(put.data) > budget:
            return out, i
        out.append(put)
        nbytes += len(put.data)
    return out, end + 1


def refill(r: Reader, journal: dict[int, Put]) -> None:
    assert r.behind is not None
    start = r.behind
    got, next_id = read_range(journal, start, r.tail, r.refill_budget())
    r.load(start, got, next_id)


def take_all(r: Reader, journal: dict[int, Put], *, max_mem: int | None = None) -> list[int]:
    """Take, open and confirm every item, refilling from `journal` whenever the reader is
    behind: the ids in the order taken (memory within `max_mem` after each, if given)."""
    got: list[int] = []
    for _ in range(100 * (len(journal) + 1)):
        it = r.take(T0, [])
        if it is None:
            if r.behind is None:
                return got
            refill(r, journal)
            continue
        r.open_read(it)
        r.confirm(it.id)
        got.append(it.id)
        if max_mem is not None:
            assert r.mem_bytes <= max_mem
    raise AssertionError(f"no end after {got}")


def recovered(journal: dict[int, Put], head: int, done: Iterable[int], max_memory_size: int,
              due: Mapping[int, int] | None = None
              ) -> tuple[list[Put], int | None, int, int, list[tuple[int, int, int]]]:
    """What recovery (broker/readback) hands a restarted reader checkpointed at `head`,
    `done`: the items it has not consumed, as (the first of them that fit in memory, the id
    where the rest begins on disk or None, their count, their bytes, the delayed ones as
    (due, id, size)). An item is delayed if it is a DelayedPut or `due` has its id."""
    due = {} if due is None else due
    mem: list[Put] = []
    delayed: list[tuple[int, int, int]] = []
    mem_bytes = count = nbytes = 0
    behind = None
    for i in sorted(replay(journal, head, done)):  # what readback.count_unconsumed counts
        p = journal[i]
        count += 1
        nbytes += len(p.data)
        if type(p) is DelayedPut or i in due:
            delayed.append((due.get(i, getattr(p, "due_ms", 0)), i, len(p.data)))
        elif behind is None and (mem_bytes + len(p.data) <= max_memory_size or not mem):
            mem.append(p)
            mem_bytes += len(p.data)
        elif behind is None:
            behind = i
    return mem, behind, count, nbytes, delayed


def replay(journal: dict[int, Put], head: int, done: Iterable[int]) -> set[int]:
    d = set(done)
    return {i for i in journal if i > head and i not in d}
