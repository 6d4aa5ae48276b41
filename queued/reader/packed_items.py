"""PackedItems: the older part of a reader's items in memory, held packed.

PURE: no I/O. It owns how the bulk of the items a reader holds sit in memory, never
what they mean: every item it gives back equals (`==`) the one packed, and of its type.

Why: a `Put` held as an object costs ~237 B of RSS at 64 B of data (its 80 B object, a
33 B bytes header, two ints, a deque slot). The reader keeps its newest items as objects
in a deque (the steady state, where consumers keep up, never packs anything) and hands
BLOCK_ITEMS of its oldest at a time to `pack` once enough wait: one `_Block` holds their
data joined in one `bytes`, columns of ids and add times (`array('q')`, 8 B each) and
data end offsets (`array('I')`, 4 B), so a 64 B item costs 84 B plus a share of its
block; a block of consecutive ids (the usual one) holds them as a `range`: 76 B, 84 B of
RSS measured with a million items held. Columns for expire times and flags exist only in
a block where an item has one, and so do the headers column (the blocks of a HeadedPut's
headers joined in one `bytes`, their end offsets in an `array('I')`: an item's headers
cost their bytes and 4 B); an item that is not plain (a DelayedPut, an error count, data
over SMALL_MAX or not `bytes`, a value no column holds) stays an object in the block's
`objs`. `unpack_next` makes a whole block's items again at once (in bulk, half the cost
of one at a time) for the reader to `pop()`.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Final

from queued.journal.records import HeadedPut, Put

#: Items per packed block: its fixed cost (~400 B: five objects and their headers) is
#: ~3 B per item, and the memory a partly taken block keeps is at most this many items'.
BLOCK_ITEMS: Final = 128
#: Data longer than this stays in its Put object: the ~170 B a Put costs beyond its data
#: are < 1/3 of it, and copying it in and out of a block costs CPU (+0.1 us per 1 KiB item
#: each way). A block of only such items is a list of them.
SMALL_MAX: Final = 512

_I64_MAX = (1 << 63) - 1
#: The fast path's bound on add times: compiled, a constant that is a small int, so the
#: test reads no global and takes no big-int compare (a later time takes the other path).
_FAST_TIME_MAX: Final = (1 << 62) - 1
_U32_MAX = (1 << 32) - 1
_NO_EXPIRE = -1  # `exps` column: no expire time
_PACKABLE = (Put, HeadedPut)  # (a HeadedPut's headers go to the block's headers column)


@dataclass(frozen=True, slots=True)
class PackedStats:
    items: int  # held (len)
    blocks: int
    packed: int  # items in blocks, held packed
    objects: int  # items in blocks held as objects (not plain)
    packed_bytes: int  # the blocks' data (and headers)


class _Block:
    """Packed items, oldest first."""

    __slots__ = ("data", "ends", "exps", "flgs", "hdata", "hends", "ids", "objs", "times")

    def __init__(self, items: list[Put], small_max: int = SMALL_MAX) -> None:
        # The usual block, plain Puts of small bytes with consecutive ids: one loop reads
        # every field of each (compiled, a native field read apiece) and builds the
        # columns as it checks; at the first item it cannot hold so, the general way.
        datas: list[bytes] = []
        times: list[int] = []
        ends: list[int] = []
        end = 0
        next_id = items[0].id
        plain = True
        for it in items:
            d = it.data
            t = it.add_time_ms
            if (type(it) is not Put or type(d) is not bytes or it.id != next_id
                    or it.expire_time_ms is not None or it.error_count or it.flags
                    or len(d) > small_max or t < 0 or t > _FAST_TIME_MAX):
                plain = False
                break
            next_id += 1
            datas.append(d)
            times.append(t)
            end += len(d)
            ends.append(end)
        if plain:
            self.data = b"".join(datas)
            self.ends = array("I", ends)
            self.ids: array[int] | range = range(items[0].id, next_id)
            self.times = array("q", times)
            self.exps: array[int] | None = None
            self.flgs: array[int] | None = None
            self.hdata: bytes | None = None
            self.hends: array[int] | None = None
            self.objs: dict[int, Put] | None = None
        else:
            self._general(items, small_max)

    def _general(self, items: list[Put], small_max: int) -> None:
        """Any items: those that are not plain kept as objects, the columns an item
        needs (expire times, flags, headers) made, ids as they come."""
        datas = [it.data for it in items]
        times = [it.add_time_ms for it in items]
        sizes = [len(d) for d in datas]
        objs: dict[int, Put] | None = None
        exps: list[int] | None = None
        flgs: list[int] | None = None
        heads: list[bytes] | None = None
        for k, it in enumerate(items):
            d, t, e, f = it.data, it.add_time_ms, it.expire_time_ms, it.flags
            if (type(it) not in _PACKABLE or type(d) is not bytes or it.error_count
                    or (type(it) is HeadedPut and not it.headers)
                    or len(d) > small_max
                    or not 0 <= t <= _I64_MAX or not 0 <= f <= _U32_MAX
                    or (e is not None and not 0 <= e <= _I64_MAX)):
                if objs is None:
                    objs = {}
                objs[k] = it
                datas[k] = b""
                sizes[k] = times[k] = 0
                continue
            if e is not None:
                if exps is None:
                    exps = [_NO_EXPIRE] * len(items)
                exps[k] = e
            if f:
                if flgs is None:
                    flgs = [0] * len(items)
                flgs[k] = f
            if type(it) is HeadedPut:
                if heads is None:
                    heads = [b""] * len(items)
                heads[k] = it.headers
        self.data = b"".join(datas)
        self.ends = array("I", list(accumulate(sizes)))  # (from lists: sized exactly)
        ids = [it.id for it in items]
        first, last = ids[0], ids[-1]
        # Consecutive ids (a reader's, unless items between them were taken or dropped
        # first) are a range: 8 B less per item, and no array to build.
        self.ids = (range(first, last + 1) if last - first == len(ids) - 1
                    and ids == list(range(first, last + 1)) else array("q", ids))
        self.times = array("q", times)
        self.exps = None if exps is None else array("q", exps)
        self.flgs = None if flgs is None else array("I", flgs)
        self.hdata = None if heads is None else b"".join(heads)
        self.hends = None if heads is None else array("I", list(accumulate(map(len, heads))))
        self.objs = objs

    def __len__(self) -> int:
        return len(self.ids)

    def unpack(self) -> list[Put]:
        """Its items, made again (in bulk: about half the cost of one at a time)."""
        data, ends = self.data, self.ends
        ids = self.ids
        if self.exps is None and self.flgs is None and type(ids) is range:
            # The usual block: one loop over lists (compiled: native reads of their items,
            # Put's native constructor; no iterator per column)
            out: list[Put] = []
            xid = ids.start
            start = 0
            times: list[int] = self.times.tolist()
            for k, end in enumerate(ends.tolist()):
                out.append(Put(xid + k, data[start:end], times[k]))
                start = end
        else:
            datas = [data[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]
            if self.exps is None and self.flgs is None:
                out = [Put(i, d, t) for i, d, t in zip(ids, datas, self.times, strict=True)]
            else:
                exps = (repeat(None) if self.exps is None
                        else [None if e == _NO_EXPIRE else e for e in self.exps])
                flgs = repeat(0) if self.flgs is None else self.flgs
                out = list(map(Put, ids, datas, self.times, exps, repeat(0), flgs))
        if self.hends is not None:
            self._with_headers(out)
        if self.objs is not None:
            for k, it in self.objs.items():
                out[k] = it
        return out

    def _with_headers(self, out: list[Put]) -> None:
        """The items of `out` that had headers made HeadedPuts again."""
        hdata, hends = self.hdata, self.hends
        assert hdata is not None and hends is not None
        start = 0
        for k, end in enumerate(hends):
            if end > start:
                it = out[k]
                out[k] = HeadedPut(it.id, it.data, it.add_time_ms, it.expire_time_ms, 0,
                                   it.flags, hdata[start:end])
            start = end


class PackedItems:
    """Blocks of items in order, oldest first: `pack` adds one at the end, `unpack_next`
    takes the oldest; len, truth, iteration (oldest first) and `clear` as a deque's."""

    __slots__ = ("_blocks", "_len")

    def __init__(self) -> None:
        #: a block of only big items is a list of them (nothing to pack)
        self._blocks: deque[_Block | list[Put]] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def pack(self, items: list[Put], small_max: int = SMALL_MAX) -> None:
        """`items`, newer than every item held, join the end as one block; data longer
        than `small_max` (at most SMALL_MAX) stays in its Put."""
        if items:
            small = min([len(it.data) for it in items]) <= small_max
            self._blocks.append(_Block(items, small_max) if small else list(items))
            self._len += len(items)

    def unpack_next(self) -> list[Put]:
        """The oldest block's items, made again and removed, NEWEST FIRST: the caller
        takes them with `pop()`, a C call (IndexError if there is none)."""
        if not self._blocks:
            raise IndexError("unpack from an empty PackedItems")
        b = self._blocks.popleft()
        out = b.unpack() if isinstance(b, _Block) else b
        self._len -= len(out)
        out.reverse()
        return out

    def __iter__(self) -> Iterator[Put]:
        for b in list(self._blocks):
            yield from (b.unpack() if isinstance(b, _Block) else b)

    def ids(self) -> list[int]:
        """The ids held, oldest first (read from the blocks' columns, nothing unpacked)."""
        out: list[int] = []
        for b in self._blocks:
            out += b.ids if isinstance(b, _Block) else [it.id for it in b]
        return out

    def clear(self) -> None:
        self._blocks.clear()
        self._len = 0

    def statistics(self) -> PackedStats:
        """A snapshot of how the items sit (O(blocks): for tests and scrapes)."""
        packed = [b for b in self._blocks if isinstance(b, _Block)]
        objs = self._len - sum(map(len, packed)) + sum(len(b.objs or ()) for b in packed)
        return PackedStats(self._len, len(self._blocks), self._len - objs, objs,
                           sum(len(b.data) + len(b.hdata or b"") for b in packed))

    def __repr__(self) -> str:
        return f"PackedItems({len(self)} items, {len(self._blocks)} blocks)"
