"""The broker's background work: what runs on timers or on its own, not for a request.

Checkpoints and compaction every `checkpoint_interval`, expiry sweeps every
`expiration_timer`, open reads returned at their deadlines, read-behind refills
ahead of the next get, moves of items to an error queue or expire_to_queue, and
parking queues unused for `park_after` (a slice of the queues per tick).
Given the broker from above (`open_broker` wires them): upkeep imports the broker,
the broker never imports upkeep; it only hands work to the `Background` this
attaches to. Each round is a broker method; upkeep decides when, and keeps one bad
round from taking the server down.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import trio

from queued.broker.broker import Broker, wall_ms
from queued.broker.live_readers import LiveReader
from queued.broker.parking import park_tick
from queued.broker.queues import QueueState
from queued.errors import (
    ItemTooLargeError,
    JournalError,
    NotSavedError,
    QueueClosedError,
    QueueFullError,
)
from queued.reader.state import Item
from queued.storage.opening import open_data_dir

if TYPE_CHECKING:
    from queued.config import ServerConfig

log = logging.getLogger("queued.broker")

#: Why a move to another queue may fail; the items then stay (or, expired, are dropped).
MOVE_ERRORS = (JournalError, QueueFullError, ItemTooLargeError, QueueClosedError,
               ValueError, OSError)


@dataclass(frozen=True, slots=True)
class UpkeepStatistics:
    running: bool
    refills: int  # refill tasks running now
    moves: int  # moves to another queue running now
    checkpoint_rounds: int
    sweep_rounds: int
    park_rounds: int
    parked: int  # queues parked since start
    failed_rounds: int  # checkpoint or sweep rounds that raised (logged)


class Upkeep:
    """See the module docstring. `run` it in a nursery; cancel to stop."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._nursery: trio.Nursery | None = None
        self._timeout_wake = trio.Event()
        self._delay_scope: trio.CancelScope | None = None
        self._delay_due_ms: float = math.inf  # when the delay loop wakes next (unix ms)
        self._refills = 0
        self._moves = 0
        self._rounds = {"checkpoint round": 0, "expiry sweep": 0, "parking round": 0,
                        "failed": 0}
        self._parked = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background tasks and moves; cancel to stop (after the broker's `aclose`)."""
        b = self.broker
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                b.background.runner = self
                for qs in list(b.queues.values()):
                    for h in list(qs.readers.values()):
                        if h.reader.wants_refill():
                            self.refill(qs, h)  # warm memory with the recovered backlog
                nursery.start_soon(self._every, "checkpoint round",
                                   lambda: b.config.checkpoint_interval, b.checkpoint_all)
                nursery.start_soon(self._every, "expiry sweep",
                                   lambda: b.config.expiration_timer, b.sweep)
                nursery.start_soon(self._timeout_loop)
                nursery.start_soon(self._delay_loop)
                nursery.start_soon(self._every, "parking round",
                                   lambda: park_tick(b.config.park_after) * 1000, self._park)
                task_status.started()
        finally:
            b.background.runner = None
            self._nursery = None

    async def _every(
        self, name: str, interval_ms: Callable[[], float], round_: Callable[[], Awaitable[object]]
    ) -> None:
        """`round_` every `interval_ms()` milliseconds, each after the last ends."""
        while True:
            await trio.sleep(interval_ms() / 1000)
            try:
                await round_()
            except Exception:  # a background task must outlive one bad round
                self._rounds["failed"] += 1
                log.exception("%s failed", name)
            else:
                self._rounds[name] += 1

    async def _park(self) -> None:
        if self.broker.config.park_after:
            self._parked += await self.broker.park_idle(trio.current_time())

    async def _timeout_loop(self) -> None:
        while True:
            self._timeout_wake = trio.Event()
            deadline = self.broker.timeouts.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timeout_wake.wait()
            self.broker.expire_open_reads(trio.current_time())

    async def _delay_loop(self) -> None:
        """Sleep until the next delayed item of any reader falls due (a trio deadline:
        no polling), promote what is due, serve its waiting gets; an earlier due time
        pushed meanwhile (`delays_changed`) moves the deadline forward."""
        b = self.broker
        while True:
            due_ms = b.next_due_ms()
            if due_ms is None:
                self._delay_due_ms = math.inf
                deadline = math.inf
            else:
                self._delay_due_ms = due_ms
                deadline = trio.current_time() + max(0, due_ms - b.clock()) / 1000
            with trio.CancelScope(deadline=deadline) as scope:
                self._delay_scope = scope
                await trio.sleep_forever()
            self._delay_scope = None
            try:
                b.promote_due()
            except Exception:  # the loop must outlive one bad round
                self._rounds["failed"] += 1
                log.exception("delayed items round failed")

    # -- what queues hand over (queued.broker.queues.Runner) ----------------------

    def delays_changed(self, due_ms: int) -> None:
        """An item waits until `due_ms` (unix ms): if that is before the delay loop's
        deadline, bring the deadline forward."""
        scope = self._delay_scope
        if scope is not None and due_ms < self._delay_due_ms:
            self._delay_due_ms = due_ms
            scope.deadline = trio.current_time() + max(0, due_ms - self.broker.clock()) / 1000

    def timeouts_changed(self) -> None:
        """An earlier deadline was pushed: the timeout loop sleeps until it instead."""
        self._timeout_wake.set()

    def refill(self, qs: QueueState, h: LiveReader) -> None:
        """Read `h`'s backlog back into memory until it has enough (one task per reader)."""
        if h.refilling or h.closed or self._nursery is None:
            return
        h.refilling = True
        self._nursery.start_soon(self._refill, qs, h)

    async def _refill(self, qs: QueueState, h: LiveReader) -> None:
        self._refills += 1
        try:
            while not h.closed:
                if h.reader.wants_fetch():
                    await qs.fetch_once(h)
                elif h.reader.wants_refill():
                    await qs.refill_once(h)
                else:
                    break
        except JournalError:
            pass  # logged; the next get tries again (and reports it to its client)
        except Exception:  # a bug here must not take the server down with it
            log.exception("queue %s reader %r: reading items back failed", qs.name,
                          h.reader.name)
        finally:
            h.refilling = False
            self._refills -= 1

    def move(
        self, qs: QueueState, h: LiveReader, items: list[Item], target: str, keep_errors: bool
    ) -> None:
        """Put `items` (already marked moving in `h`) into queue `target`."""
        if self._nursery is None:
            raise RuntimeError("broker is not running")
        self._nursery.start_soon(self._move, qs, h, items, target, keep_errors)

    async def _move(
        self, qs: QueueState, h: LiveReader, items: list[Item], target: str, keep_errors: bool
    ) -> None:
        """Error-queue moves keep each item's error count (one put each); expiry moves
        are one put per run of items with the same flags (one in all, usually). Every
        item keeps its memcache flags and headers. Then the items are consumed here, or
        go back / are dropped."""
        self._moves += 1
        moved = False
        try:
            if keep_errors:
                for it in items:
                    await self.broker.put(target, [it.data], error_count=it.error_count,
                                          flags=it.flags,
                                          headers=[it.headers] if it.headers else None)
            else:
                for flags, group in itertools.groupby(items, key=attrgetter("flags")):
                    run = list(group)
                    headers = [it.headers for it in run]
                    await self.broker.put(target, [it.data for it in run], flags=flags,
                                          headers=headers if any(headers) else None)
            moved = True
        except MOVE_ERRORS as exc:
            log.error("queue %s: could not move %d items to %s: %s",
                      qs.name, len(items), target, exc)
        finally:
            self._moves -= 1
        qs.finish_move(h, items, moved=moved, keep_errors=keep_errors)

    def statistics(self) -> UpkeepStatistics:
        return UpkeepStatistics(
            running=self._nursery is not None,
            refills=self._refills,
            moves=self._moves,
            checkpoint_rounds=self._rounds["checkpoint round"],
            sweep_rounds=self._rounds["expiry sweep"],
            park_rounds=self._rounds["parking round"],
            parked=self._parked,
            failed_rounds=self._rounds["failed"],
        )


@asynccontextmanager
async def open_broker(
    config: ServerConfig, clock: Callable[[], int] = wall_ms
) -> AsyncIterator[Broker]:
    """Recover the data directory, load the queues, run their upkeep; close cleanly.

    A stop that could not write every checkpoint, or fsync and close every journal,
    raises NotSavedError listing each (once all the rest is closed).
    """
    unsaved: list[str] = []
    finished = False  # the body ended without an exception
    try:
        async with open_data_dir(
            config.data_dir,
            config.data_dir_config(),
            lambda name: config.queue_config(name).journal_config(),
        ) as dd:
            broker = Broker(dd, config, clock)
            await broker.load()
            async with trio.open_nursery() as nursery:
                await nursery.start(Upkeep(broker).run)
                try:
                    yield broker
                    finished = True
                finally:
                    with trio.CancelScope(shield=True):
                        unsaved = await broker.aclose()
                    nursery.cancel_scope.cancel()
    except NotSavedError as exc:  # the journals could not be closed either
        if not finished:
            raise  # after another failure, which stays its context
        unsaved += exc.unsaved
    if unsaved:
        raise NotSavedError(unsaved)
