"""PackedItems: a deque of `Put`s for a reader's `mem` that holds small items packed.

PURE: no I/O. It owns how the bulk of the items a reader holds sit in memory, never
what they mean: every item it gives back equals (`==`) the one appended.

Why: a `Put` held as objects costs ~237 B of RSS at 64 B of data (its 80 B object, a
33 B bytes header, two ints, a deque slot). Here the newest items wait as objects in
`_tail` (the steady state, where consumers keep up, never packs anything); once
BLOCK_ITEMS wait there they become one `_Block`: their data concatenated in one
`bytes`, columns of ids and add times (`array('q')`, 8 B each) and data end offsets
(`array('I')`, 4 B), so a 64 B item costs 84 B plus a share of its block. Columns for
expire times and flags exist only in a block where one item has one; an item that is
not plain (a DelayedPut, an error count, data over SMALL_MAX, a value no column holds)
stays an object in the block's `objs`. Taking an item from a block (popleft,
iteration, `[0]`) makes a new `Put` (the head one is cached until it is popped).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate, repeat

from queued.core.journal_records import Put

#: Items per packed block: its fixed cost (~400 B: five objects and their headers) is
#: ~3 B per item, and the memory a partly taken block keeps is at most this many items'.
BLOCK_ITEMS = 128
#: Data longer than this stays in its Put object: a Put's ~200 B are < 10% of it.
SMALL_MAX = 2048

_I64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1
_NO_EXPIRE = -1  # `exps` column: no expire time
_PUT_ONLY = {Put}


@dataclass(frozen=True, slots=True)
class PackedStats:
    items: int  # held (len)
    blocks: int
    packed: int  # items in blocks, held packed
    objects: int  # items in blocks held as objects (not plain), plus the tail's
    packed_bytes: int  # the blocks' data


class _Block:
    """Packed items, oldest first."""

    __slots__ = ("data", "ends", "exps", "flgs", "ids", "objs", "times")

    def __init__(self, items: list[Put]) -> None:
        datas = [it.data for it in items]
        times = [it.add_time_ms for it in items]
        objs: dict[int, Put] | None = None
        exps: list[int] | None = None
        flgs: list[int] | None = None
        if not (set(map(type, items)) == _PUT_ONLY
                and [it.expire_time_ms for it in items].count(None) == len(items)
                and not any([it.error_count or it.flags for it in items])
                and max(map(len, datas)) <= SMALL_MAX
                and min(times) >= 0 and max(times) <= _I64_MAX):
            # (the fast test above fails for a block with one item not plain: sort it out)
            for k, it in enumerate(items):
                d, t, e, f = it.data, it.add_time_ms, it.expire_time_ms, it.flags
                if (type(it) is not Put or it.error_count or len(d) > SMALL_MAX
                        or not 0 <= t <= _I64_MAX or not 0 <= f <= _U32_MAX
                        or (e is not None and not 0 <= e <= _I64_MAX)):
                    if objs is None:
                        objs = {}
                    objs[k] = it
                    datas[k] = b""
                    times[k] = 0
                    continue
                if e is not None:
                    if exps is None:
                        exps = [_NO_EXPIRE] * len(items)
                    exps[k] = e
                if f:
                    if flgs is None:
                        flgs = [0] * len(items)
                    flgs[k] = f
        self.data = b"".join(datas)
        self.ends = array("I", list(accumulate(map(len, datas))))  # (lists: sized exactly)
        self.ids = array("q", [it.id for it in items])
        self.times = array("q", times)
        self.exps = None if exps is None else array("q", exps)
        self.flgs = None if flgs is None else array("I", flgs)
        self.objs = objs

    def __len__(self) -> int:
        return len(self.ids)

    def unpack(self) -> list[Put]:
        """Its items, made again (in bulk: about half the cost of one at a time)."""
        data, ends = self.data, self.ends
        datas = [data[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]
        if self.exps is None and self.flgs is None:
            out = list(map(Put, self.ids, datas, self.times))
        else:
            exps = (repeat(None) if self.exps is None
                    else [None if e == _NO_EXPIRE else e for e in self.exps])
            flgs = repeat(0) if self.flgs is None else self.flgs
            out = list(map(Put, self.ids, datas, self.times, exps, repeat(0), flgs))
        if self.objs is not None:
            for k, it in self.objs.items():
                out[k] = it
        return out


class PackedItems:
    """The deque API Reader.mem uses: len, truth, append, extend, popleft, [0],
    iteration (oldest first) and clear."""

    #: items per block (a class attribute so a test can make a subclass with small blocks)
    block_items = BLOCK_ITEMS

    __slots__ = ("_blocks", "_front", "_front_at", "_len", "_tail")

    def __init__(self, items: Iterable[Put] = ()) -> None:
        #: the oldest items, as objects (an unpacked block, or a former tail), from
        #: index _front_at on (None: taken)
        self._front: list[Put | None] = []
        self._front_at = 0
        self._blocks: deque[_Block] = deque()  # then these, packed, oldest first
        self._tail: list[Put] = []  # then the newest, as objects (< block_items)
        self._len = 0
        self.extend(items)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, it: Put) -> None:
        tail = self._tail
        tail.append(it)
        self._len += 1
        if len(tail) >= self.block_items:
            self._blocks.append(_Block(tail))
            self._tail = []

    def extend(self, items: Iterable[Put]) -> None:
        for it in items:
            self.append(it)

    def _refill(self) -> list[Put | None]:
        """The front, empty: made of the next block, or of the tail."""
        if self._blocks:
            front: list[Put | None] = self._blocks.popleft().unpack()  # type: ignore[assignment]
        else:
            front = self._tail  # type: ignore[assignment]
            self._tail = []
        self._front = front
        self._front_at = 0
        return front

    def popleft(self) -> Put:
        if not self._len:
            raise IndexError("pop from an empty PackedItems")
        self._len -= 1
        front, at = self._front, self._front_at
        if at == len(front):
            front, at = self._refill(), 0
        it = front[at]
        front[at] = None  # (let it go now)
        self._front_at = at + 1
        return it  # type: ignore[return-value]

    def __getitem__(self, index: int) -> Put:
        if index != 0:
            raise IndexError("PackedItems gives only its first item ([0])")
        if not self._len:
            raise IndexError("PackedItems is empty")
        front, at = self._front, self._front_at
        if at == len(front):
            front, at = self._refill(), 0
        return front[at]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Put]:
        yield from self._front[self._front_at:]  # type: ignore[misc]
        for b in list(self._blocks):
            yield from b.unpack()
        yield from self._tail

    def clear(self) -> None:
        self._front = []
        self._front_at = 0
        self._blocks.clear()
        self._tail = []
        self._len = 0

    def statistics(self) -> PackedStats:
        """A snapshot of how the items sit (O(blocks): for tests and scrapes)."""
        in_blocks = sum(map(len, self._blocks))
        objs = sum(len(b.objs or ()) for b in self._blocks)
        return PackedStats(self._len, len(self._blocks), in_blocks - objs,
                           objs + self._len - in_blocks,
                           sum(len(b.data) for b in self._blocks))

    def __repr__(self) -> str:
        return f"PackedItems({len(self)} items, {len(self._blocks)} blocks)"
