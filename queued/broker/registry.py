"""The queues of one server by name, and each queue's readers by name.

Creates queues on first use, loads the recovered ones at startup, creates readers
(with libkestrel's takeover: the first named reader of a queue that only has the
default reader takes over its backlog and checkpoint) and applies reloaded configs.
Parks queues nobody used for `park_after` and loads them again on first use
(`queued.broker.parking`). Never moves items: what happens to them is the broker's
and the queue's business.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from queued.broker import parking
from queued.broker.live_readers import LiveReader
from queued.broker.queues import Background, QueueState
from queued.broker.readback import count_unconsumed, find_delayed, read_range
from queued.errors import (
    BadNameError,
    JournalError,
    QueueClosedError,
    QueuedError,
    TooManyQueuesError,
)
from queued.journal import format as jf
from queued.reader.dedup import DedupCounters
from queued.reader.producers import ProducerCounters
from queued.reader.state import Reader
from queued.storage.datadir import DataDir
from queued.storage.files import Checkpoint
from queued.storage.journal import QueueJournal

if TYPE_CHECKING:
    from queued.config import QueueConfig, ServerConfig

log = logging.getLogger("queued.broker")


@dataclass(slots=True)
class BrokerCounters:
    cmd_get: int = 0
    cmd_set: int = 0
    cmd_peek: int = 0
    get_hits: int = 0
    get_misses: int = 0
    total_items: int = 0
    queue_creates: int = 0
    queue_deletes: int = 0
    queue_expires: int = 0
    moved: int = 0  # items moved by `move` (redrive)


@dataclass(slots=True)
class LoadedQueue:
    """A parked queue read from its files, not yet loaded (`Registry._read_parked`)."""

    journal: QueueJournal
    readers: list[tuple[str, Reader]]


class Registry:
    """See the module docstring. `closing`: no new queues (the server is shutting down)."""

    def __init__(
        self,
        datadir: DataDir,
        config: ServerConfig,
        clock: Callable[[], int],
        background: Background,
        counters: BrokerCounters,
    ) -> None:
        self.datadir = datadir
        self.config = config
        self.clock = clock
        self.background = background
        self.counters = counters
        #: what every queue's producer table did (exactly-once puts), for the metrics
        self.producer_counters = ProducerCounters()
        #: what every queue's key table did (deduplication keys), for the metrics
        self.dedup_counters = DedupCounters()
        self.queues: dict[str, QueueState] = {}
        #: queues paused (durable in the data dir: DataDir.save_paused), loaded or not
        self.paused: set[str] = datadir.paused_queues()
        #: parked queues: name -> packed parking.ParkedQueue (never a name in `queues`)
        self.parked: dict[str, bytes] = {}
        self.closing = False
        self._names: int | None = None  # loaded queues and readers; None: count again
        self._parked_names = 0  # parked queues and readers
        self._cursor: Iterator[str] = iter(())  # the parker's walk through `queues`
        #: parked queues being loaded on a worker thread (`load_parked`): name -> set when
        #: the load is over, whichever way
        self._loading: dict[str, trio.Event] = {}
        #: reads a parked queue's files (`read_parked`), called through this attribute:
        #: the seam a test replaces on the instance to hold a load (a compiled class's
        #: methods cannot be replaced)
        self.read_parked: Callable[[str, parking.ParkedQueue], LoadedQueue] = \
            self._read_parked

    async def load(self) -> None:
        """Build every recovered queue's readers from their durable checkpoints."""
        started = time.monotonic()
        for name, journal in sorted(self.datadir.queues.items()):
            qs = self._add(name)
            for rname, cp in sorted(journal.readers.items()):
                cfg = self.reader_config(name, rname)
                reader = self._reader(name, rname, cp, journal.last_id, qs.create_time_ms)
                count, nbytes = await trio.to_thread.run_sync(
                    count_unconsumed, journal, cp.head, frozenset(cp.done)
                )
                # Everything starts on disk; read-behind fills memory once running.
                reader.restore([], cp.head + 1 if count else None, count, nbytes)
                if any(seg.delayed for seg in journal.segments) or cp.delays:
                    reader.restore_delayed(await trio.to_thread.run_sync(
                        find_delayed, journal, cp.head, frozenset(cp.done), dict(cp.delays)))
                qs.readers[rname] = LiveReader(reader, cfg)
                log.info("queue %s%s: %d items (%d bytes) recovered", name,
                         f"+{rname}" if rname else "", count, nbytes)
        if self.queues:
            log.info("loaded %d queues in %.3f s", len(self.queues), time.monotonic() - started)

    def _reader(self, name: str, rname: str, cp: Checkpoint, tail: int,
                create_time_ms: int) -> Reader:
        """Reader `rname` of queue `name` loaded from its files, at its durable checkpoint
        (`tail`: the journal's last id)."""
        return Reader(name, rname, self.reader_config(name, rname), head=cp.head,
                      done=cp.done, tail=tail, create_time_ms=create_time_ms,
                      errors=cp.errors, delays=cp.delays)

    def _add(self, name: str) -> QueueState:
        cfg = self.config.queue_config(name)
        journal = self.datadir.queue(name)
        # The data dir makes a new queue's journal with the start-up settings: a reload
        # since may have changed them (as `reconfigure` does for the queues there then).
        journal.config = cfg.journal_config()
        qs = QueueState(name, journal, cfg, self.clock, self.background,
                        self.producer_counters, self.dedup_counters)
        qs.paused = name in self.paused
        self.queues[name] = qs
        return qs

    def _check_room(self, what: str) -> None:
        """Refuse a new queue or reader past max_queues (each holds files and memory:
        without a cap, clients could create them until either runs out)."""
        limit = self.config.max_queues
        if len(self.queues) + len(self.parked) < limit and self.names() + 1 <= limit:
            if self._names is not None:
                self._names += 1  # the one about to be made
            return
        raise TooManyQueuesError(f"cannot create {what}: the server holds max_queues "
                                 f"({limit}) queues and fanout readers")

    def names(self) -> int:
        """Queues and readers together: what max_queues counts (a queue's first reader
        is the queue itself). Counted again after a reader or a queue went away. Parked
        queues count: they hold files, and load again on first use."""
        if self._names is None:
            self._names = sum(max(1, len(qs.readers)) for qs in self.queues.values())
        return self._names + self._parked_names

    def forget_names(self) -> None:
        """A reader or queue is gone: count again when next asked."""
        self._names = None

    def reader_config(self, queue: str, reader: str) -> QueueConfig:
        if reader:
            return self.config.reader_config(queue, reader)
        return self.config.queue_config(queue)

    def queue(self, name: str) -> QueueState:
        """Queue `name`, created (with a default reader at the tail) on first use."""
        qs = self.queues.get(name)
        if qs is None:
            if self.closing:
                raise QueueClosedError("server is shutting down")
            if name in self.parked:
                return self.unpark(name)
            if not jf.valid_name(name):
                raise BadNameError(f"invalid queue name {name!r}")
            if not jf.names_fit(name) or not jf.names_fit(name, ""):
                raise BadNameError(
                    f"queue name of {len(name)} characters is too long for its journal file "
                    f"names ({jf.NAME_MAX} bytes at most)"
                )
            self._check_room(f"queue {name!r}")
            qs = self._add(name)
            cfg = qs.config
            qs.readers[""] = LiveReader(
                Reader(name, "", cfg, tail=qs.journal.last_id, create_time_ms=qs.create_time_ms),
                cfg,
            )
            self.counters.queue_creates += 1
        qs.used = True  # (the parker's sign of life: one store, no clock read)
        return qs

    async def live_reader(self, qs: QueueState, name: str) -> LiveReader:
        """Reader `name` of `qs`, created on first use (durably, before it serves)."""
        h = qs.readers.get(name)
        if h is not None:
            return h
        if name and not jf.valid_name(name):
            raise BadNameError(f"invalid reader name {name!r}")
        if not jf.names_fit(qs.name, name):
            raise BadNameError(
                f"queue and reader names together are too long for a checkpoint file name "
                f"({jf.NAME_MAX} bytes at most)"
            )
        async with qs.reader_lock:
            h = qs.readers.get(name)
            if h is not None:
                return h
            if qs.deleted:
                raise QueueClosedError(f"queue {qs.name!r} was deleted")
            if name and set(qs.readers) == {""}:
                return await self._take_over(qs, name)
            if qs.readers:  # (a queue's only reader is the queue: it counts already)
                self._check_room(f"reader {qs.name}+{name}" if name
                                 else f"the default reader of {qs.name}")
            cfg = self.reader_config(qs.name, name)
            start = qs.delivered
            reader = Reader(qs.name, name, cfg, head=start, tail=start,
                            create_time_ms=self.clock())
            h = LiveReader(reader, cfg)
            # Registered first, so puts delivered while its checkpoint is written reach
            # it; durable before it serves, so compaction keeps what it will need.
            qs.readers[name] = h
            try:
                with trio.CancelScope(shield=True):
                    await qs.journal.write_checkpoint(name, start)
            except BaseException:
                qs.readers.pop(name, None)
                self.forget_names()
                raise
            if qs.deleted:
                raise QueueClosedError(f"queue {qs.name!r} was deleted")
            log.info("queue %s: new reader %r starts at id %d", qs.name, name, start)
            return h

    async def _take_over(self, qs: QueueState, name: str) -> LiveReader:
        """The first named reader takes over the default reader's backlog (under the
        reader lock). Shielded: both files must change, or neither (a shutdown may
        cancel)."""
        with trio.CancelScope(shield=True):
            taken = qs.readers[""]
            head, done = taken.reader.checkpoint()
            # From here on its confirms are journaled under its new name, after this
            # checkpoint (which holds everything consumed so far), not in q.read..
            taken.reader.name = name
            try:
                await qs.journal.write_checkpoint(name, head, done,
                                                  taken.reader.error_counts(),
                                                  taken.reader.delay_entries())
                await qs.journal.remove_reader("")
            except BaseException:
                taken.reader.name = ""
                taken.reader.dirty = True
                raise
            del qs.readers[""]
            taken.config = self.reader_config(qs.name, name)
            taken.reader.limits = taken.config
            taken.aliases |= {""}  # open reads taken as `q` are still confirmed as `q`
            qs.readers[name] = taken
        log.info("queue %s: reader %r took over the default reader", qs.name, name)
        return taken

    def find(
        self, queue: str, reader: str | None, *, aliases: bool = False
    ) -> tuple[QueueState, LiveReader] | None:
        """Reader `reader` ("" or None: the default) of `queue`, if both exist; with
        `aliases`, also the reader that took over under that name."""
        qs = self.queues.get(queue)
        if qs is None:
            if queue not in self.parked or self.closing:
                return None
            qs = self.unpark(queue)
        qs.used = True
        rname = reader or ""
        h = qs.readers.get(rname)
        if h is None and aliases:
            h = next((o for o in qs.readers.values() if rname in o.aliases), None)
        return None if h is None else (qs, h)

    def all_readers(self) -> list[tuple[QueueState, str, LiveReader]]:
        """Every reader of every queue, sorted by queue and reader name."""
        return [(qs, rname, h) for _, qs in sorted(self.queues.items())
                for rname, h in sorted(qs.readers.items())]

    def reconfigure(self, config: ServerConfig) -> None:
        """Apply reloaded queue configs to every existing queue and reader (a parked
        queue takes its config when it loads)."""
        self.config = config
        for name, qs in self.queues.items():
            qs.config = config.queue_config(name)
            qs.journal.config = qs.config.journal_config()
            if qs.producers is not None:
                qs.producers.max_producers = qs.config.max_producers
                qs.producers.expiry_ms = qs.config.producer_expiry
            if qs.dedup is not None:
                qs.dedup.max_keys = qs.config.max_dedup_keys
                qs.dedup.window_ms = qs.config.dedup_window
            for rname, h in qs.readers.items():
                h.config = self.reader_config(name, rname)
                h.reader.limits = h.config

    # -- parking (queued.broker.parking) -------------------------------------------

    def unpark(self, name: str) -> QueueState:
        """Load parked queue `name` here and now, as start-up recovery would, backlog
        and all (parking kept it small); its counters are what they were. Blocks the
        event loop for the read (~0.3 ms, ~4 ms at the parking limits): the reactor's
        passes never call it for a request's queue (`load_parked` runs first, on the
        connection's task)."""
        p = parking.unpack(self.parked[name])
        try:
            loaded = self.read_parked(name, p)
        except JournalError as exc:
            log.error("queue %s: loading the parked queue failed: %s", name, exc.__cause__)
            raise
        return self._install(name, p, loaded)

    async def load_parked(self, name: str) -> None:
        """Load parked queue `name` (if it still is) with its files read on a worker
        thread, so the event loop and every connection the reactor serves go on
        meanwhile; callers asking for the same queue during the load wait for it. A
        load that fails, or whose queue changed meanwhile (deleted, its summary
        rewritten), leaves it parked: a use then loads it here and now (`unpark`),
        which logs and reports any failure as before."""
        await self.wait_load(name)  # (then nothing yields until ours is registered)
        data = self.parked.get(name)
        if data is None or self.closing:
            return
        done = self._loading[name] = trio.Event()
        try:
            p = parking.unpack(data)
            try:
                loaded = await trio.to_thread.run_sync(self.read_parked, name, p)
            except Exception:  # the use's own `unpark` answers it (and logs it)
                return
            if self.parked.get(name) is data and not self.closing:
                self._install(name, p, loaded)
            else:
                self._drop(name, loaded)
        finally:
            del self._loading[name]
            done.set()

    @staticmethod
    def _drop(name: str, loaded: LoadedQueue) -> None:
        """A load made moot meanwhile: nothing of it was used; its files close."""
        loaded.journal.close()
        try:
            loaded.journal.close_files()
        except OSError as exc:
            log.error("queue %s: closing the files of a load made moot: %s", name, exc)

    async def wait_load(self, name: str) -> None:
        """Until no `load_parked` of queue `name` is under way (a delete of a parked queue
        waits: its files must not go while they are read)."""
        while (loading := self._loading.get(name)) is not None:
            await loading.wait()

    def _read_parked(self, name: str, p: parking.ParkedQueue) -> LoadedQueue:
        """Parked queue `name`'s journal and readers from its files, not yet loaded
        (`_install`). Reads files and makes objects nothing else holds: it may run on a
        worker thread."""
        try:
            journal = self.datadir.read_parked_queue(name, p.segments,
                                                     [r.name for r in p.readers], p.last_id)
        except (OSError, QueuedError) as exc:
            raise JournalError(f"queue {name!r}: loading it from disk failed: {exc}") from exc
        readers: list[tuple[str, Reader]] = []
        for rname, cp in sorted(journal.readers.items()):
            reader = self._reader(name, rname, cp, journal.last_id, p.create_time_ms)
            count, nbytes = count_unconsumed(journal, cp.head, frozenset(cp.done))
            reader.restore([], cp.head + 1 if count else None, count, nbytes)
            if cp.delays or any(seg.delayed for seg in journal.segments):
                reader.restore_delayed(find_delayed(journal, cp.head, frozenset(cp.done),
                                                    dict(cp.delays)))
            if reader.behind is not None:
                start = reader.behind
                items, next_id = read_range(journal, start, reader.tail,
                                            reader.refill_budget())
                reader.load(start, items, next_id)
            readers.append((rname, reader))
        return LoadedQueue(journal, readers)

    def _install(self, name: str, p: parking.ParkedQueue, loaded: LoadedQueue) -> QueueState:
        """A parked queue read from its files (`_read_parked`) is loaded from now on."""
        journal = loaded.journal
        self.datadir.adopt_queue(journal)
        del self.parked[name]
        self._parked_names -= max(1, len(p.readers))
        self._names = None
        qs = self._add(name)
        qs.create_time_ms = p.create_time_ms
        journal.file.fsyncs, journal.file.write_errors = p.fsyncs, p.write_errors
        summaries = {r.name: r for r in p.readers}
        for rname, reader in loaded.readers:
            summary = summaries.get(rname)
            if summary is not None:
                reader.create_time_ms = summary.create_time_ms
                reader.counters = summary.counters
            cfg = self.reader_config(name, rname)
            reader.limits = cfg  # (as of now: a reload may have come during the read)
            qs.readers[rname] = LiveReader(reader, cfg)
            if reader.wants_refill():
                self.background.start_refill(qs, qs.readers[rname])
        log.debug("queue %s: loaded (was parked)", name)
        return qs

    async def park(self, qs: QueueState) -> bool:
        """Park `qs` if parking.parkable says it may, once its checkpoints are written
        (asked again after that: `detach` runs with nothing yielding until the files
        are closed); True if it was parked."""
        if not parking.parkable(qs):
            return False
        name = qs.name

        def detach(journal: QueueJournal) -> bool:
            if (self.queues.get(name) is not qs or qs.journal is not journal or qs.used
                    or self.closing or not parking.parkable(qs)
                    or any(h.reader.dirty for h in qs.readers.values())):
                return False
            self.parked[name] = parking.pack(parking.summarize(qs))
            self._parked_names += max(1, len(qs.readers))
            del self.queues[name]
            self._names = None
            for h in qs.readers.values():
                h.close()  # a stale reference gets nothing from it
            return True

        parked = False
        with trio.CancelScope(shield=True):
            if any(h.reader.dirty for h in qs.readers.values()):
                await qs.write_checkpoints()
            parked = await self.datadir.park_queue(name, detach)
        return parked

    async def park_idle(self, now: float, after: float) -> int:
        """Look at the next slice of the queues (PARK_SCAN, or an eighth of them if more:
        a walk through all takes 8 ticks at most) at trio time `now`: one used since the
        last look is seen idle from now on; one idle for `after` seconds parks. How many
        did."""
        limit = max(parking.PARK_SCAN, len(self.queues) // 8)
        names = list(itertools.islice(self._cursor, limit))
        if len(names) < limit:
            self._cursor = iter(list(self.queues))  # the next round of the walk
        n = 0
        for name in names:
            qs = self.queues.get(name)
            if qs is None:
                continue
            if qs.used:
                qs.used = False
                qs.idle_since = now
            elif now - qs.idle_since >= after and await self.park(qs):
                n += 1
        return n

    def forget_parked(self, name: str) -> bool:
        """Parked queue `name` is being deleted: forget it (False if it is not parked)."""
        data = self.parked.pop(name, None)
        if data is None:
            return False
        self._parked_names -= max(1, len(parking.unpack(data).readers))
        return True

    def parked_views(self) -> Iterator[tuple[str, parking.ParkedQueue]]:
        """Every parked queue and its summary, in no particular order."""
        for name, data in list(self.parked.items()):
            yield name, parking.unpack(data)
