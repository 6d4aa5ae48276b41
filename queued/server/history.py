"""The console's charts: each queue's depth and put and get counters, sampled every
SAMPLE_S seconds for the last WINDOW_S, in memory (lost on restart, as the page's rates).

Owns the ring of samples and what the charts are drawn from (`view`: depth, and rates per
second between samples). It reads `stats` fields handed to it (Broker.queue_stats) and
never touches a queue. At most `max_queues` names are kept (the /metrics cap): ~2.4 KiB
each, as three arrays of 64-bit ints.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

SAMPLE_S: Final = 10.0
WINDOW_S: Final = 15 * 60
SAMPLES: Final = int(WINDOW_S / SAMPLE_S)  # 90


@dataclass(slots=True)
class _Series:
    """One queue's samples, oldest first, aligned with the newest of `History.times`."""

    items: array[int]
    puts: array[int]  # total_items: a counter
    gets: array[int]  # gets: a counter


class History:
    """See the module docstring. `sample` every SAMPLE_S; `view` for the console."""

    def __init__(self, max_queues: int = 1000, samples: int = SAMPLES) -> None:
        self.max_queues = max_queues
        self.samples = samples
        self.times: array[float] = array("d")  # unix seconds of each sample
        self.series: dict[str, _Series] = {}

    def sample(self, now_s: float, stats: Iterable[tuple[str, Mapping[str, int]]]) -> None:
        """One sample of every reader in `stats` (`q` or `q+r` -> its `stats` fields);
        names missing from it are forgotten (deleted), and names past `max_queues`."""
        self.times.append(now_s)
        if len(self.times) > self.samples:
            del self.times[0]
        seen: set[str] = set()
        for name, f in stats:
            s = self.series.get(name)
            if s is None:
                if len(self.series) >= self.max_queues:
                    continue
                s = self.series[name] = _Series(array("q"), array("q"), array("q"))
            seen.add(name)
            for a, v in ((s.items, f["items"]), (s.puts, f["total_items"]),
                         (s.gets, f["gets"])):
                a.append(v)
                if len(a) > self.samples:
                    del a[0]
        for gone in self.series.keys() - seen:
            del self.series[gone]

    def view(self, may_see: Callable[[str], bool], now_s: float | None = None,
             now: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, object]:
        """What the charts draw, for the names `may_see` allows: per queue `items` (depth
        at each sample) and `puts` / `gets` (per second between a sample and the one
        before; a counter that went back, a restart or a deleted queue, counts 0). With
        `now` (the current `stats` fields), a last point taken now is added."""
        times = list(self.times)
        queues: dict[str, object] = {}
        names = list(self.series)
        if now is not None:  # queues made since the last sample: their point of now
            room = self.max_queues - len(names)
            names += [n for n in now if n not in self.series][:max(0, room)]
        empty = _Series(array("q"), array("q"), array("q"))
        for name in names:
            if not may_see(name):
                continue
            s = self.series.get(name, empty)
            items, puts, gets = list(s.items), list(s.puts), list(s.gets)
            at = times[len(times) - len(items):]
            f = None if now is None else now.get(name)
            if f is not None and now_s is not None:
                at, items = [*at, now_s], [*items, f["items"]]
                puts, gets = [*puts, f["total_items"]], [*gets, f["gets"]]
            queues[name] = {"t": at, "items": items, "puts": _rates(at, puts),
                            "gets": _rates(at, gets)}
        return {"interval_s": SAMPLE_S, "window_s": WINDOW_S, "queues": queues}


def _rates(times: list[float], counts: list[int]) -> list[float]:
    """Per second between consecutive samples (one fewer than the samples)."""
    return [round(max(0, b - a) / max(t1 - t0, 1e-3), 3)
            for t0, t1, a, b in zip(times, times[1:], counts, counts[1:], strict=False)]
