"""What the parts of a reader share: the limits it reads, its counters (from
queued.reader.counters: compiled, their fields read from the object's struct), and the
shared empty containers an idle reader (or queue, or journal) holds until its first entry.

PURE: no I/O. Values and constants only; the reader's state machine is reader/state.py,
its delayed items reader/delays.py.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from queued.reader.counters import ReaderCounters

__all__ = ["NO_ENTRIES", "NO_IDS", "NO_ITEMS", "NO_LIST", "ReaderCounters", "ReaderLimits"]

#: What a reader's front, unpacked, packed, mem and due hold until their first item: an
#: empty deque costs ~760 B (its first block is made with it), a server may hold 10,000
#: mostly empty queues, and the empty tuple reads as an empty deque (len, truth,
#: iteration). It is immutable, so a write that forgot to make a container first fails at
#: once instead of sharing state.
NO_ITEMS: Final[Any] = ()


class _NoEntries(dict[Any, Any]):
    """An empty dict that refuses entries (reads, `pop(k, default)` and `clear` work)."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("NO_ENTRIES is shared: make the reader its own dict first")

    __setitem__ = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]


#: What a reader's open, moving, errors, delays and parked hold until their first entry,
#: and `done` and `delayed` until their first id (an empty dict is ~64 B, an empty set
#: ~216 B, on each of 10,000 idle queues). Shared and immutable, as NO_ITEMS is.
NO_ENTRIES: Final[Any] = _NoEntries()


class _NoIds(set[Any]):
    """An empty set that refuses members: a set (as NO_ENTRIES is a dict), so that a
    compiled module reading a reader's `done` (typed set[int]) accepts it."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("NO_IDS is shared: make the reader its own set first")

    add = update = __ior__ = symmetric_difference_update = __ixor__ = _refuse  # type: ignore[assignment]


NO_IDS: Final[Any] = _NoIds()


class _NoList(list[Any]):
    """An empty list that refuses items: a list (as NO_IDS is a set), for attributes typed
    `list` that compiled code reads (a compiled module checks that they hold a list). As
    with NO_IDS, a compiled `append` calls `PyList_Append` directly, past the refusal:
    compiled code must make the list its own first (`is NO_LIST`), and the pure suite
    guards that it does."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("NO_LIST is shared: make the owner its own list first")

    append = extend = insert = __setitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]


#: What a list attribute holds until its first item where the attribute is typed `list`
#: (a journal's planned chunks, a reader's unpacked block and delay heap): shared and
#: immutable, as NO_ITEMS is, and a list.
NO_LIST: Final[Any] = _NoList()


class ReaderLimits(Protocol):
    """The part of QueueConfig a reader needs."""

    @property
    def max_items(self) -> int: ...
    @property
    def max_size(self) -> int: ...
    @property
    def max_memory_size(self) -> int: ...
    @property
    def discard_old_when_full(self) -> bool: ...

