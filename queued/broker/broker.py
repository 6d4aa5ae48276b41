"""The queues of one server as the protocol sessions see them: put, get, confirm, abort.

Puts become durable through the data directory's writer and only then reach the
readers (in id order) and long-polling waiters (FIFO); a reliable read belongs to
the `OpenReads` ledger of its connection and goes back to the head of its queue
when aborted, not confirmed in time, or when its connection leaves. No sockets and no
background loops here: the sessions call these methods and `queued.broker.upkeep` runs
the periodic work (it may import this module; this module never imports it).
The registry (`queued.broker.registry`) finds and creates queues and readers; each
queue's own logic is `queued.broker.queues`; open reads across queues, `queued.broker.reliable`;
the per-reader state machine is pure, in `queued.reader.state`.

`Broker` is the one public face; its subjects are layers, a module each, each the subclass
of the one before (one chain of single inheritance, which mypyc compiles): the shared
state (`queued.broker.base`), the put path (`queued.broker.puts`), the get and confirm
path (`queued.broker.gets`), whole-queue operations and statistics
(`queued.broker.admin`). This module adds the lifecycle: loading, the pass's commit, the
rounds of upkeep, reconfiguration and shutdown.

Readers. `q` is reader "" of queue q; `q+name` is reader `name`. A new named
reader starts at the tail (it sees items put after it was created), except the
first named reader of a queue that only has the default reader: it takes over
the default reader's backlog and checkpoint (libkestrel's rule), and a later
plain `q` starts a new default reader at the tail.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from queued.broker.admin import AdminOps, BrokerStatistics
from queued.broker.base import wall_ms
from queued.broker.gets import AfterCommit, MustWait
from queued.broker.puts import JoinedPut, JoinedPuts
from queued.broker.queues import PendingPut
from queued.broker.registry import BrokerCounters
from queued.broker.reliable import Owe

if TYPE_CHECKING:
    from queued.config import ServerConfig

__all__ = ["AfterCommit", "Broker", "BrokerCounters", "BrokerStatistics", "JoinedPut",
           "JoinedPuts", "MustWait", "Owe", "PendingPut", "wall_ms"]

log = logging.getLogger("queued.broker")


class Broker(AdminOps):
    """See the module docstring. Create with `queued.broker.upkeep.open_broker`."""

    async def load(self) -> None:
        """Build every recovered queue's readers from their durable checkpoints."""
        await self.registry.load()

    # -- the pass's commit ------------------------------------------------------------------

    def defer_writes(self, on: bool) -> None:
        """While on, journal changes wait for `commit_now` (one write per file for a
        whole pass) instead of being written as they are planned."""
        self.datadir.deferring = on

    def commit_now(self) -> bool:
        """Every planned journal change written and synced by policy, here and now
        (the reactor's pass); False, nothing done, while a writer round is under way."""
        return self.datadir.commit_now()

    async def wait_round(self) -> None:
        """Until no writer round is under way (then `commit_now` can run)."""
        await self.datadir.wait_round()

    def write_ready(self) -> None:
        """Write now the journal changes that need no fsync (confirms under fsync never or
        <ms>): a connection calls it before it waits for what its batch owes."""
        self.datadir.write_ready()

    # -- rounds of upkeep (queued.broker.upkeep runs them on timers) ---------------------

    def next_due_ms(self) -> int | None:
        """When the next delayed item of any reader falls due (unix ms), if any."""
        return min((d for qs in self.queues.values() for h in qs.readers.values()
                    if (d := h.reader.next_due_ms()) is not None), default=None)

    def promote_due(self) -> int:
        """Delayed items now due join their readers' due items; waiting gets are served."""
        now = self.clock()
        n = 0
        for qs in list(self.queues.values()):
            for h in list(qs.readers.values()):
                due = h.reader.next_due_ms()
                if due is not None and due <= now:
                    n += h.reader.promote(now)
                    qs.serve(h)
        return n

    def expire_open_reads(self, now: float) -> int:
        """Return every open read whose deadline (trio time) is <= now; how many."""
        return self.reads.expire(now)

    async def checkpoint_all(self, *, force: bool = False) -> int:
        """Write the checkpoint of every reader that consumed something; compact."""
        written = 0
        for qs in list(self.queues.values()):
            written += await qs.write_checkpoints(force=force)
        return written

    async def sweep(self) -> None:
        """Expire items at the head of every loaded reader (a parked queue's expire when
        it loads); delete queues past max_queue_age, parked ones too (idle if empty)."""
        now = self.clock()
        for qs in list(self.queues.values()):
            if self.queues.get(qs.name) is not qs:
                continue  # parked (or deleted) while an earlier queue was being deleted
            for h in list(qs.readers.values()):
                qs.expire_head(h, now, h.config.max_expire_sweep)
            age = qs.config.max_queue_age
            if age and now - qs.create_time_ms > age and qs.idle():
                await self._expire_queue(qs.name)
        cfg = self.config
        if self.registry.parked and (cfg.default.max_queue_age or any(
                "max_queue_age" in section for section in cfg.queues.values())):
            for name, p in self.registry.parked_views():
                age = cfg.queue_config(name).max_queue_age
                if age and now - p.create_time_ms > age and p.empty:
                    await self._expire_queue(name)

    async def _expire_queue(self, name: str) -> None:
        log.info("queue %s: empty and older than max_queue_age, deleting", name)
        await self.delete(name)
        self.counters.queue_expires += 1

    # -- configuration and shutdown ---------------------------------------------------------------

    def wake_waiters(self) -> None:
        """Answer every waiting get as empty (shutdown)."""
        self.registry.closing = True
        for qs in self.queues.values():
            for h in qs.readers.values():
                h.wake_all()

    def reconfigure(self, config: ServerConfig) -> None:
        """Apply reloaded queue configs to every existing queue and reader."""
        self.registry.reconfigure(config)

    async def park_idle(self, now: float) -> int:
        """Park the queues unused for `park_after` among the next slice the parker looks
        at (see Registry.park_idle); how many parked."""
        return await self.registry.park_idle(now, self.config.park_after / 1000)

    async def aclose(self) -> list[str]:
        """Refuse new work, return open reads (no error counted), write every checkpoint
        (parked queues wrote theirs when they parked). Returns what could not be saved,
        one line per reader ([] when all was)."""
        self.wake_waiters()
        for client in list(self.clients.values()):
            self.release(client, count_error=False)
        await self.checkpoint_all(force=True)
        return [f"queue {qs.name}, {f'reader {reader}' if reader else 'default reader'}: "
                f"checkpoint not written ({why}); what it read since its last checkpoint "
                f"will be delivered again"
                for qs in self.queues.values()
                for reader, why in sorted(qs.unsaved_checkpoints.items())]
