"""The broker's operations on whole queues and readers: pause and resume, move, browse,
flush and delete, and what it shows (statistics, per-reader fields, queue views), for the
console, the admin commands and the metrics.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from queued.broker import parking
from queued.broker.gets import GetPath
from queued.broker.live_readers import LiveReader
from queued.broker.queues import QueueState
from queued.broker.readback import read_live
from queued.errors import BadNameError, JournalError
from queued.journal import format as jf
from queued.reader.open_reads import TimeoutHeapStatistics
from queued.reader.state import Item
from queued.storage.journal import JournalStats

if TYPE_CHECKING:
    pass

log = logging.getLogger("queued.broker")


@dataclass(frozen=True, slots=True)
class BrokerStatistics:
    queues: int  # loaded and parked
    parked: int  # queues parked (queued.broker.parking)
    readers: int  # of loaded queues
    waiters: int
    clients: int  # registered connections
    open_reads: int  # of registered connections
    timeouts: TimeoutHeapStatistics
    counters: tuple[tuple[str, int], ...]  # BrokerCounters' fields, in order
    closing: bool


class AdminOps(GetPath):
    """The admin layer of `Broker`, over the get and put paths (see the module docstring
    of queued.broker.broker); a move puts through the put path."""

    @property
    def paused(self) -> frozenset[str]:
        """The paused queues, loaded or parked."""
        return frozenset(self.registry.paused)

    async def set_paused(self, queue: str, on: bool) -> bool:
        """Pause (`on`) or resume `queue`, durably before it returns; whether that
        changed anything. Resuming serves the gets that waited meanwhile."""
        if not jf.valid_name(queue):
            raise BadNameError(f"invalid queue name {queue!r}")
        async with self.pause_lock:  # one write at a time, each of the whole list
            paused = self.registry.paused
            if (queue in paused) == on:
                return False
            await self.datadir.save_paused(paused | {queue} if on else paused - {queue})
            if on:
                paused.add(queue)
            else:
                paused.discard(queue)
        qs = self.queues.get(queue)
        if qs is not None:
            qs.paused = on
            if not on:
                for h in list(qs.readers.values()):
                    qs.serve(h)
        log.info("queue %s: %s", queue, "paused" if on else "resumed")
        return True

    async def move(self, source: str, reader: str | None, destination: str, max_items: int = 0,
                   rate: int = 0) -> int:
        """Move up to `max_items` (0: until the source has none) of source's items, in
        delivery order, to `destination`, at most `rate` a second (0: no limit); how
        many. One at a time: each is durable in the destination (keeping its error count,
        flags and headers) before its removal from the source is journaled, and that removal is
        durable before the next starts, so a crash duplicates at most the item in
        flight and loses nothing. Works on a paused source (its consumers stay off)."""
        if destination == source:
            raise ValueError("move: the destination is the source")
        if not jf.valid_name(destination):
            raise BadNameError(f"invalid queue name {destination!r}")
        qs = self.registry.queue(source)
        rname = reader or ""
        h = qs.readers.get(rname) or await self.registry.live_reader(qs, rname)
        interval = 1 / rate if rate else 0.0
        next_at = trio.current_time()
        moved = 0
        while (not max_items or moved < max_items) and not (self.closing or qs.deleted):
            taken = await qs.take_now(h, 1, 0, even_paused=True)
            if not taken:
                break
            it = taken[0]
            del h.reader.open[it.id]  # held -> moving (an open read of nobody's)
            h.reader.start_move(it)
            try:
                await self.put(destination, [it.data], error_count=it.error_count,
                               flags=it.flags, headers=[it.headers] if it.headers else None)
            except BaseException:
                qs.finish_move(h, [it], moved=False, keep_errors=True)
                raise
            h.reader.end_move(it.id, moved=True)
            ticket = qs.note_read(h, done=[it.id])
            moved += 1
            self.counters.moved += 1
            if ticket is not None:
                with trio.CancelScope(shield=True):
                    await ticket.wait()
                if ticket.error is not None:
                    raise ticket.error
            if interval:
                next_at += interval
                await trio.sleep_until(next_at)
        log.info("moved %d items from %s to %s", moved, source, destination)
        return moved

    async def browse(self, queue: str, reader: str | None, after_id: int, n: int) -> list[Item]:
        """Up to `n` items of an existing reader in delivery order, after the item
        `after_id` (0: from the head; an id no longer there: the items after it by id),
        without taking them: those in memory, then those on disk (read in a worker
        thread). Each carries its error count."""
        found = self.registry.find(queue, reader)
        if found is None or n <= 0:
            return []
        qs, h = found
        r = h.reader
        now = self.clock()
        out = r.browse(now, after_id, n)
        if len(out) < n and r.behind is not None:
            start = max(r.behind, after_id + 1, out[-1].id + 1 if out else 0)
            skip = frozenset(r.done) | frozenset(r.delays)
            errors = dict(r.errors)
            more = await trio.to_thread.run_sync(
                read_live, qs.journal, start, r.tail, n - len(out), skip, now)
            out += [it.with_error_count(errors[it.id])
                    if it.id in errors else it for it in more]
        return out

    # -- flush and delete -------------------------------------------------------------------

    def flush(self, queue: str, reader: str | None = None) -> int:
        found = self.registry.find(queue, reader)
        return found[1].flush() if found is not None else 0

    async def flush_all(self) -> int:
        """Flush every queue; the number of items flushed.

        A parked queue holding items loads to be flushed (and parks again later); an
        empty one only counts the flush in its summary. A load reads files (~0.3 ms,
        ~4 ms at the parking limits) on a worker thread, and the loop lets other tasks
        run after each one: a flush_all over thousands of parked queues does not hold
        the event loop. Queue by queue, as Kestrel's, not one atomic step across queues.
        """
        n = sum(h.flush() for qs in list(self.queues.values()) for h in qs.readers.values())
        registry = self.registry
        for name in list(registry.parked):
            data = registry.parked.get(name)
            if data is None:  # loaded since the loop above (or deleted): flush it there
                loaded = self.queues.get(name)
                n += sum(h.flush() for h in loaded.readers.values()) if loaded else 0
                continue
            p = parking.unpack(data)
            if p.empty:
                for r in p.readers:
                    r.counters.flushes += 1
                registry.parked[name] = parking.pack(p)
                continue
            await registry.load_parked(name)  # (its files read on a worker thread)
            loaded = self.queues.get(name)
            if loaded is None:
                if name not in registry.parked:
                    continue  # deleted meanwhile
                try:
                    loaded = registry.unpark(name)  # (the load failed: again, to report it)
                except JournalError:
                    continue  # (logged) the others are flushed all the same
            n += sum(h.flush() for h in loaded.readers.values())
            await trio.lowlevel.checkpoint()
        return n

    def flush_expired(self, queue: str, reader: str | None = None) -> int:
        found = self.registry.find(queue, reader)
        return found[0].expire_head(found[1], self.clock(), 0) if found is not None else 0

    def flush_all_expired(self) -> int:
        """Loaded queues only: a parked queue's items expire when it loads."""
        return sum(
            self.flush_expired(q, r)
            for q, qs in list(self.queues.items())
            for r in list(qs.readers)
        )

    async def delete(self, queue: str, reader: str | None = None) -> bool:
        """Delete reader `reader` of `queue`, or the whole queue with every file.

        Deleting a queue's last reader leaves a default reader at the tail (written
        durably), so items put afterwards have a reader before and after a restart.
        """
        await self.registry.wait_load(queue)  # (a parked queue's files are being read)
        qs = self.queues.get(queue)
        if qs is None and queue in self.registry.parked:
            if not reader:
                return await self._delete_parked(queue)
            qs = self.registry.unpark(queue)
        if qs is None:
            return False
        if reader:
            h = qs.readers.pop(reader, None)
            if h is None:
                return False
            self.registry.forget_names()
            h.close()
            self.reads.forget(queue, reader, h)
            await qs.journal.remove_reader(reader)
            if not qs.readers and not qs.deleted:
                await self.registry.live_reader(qs, "")
            return True
        qs.deleted = True
        del self.queues[queue]
        self.registry.forget_names()
        for h in qs.readers.values():
            h.close()
        self.reads.forget(queue, None, None)
        await self.datadir.delete_queue(queue)
        self.counters.queue_deletes += 1
        return True

    async def _delete_parked(self, queue: str) -> bool:
        self.registry.forget_parked(queue)
        await self.datadir.delete_queue(queue, parked=True)
        self.counters.queue_deletes += 1
        return True

    # -- statistics ----------------------------------------------------------------------------

    def reader_stats(self, qs: QueueState, h: LiveReader) -> dict[str, int]:
        return qs.reader_stats(h)

    def reader_info(self, queue: str, reader: str | None = None) -> dict[str, int]:
        """reader_stats of one reader, found by any of its names ({} if none)."""
        found = self.registry.find(queue, reader, aliases=True)
        return {} if found is None else found[0].reader_stats(found[1])

    def head_items(self, queue: str, reader: str | None, limit: int) -> list[Item] | None:
        """Up to `limit` items at the head of an existing reader, in delivery order, from
        memory (None if the queue or reader does not exist). Read-only: creates nothing,
        opens nothing, reads nothing back from disk, counts no peek."""
        found = self.registry.find(queue, reader)
        return None if found is None else found[1].reader.first_items(self.clock(), limit)

    def queue_stats(self) -> list[tuple[str, dict[str, int]]]:
        """(`q` or `q+reader`, fields) for every reader, loaded or parked, sorted by name."""
        out = [(f"{qs.name}+{rname}" if rname else qs.name, qs.reader_stats(h))
               for qs, rname, h in self.registry.all_readers()]
        if self.registry.parked:
            now = self.clock()
            out += [(f"{name}+{r.name}" if r.name else name, parking.reader_fields(
                        p, r, now, name in self.registry.paused))
                    for name, p in self.registry.parked_views() for r in p.readers]
            out.sort(key=lambda pair: pair[0])
        return out

    def queue_names(self) -> list[str]:
        """Every queue, loaded or parked, sorted."""
        return sorted([*self.queues, *self.registry.parked])

    def queue_view(self, name: str) -> tuple[list[tuple[str, dict[str, int]]], JournalStats]:
        """(reader, fields) of every reader of queue `name`, sorted, and its journal's
        figures; from the summary if it is parked (it stays parked)."""
        qs = self.queues.get(name)
        if qs is not None:
            return ([(rname, qs.reader_stats(qs.readers[rname])) for rname in sorted(qs.readers)],
                    qs.journal.statistics())
        p = parking.unpack(self.registry.parked[name])
        now = self.clock()
        return [(r.name, parking.reader_fields(p, r, now, name in self.registry.paused))
                for r in p.readers], \
            p.journal_stats(name)

    def reader_count(self, queue: str) -> int:
        """Readers of queue `queue`, loaded or parked (0: no such queue)."""
        qs = self.queues.get(queue)
        if qs is not None:
            return len(qs.readers)
        data = self.registry.parked.get(queue)
        return 0 if data is None else len(parking.unpack(data).readers)

    def has_reader(self, queue: str, reader: str | None) -> bool:
        """Queue `queue` exists (loaded or parked), and its reader `reader` if not None."""
        qs = self.queues.get(queue)
        if qs is not None:
            return reader is None or reader in qs.readers
        data = self.registry.parked.get(queue)
        return data is not None and (
            reader is None or any(r.name == reader for r in parking.unpack(data).readers))

    def held_bytes(self) -> int:
        """Item data the readers hold in memory (read-ahead; not open reads)."""
        return sum(h.reader.mem_bytes for qs in self.queues.values() for h in qs.readers.values())

    def statistics(self) -> BrokerStatistics:
        handles = [h for qs in self.queues.values() for h in qs.readers.values()]
        return BrokerStatistics(
            queues=len(self.queues) + len(self.registry.parked),
            parked=len(self.registry.parked),
            readers=len(handles),
            waiters=sum(len(h.waiters) for h in handles),
            clients=len(self.clients),
            open_reads=sum(c.open_total for c in self.clients.values()),
            timeouts=self.timeouts.statistics(),
            counters=tuple(dataclasses.asdict(self.counters).items()),
            closing=self.closing,
        )
