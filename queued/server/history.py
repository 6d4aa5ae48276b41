"""The console's charts: each queue's depth and put and get counters, sampled every
SAMPLE_S seconds for the last WINDOW_S, in memory; kept across a clean restart in the
data dir's HISTORY_FILE (written at shutdown only, read at start: the samples never
cost a write while the server runs, and a crash loses them, as it loses nothing else).

Owns the ring of samples and what the charts are drawn from (`view`: depth, and rates per
second between samples), and that file. It reads `stats` fields handed to it
(Broker.queue_stats) and never touches a queue. At most `max_queues` names are kept (the
/metrics cap): ~2.4 KiB each, as three arrays of 64-bit ints.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Final

from queued.storage.datadir import HISTORY_FILE
from queued.storage.files import write_file_atomic

log = logging.getLogger("queued.console")

SAMPLE_S: Final = 10.0
WINDOW_S: Final = 15 * 60
SAMPLES: Final = int(WINDOW_S / SAMPLE_S)  # 90
#: The form of HISTORY_FILE (another is ignored, as is a damaged one).
FILE_VERSION: Final = 1
#: A HISTORY_FILE larger than this is not read (1,000 queues take ~2 MiB).
MAX_FILE_BYTES: Final = 64 << 20


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


    def snapshot(self) -> dict[str, object]:
        """Every sample, as `restore` takes them back (JSON-able)."""
        return {"version": FILE_VERSION, "interval_s": SAMPLE_S, "times": list(self.times),
                "series": {name: {"items": list(s.items), "puts": list(s.puts),
                                  "gets": list(s.gets)} for name, s in self.series.items()}}

    def restore(self, doc: object, now_s: float, names: Collection[str]) -> int:
        """Take the samples of a `snapshot` (of an earlier run) that are less than
        WINDOW_S old at `now_s`, for the readers in `names` (those that still exist),
        before any sample of this run; how many readers got some. ValueError (nothing
        taken) for a document that is not a snapshot."""
        if not (isinstance(doc, dict) and doc.get("version") == FILE_VERSION):
            raise ValueError("not a chart history of this version")
        times, series = doc.get("times"), doc.get("series")
        if not (isinstance(times, list) and isinstance(series, dict)
                and all(type(t) in (int, float) for t in times)
                and all(a < b for a, b in pairwise(times))):
            raise ValueError("its sample times are not a rising list of numbers")
        # (a suffix of `times`: each series is aligned with its newest; none when the
        # clock went back since)
        kept = ([] if times and times[-1] > now_s else
                [float(t) for t in times if t > now_s - WINDOW_S][-self.samples:])
        restored: dict[str, _Series] = {}
        for name, s in series.items():
            if not (isinstance(s, dict) and all(
                    isinstance(s.get(k), list) and len(s[k]) <= len(times)
                    and all(type(v) is int for v in s[k]) for k in ("items", "puts", "gets"))
                    and len(s["items"]) == len(s["puts"]) == len(s["gets"])):
                raise ValueError(f"its series of {name!r} is not three lists of integers")
            n = len(s["items"])
            keep = min(n, len(kept))  # its newest, within the window
            if keep > 0 and name in names and len(restored) < self.max_queues:
                try:
                    restored[name] = _Series(*(array("q", s[k][n - keep:])
                                               for k in ("items", "puts", "gets")))
                except OverflowError:
                    raise ValueError(f"its series of {name!r} is out of range") from None
        if restored:
            self.times = array("d", kept)
            self.series = restored
        return len(restored)

    def save(self, data_dir: Path) -> None:
        """Write every sample to the data dir's HISTORY_FILE (temp, fsync, rename; at a
        clean shutdown, in a worker thread)."""
        write_file_atomic(data_dir / HISTORY_FILE, json.dumps(
            self.snapshot(), separators=(",", ":")).encode("ascii"))

    def load(self, data_dir: Path, now_s: float, names: Collection[str]) -> None:
        """Take back the samples an earlier run saved (`save`), if any, then remove the
        file (a crash later must not bring back samples older than those it lost). A
        damaged file is logged and ignored: the charts start empty, as before."""
        path = data_dir / HISTORY_FILE
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            n = self.restore(json.loads(path.read_bytes()), now_s, names)
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:  # (json's: ValueErrors)
            log.warning("console: chart history %s not read (%s); the charts start empty",
                        path, exc)
        else:
            log.info("console: chart history of %d queues read back from %s", n, path)
        path.unlink(missing_ok=True)


def _rates(times: list[float], counts: list[int]) -> list[float]:
    """Per second between consecutive samples (one fewer than the samples)."""
    return [round(max(0, b - a) / max(t1 - t0, 1e-3), 3)
            for t0, t1, a, b in zip(times, times[1:], counts, counts[1:], strict=False)]
