"""What every part of the broker shares: the registry of queues, the ledger of open reads,
the counters, latency histograms and clock (`BrokerBase`).

The broker's public face is `queued.broker.broker.Broker`; its subjects are layers over this
base, each in a module of its own and each a subclass of the one before (`PutPath` in
`puts`, `GetPath` in `gets`, `AdminOps` in `admin`, then `Broker`: one chain, as a
compiled class allows one base only), so a request calls the method it needs with no hop
between objects. No sockets, no background loops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import trio

from queued.broker.queues import Background
from queued.broker.registry import BrokerCounters, Registry
from queued.broker.reliable import ReliableReads
from queued.stats import LATENCY_BUCKETS, Histogram
from queued.storage.datadir import DataDir

if TYPE_CHECKING:
    from queued.config import ServerConfig

#: (a C static compiled, not a look-up in the module's globals and `time` at each call)
_time: Final = time.time


def wall_ms() -> int:
    return int(_time() * 1000)


class BrokerBase:
    """The broker's state (see the module docstring)."""

    def __init__(
        self, datadir: DataDir, config: ServerConfig, clock: Callable[[], int] = wall_ms
    ) -> None:
        self.datadir = datadir
        self.clock = clock
        #: where queues send refills and moves; upkeep attaches what runs them
        self.background = Background()
        self.counters = BrokerCounters()
        # Through _now, not `clock` itself: reassigning broker.clock reaches every queue.
        self.registry = Registry(datadir, config, self._now, self.background, self.counters)
        self.queues = self.registry.queues
        self.reads = ReliableReads(self.queues, self.background)
        self.clients = self.reads.clients
        #: deadlines of open reads; upkeep sleeps until the next and calls expire_open_reads
        self.timeouts = self.reads.timeouts
        #: begin_put to durable, per put call (a batch of items is one observation).
        self.put_latency = Histogram(LATENCY_BUCKETS)
        #: Call to answer, per get that did not wait for an item to arrive.
        self.get_latency = Histogram(LATENCY_BUCKETS)
        self.start_time = time.time()
        self.pause_lock = trio.Lock()  # (set_paused)

    def _now(self) -> int:
        return self.clock()

    @property
    def config(self) -> ServerConfig:
        return self.registry.config

    @property
    def closing(self) -> bool:
        """Shutting down: no new queues, waiting gets answered empty, no new waits."""
        return self.registry.closing
