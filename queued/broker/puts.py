"""The broker's put path: a put durable before it returns (`put`), its two halves
(`begin_put`, `end_put`) and their never-waiting twins (`begin_put_nowait`,
`end_put_nowait`), and the puts of one reactor pass joined into one append per queue
(`JoinedPuts`). Puts reach the readers (in id order) only once durable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import trio

from queued.broker.base import BrokerBase
from queued.broker.queues import PendingPut
from queued.errors import QueueFullError

if TYPE_CHECKING:
    pass

#: (a C static compiled: no look-up of `time` and its attribute at each call)
_perf_counter: Final = time.perf_counter
#: The parts of a put joined, or begun on its own: [(part, how many items, key), ...].
Parts = list[tuple["JoinedPut", int, bytes | None]]


class JoinedPut:
    """One connection's part of a put joined with others (`JoinedPuts`): ended, or why
    it failed; a part with a deduplication key has its own `answer` (first id, count,
    duplicate)."""

    __slots__ = ("answer", "ended", "error", "pending")

    def __init__(self) -> None:
        self.pending: PendingPut | None = None
        self.error: Exception | None = None
        self.ended = False
        self.answer: tuple[int, int, bool] | None = None


class _Join:
    """Puts joined into one append to `queue` with the same expiry, flags and delay:
    the items, [(part, how many, key), ...], and the items' headers blocks (a list once
    a part has any, b"" for an item without)."""

    __slots__ = ("delay_ms", "expire_ms", "flags", "headers", "items", "parts", "queue")

    def __init__(self, queue: str, expire_ms: int | None, flags: int, delay_ms: int) -> None:
        self.queue = queue
        self.expire_ms = expire_ms
        self.flags = flags
        self.delay_ms = delay_ms
        self.items: list[bytes] = []
        self.parts: Parts = []
        self.headers: list[bytes] | None = None


class JoinedPuts:
    """The puts of one pass (the reactor's), joined: every connection's put to a queue
    with the same expiry, flags and delay as the queue's last put in the pass joins that
    one journal append (one id range, one hand-off to the readers); one with others
    starts the queue's next append, so ids keep the order each connection sent them in.
    They begin after every connection has run (`begin_all`), in the order their appends
    began to fill, and end after the pass's commit (`end_all`). A queue that must make
    room first (or is not loaded) is not joined: its puts begin on their own. A joined
    append that is refused is retried part by part, so each connection gets its own
    answer.

    A put with a deduplication key is joined too: its key is checked and reserved when it
    is added (`QueueState.join_key`), so a second put of the key in the pass follows the
    first (answered as it, storing nothing), and its DEDUP record goes after its items."""

    def __init__(self, broker: PutPath) -> None:
        self.broker = broker
        #: the joins of the pass, in the order they began to fill, and each queue's last:
        #: a put joins its queue's last join if it has the same expiry, flags and delay,
        #: else it starts the next one (so ids keep the order each connection sent)
        self._joins: list[_Join] = []
        self._last: dict[str, _Join] = {}
        self._begun: list[tuple[PendingPut | None, Parts]] = []
        self._followers: list[tuple[JoinedPut, JoinedPut]] = []  # (a duplicate, its leader)
        #: queues found joinable in this pass (nothing else runs during a pass to change it)
        self._joinable: set[str] = set()

    def has(self, queue: str) -> bool:
        """Puts to `queue` are joined, not yet begun."""
        return queue in self._last

    def can_join(self, queue: str) -> bool:
        if queue in self._joinable:
            return True
        qs = self.broker.registry.queues.get(queue)
        if qs is None or qs.needs_room() or qs.journal.config.max_journal_size:
            return False
        self._joinable.add(queue)
        return True

    def add(self, queue: str, items: Sequence[bytes], expire_ms: int | None, flags: int,
            delay_ms: int, headers: Sequence[bytes] | None = None,
            key: bytes | None = None) -> JoinedPut | PendingPut:
        """The part of a put in the pass; with a `key` already stored before the pass, the
        duplicate's PendingPut instead (not joined: it stores nothing)."""
        part = JoinedPut()
        if key is not None:
            seen = self.broker.registry.queue(queue).join_key(key, part)
            if isinstance(seen, PendingPut):
                return seen
            if seen is not None:  # an earlier part of this pass stored it
                assert isinstance(seen.pending, JoinedPut)
                self._followers.append((part, seen.pending))
                return part
        join = self._last.get(queue)
        if join is None or not (join.expire_ms == expire_ms and join.flags == flags
                                and join.delay_ms == delay_ms):
            join = self._last[queue] = _Join(queue, expire_ms, flags, delay_ms)
            self._joins.append(join)
        if headers is not None or join.headers is not None:
            if join.headers is None:
                join.headers = [b""] * len(join.items)
            join.headers += [b""] * len(items) if headers is None else headers
        join.items += items
        join.parts.append((part, len(items), key))
        return part

    def begin_all(self) -> None:
        self._joinable.clear()
        started = _perf_counter()  # (the pass's puts begin together)
        for join in self._joins:
            self._begin(join, started)
        self._joins.clear()
        self._last.clear()

    def _begin(self, join: _Join, started: float) -> None:
        """One append for the puts joined in `join`; if it is refused, each part's own."""
        b = self.broker
        queue, items, parts, headers = join.queue, join.items, join.parts, join.headers
        keys: list[tuple[int, int, bytes]] = []  # (start, end, key) of the keyed parts
        start = 0
        for _, n, key in parts:
            if key is not None:
                keys.append((start, start + n, key))
            start += n
        try:
            pending = b.begin_put_nowait(queue, items, expire_ms=join.expire_ms,
                                         flags=join.flags, delay_ms=join.delay_ms,
                                         headers=headers, keys=keys, started=started)
        except Exception:  # (WouldBlock included) each part on its own, then
            start = 0
            qs = b.registry.queues.get(queue)
            for part, n, key in parts:
                if key is not None and qs is not None:
                    qs.unjoin_key(key, part)
                try:
                    part.pending = b.begin_put_nowait(
                        queue, items[start:start + n], expire_ms=join.expire_ms,
                        flags=join.flags, delay_ms=join.delay_ms,
                        headers=None if headers is None else headers[start:start + n],
                        key=key, started=started)
                    part.answer = part.pending.answer
                except trio.WouldBlock:
                    part.error = QueueFullError(f"queue {queue!r} is full")
                except Exception as exc:
                    part.error = exc
                self._begun.append((part.pending, [(part, n, key)]))
                start += n
            return
        self._begun.append((pending, parts))
        for part, _, _ in parts:
            part.pending = pending
        if keys:
            puts = pending.entry.puts
            for (start, end, _), part in zip(keys, (p for p, _, k in parts if k is not None),
                                             strict=True):
                part.answer = (puts[start].id, end - start, False)

    def end_all(self) -> None:
        """After the pass's commit (every ticket set)."""
        now = _perf_counter()  # (and end together)
        for pending, parts in self._begun:
            error: Exception | None = None
            if pending is not None:
                try:
                    self.broker.end_put_nowait(pending, len(parts), now)
                except Exception as exc:
                    error = exc
            for part, _, _ in parts:
                part.ended = True
                if part.error is None:
                    part.error = error
        for follower, leader in self._followers:  # answered as the part they repeat
            follower.ended, follower.error, follower.pending = True, leader.error, leader.pending
            if leader.answer is not None:
                follower.answer = (leader.answer[0], leader.answer[1], True)
        self._begun.clear()
        self._followers.clear()


class PutPath(BrokerBase):
    """The put layer of `Broker`, over the shared state (see the module docstring of
    queued.broker.broker)."""

    async def put(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
    ) -> int:
        """Journal `datas`; returns once durable under the queue's fsync policy.

        `expire_ms` is absolute unix milliseconds; `flags` are the items' memcache
        flags (u32); `delay_ms` > 0 keeps the items invisible that long; `producer` and
        `sequence`: an exactly-once put (a repeat stores nothing and returns 0);
        `headers`: each item's headers block (queued.journal.headers; b"": none); `key`: a
        deduplication key (a put whose key was stored within the queue's dedup_window
        stores nothing and returns 0). Raises
        QueueFullError, ItemTooLargeError, JournalError (write failures, journal full),
        ProducerGapError, ValueError.
        """
        self.counters.cmd_set += 1
        entry = await self.begin_put(queue, datas, expire_ms=expire_ms, error_count=error_count,
                                     flags=flags, delay_ms=delay_ms, producer=producer,
                                     sequence=sequence, headers=headers, key=key)
        # Shielded: the readers must hear about every durable put, in id order,
        # even if the caller is cancelled. The wait is one writer round.
        with trio.CancelScope(shield=True):
            n = await self.end_put(entry)
        return n

    async def begin_put(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        error_count: int = 0,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
    ) -> PendingPut:
        """First half of `put`: checks, limits, ids; hands the items to the writer.
        With a `producer` (exactly-once puts), see `QueueState.begin_put`: a repeat of
        its last put stores nothing (`PendingPut.answer`), a gap raises ProducerGapError.
        With a deduplication `key`, likewise a put whose key is in the window (no gap).

        Every PendingPut must be passed to `end_put`. A session begins each put of
        a pipelined batch before ending any, so they share one write and one fsync.
        Does not yield unless the queue is full (discard_old, read-behind) or near
        max_journal_size.
        """
        started = _perf_counter()
        pending = await self.registry.queue(queue).begin_put(
            datas, expire_ms=expire_ms, error_count=error_count, flags=flags, delay_ms=delay_ms,
            producer=producer, sequence=sequence, headers=headers, key=key)
        pending.started = started
        return pending

    def begin_put_nowait(
        self,
        queue: str,
        datas: Sequence[bytes],
        *,
        expire_ms: int | None = None,
        flags: int = 0,
        delay_ms: int = 0,
        producer: bytes | None = None,
        sequence: int = 0,
        headers: Sequence[bytes] | None = None,
        key: bytes | None = None,
        keys: Sequence[tuple[int, int, bytes]] = (),
        started: float = -1.0,
    ) -> PendingPut:
        """`begin_put` that never waits: trio.WouldBlock (nothing changed) when the
        queue must make room first (a parked queue loads here, synchronously). `keys`:
        see `QueueState.begin_put_nowait` (JoinedPuts). `started`: when the put began
        (`time.perf_counter`; -1: now), for the put latency."""
        if started < 0:
            started = _perf_counter()
        pending = self.registry.queue(queue).begin_put_nowait(
            datas, expire_ms=expire_ms, error_count=0, flags=flags, delay_ms=delay_ms,
            producer=producer, sequence=sequence, headers=headers, key=key, keys=keys)
        pending.started = started
        return pending

    def end_put_nowait(self, pending: PendingPut, puts: int = 1, now: float = -1.0) -> int:
        """`end_put` once the put's write is done (its ticket set); `puts`: how many
        puts it stands for (joined: each is one observation of the put latency); `now`:
        `time.perf_counter` (-1: read here)."""
        n = pending.qs.end_put_nowait(pending)
        if pending.ticket is not None:
            self.counters.total_items += n
            if now < 0:
                now = _perf_counter()
            self.put_latency.observe(now - pending.started, puts)
        return n

    async def end_put(self, pending: PendingPut) -> int:
        """Second half of `put`: wait until durable; returns the number of items.

        Call it inside a shielded cancel scope: if it were cancelled, the queue
        would never hand this put, or any later one, to its readers.
        """
        n = await pending.qs.end_put(pending)
        if pending.ticket is not None:
            self.counters.total_items += n
            self.put_latency.observe(_perf_counter() - pending.started)
        return n
