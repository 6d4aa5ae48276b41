"""Counters and histograms the core keeps for `statistics()` and /metrics.

PURE: no clocks, sockets or files; callers pass durations in. Everything here is
cheap enough for the hot path (a short scan of the bounds and two additions per
observation), and nothing here knows about Prometheus: `queued.server.metrics` reads
these at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the fsync duration histogram.
FSYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Upper bounds (seconds) of the put and get latency histograms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # observations <= each bound
    count: int  # every observation (the +Inf bucket)
    sum: float


class Histogram:
    """Counts of observations per bucket (upper bounds inclusive, as Prometheus's `le`)."""

    __slots__ = ("_counts", "bounds", "count", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`value` observed `times` times (the puts of a pass share one latency)."""
        i = 0
        for bound in self.bounds:  # (most values fall in the first few: no bisect call)
            if value <= bound:
                break
            i += 1
        self._counts[i] += times
        self.count += times
        self.sum += value * times

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._counts[:-1]:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self.count, self.sum)


_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
_COMMAND_NAMES: dict[type, str] = {}


def command_name(event: object) -> str:
    """A parser event's command name for the metrics ("FlushAllExpired" -> "flush_all_expired")."""
    cls = type(event)
    name = _COMMAND_NAMES.get(cls)
    if name is None:
        name = _COMMAND_NAMES[cls] = _CAMEL.sub(r"_\1", cls.__name__).lower()
    return name


@dataclass(slots=True)
class ProtocolStats:
    """One listener's connections, commands and protocol errors since start."""

    connections: int = 0  # open now
    total_connections: int = 0
    refused_connections: int = 0
    protocol_errors: int = 0  # malformed or refused requests (not a queue's own errors)
    commands: dict[str, int] = field(default_factory=dict)
    auth_failures: int = 0  # wrong credentials, a command first, no login in time
    permission_denied: int = 0
    request_timeouts: int = 0  # connections closed on a request not complete in time
    tls_handshake_failures: int = 0

    def count(self, command: str, n: int = 1) -> None:
        self.commands[command] = self.commands.get(command, 0) + n
