"""What one queue costs in memory: the Python heap it holds (tracemalloc) and RSS.

Runs an in-process server (fsync never, a temp data dir, 127.0.0.1 on free ports),
creates N queues over the memcache port in one of several ways, and prints the heap
bytes per queue with the allocation sites that hold most of them (a tracemalloc
snapshot diff, grouped by file and line), then, in a fresh process without
tracemalloc, the RSS per queue (after a garbage collection and malloc_trim).

    python bench/queue_mem.py [--queues 2000] [--how empty|item|taken|fanout|all] [--top 25]
                              [--parked]
    python bench/queue_mem.py --load-cost [--loads 20]

("all": the first three; fanout is slow under tracemalloc.)

  empty   `get qN`: a queue made by a get that found nothing
  item    `set qN`: a queue holding one 16-byte item (its segment file written)
  taken   `set qN` then `get qN`: the item taken again (checkpoint owed)
  fanout  `get qN+r`: a queue and a fanout reader

--parked: park_after 100 ms, and the figures are taken once every queue is parked
(what a parked queue costs: its name and summary); without it parking is off.

--load-cost: instead, how long loading one parked queue takes, on the event loop, at its
first use: a queue at the parking limits (a ~1 MiB journal, 16 x 4 KB items waiting) is
parked and loaded --loads times (20); prints the median and the slowest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import trio
from benchlib import recording

from queued.config import load_config
from queued.server.app import serve
from queued.server.listeners import Server
from queued.server.memory import rss_bytes, trim

HOW = ("empty", "item", "taken", "fanout")


def commands(how: str, i: int) -> bytes:
    name = b"qm%d" % i
    if how == "empty":
        return b"get %s\r\n" % name
    if how == "item":
        return b"set %s 0 0 16\r\n%s\r\n" % (name, b"x" * 16)
    if how == "taken":
        return b"set %s 0 0 16\r\n%s\r\nget %s\r\n" % (name, b"x" * 16, name)
    return b"get %s+r\r\n" % name


async def send(port: int, how: str, first: int, n: int) -> None:
    """Make queues first..first+n over one connection and read every reply."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        payload = b"".join(commands(how, i) for i in range(first, first + n))
        await stream.send_all(payload + b"quit\r\n")
        while await stream.receive_some(65536):
            pass


async def settle() -> None:
    """Let the writer round and the upkeep run, then free what can be freed."""
    await trio.sleep(0.3)
    gc.collect()
    trim()


async def all_parked(server: Server, parked: bool) -> None:
    """With --parked: wait (60 s at most) until no queue is loaded."""
    with trio.fail_after(60):
        while parked and server.broker.queues:
            await trio.sleep(0.05)


async def measure(how: str, queues: int, top: int, trace: bool,
                  parked: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="queued-qmem-") as tmp:
        config = load_config({"data_dir": str(Path(tmp) / "data"), "memcache_port": 0,
                              "text_port": 0, "rpc_port": 0, "http_port": 0,
                              "fsync": "never", "max_queues": queues * 3 + 100,
                              "park_after": "100ms" if parked else "0"}, env={})
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            port = server.ports["memcache"]
            await send(port, how, 0, 200)  # warm up: code paths, caches, first objects
            await all_parked(server, parked)
            await settle()
            if trace:
                tracemalloc.start(8)
            before_rss = rss_bytes() or 0
            before = tracemalloc.take_snapshot() if trace else None
            for first in range(200, 200 + queues, 500):
                await send(port, how, first, min(500, 200 + queues - first))
            await all_parked(server, parked)
            await settle()
            after_rss = rss_bytes() or 0
            out: dict[str, object] = {"how": how, "queues": server.broker.statistics().queues,
                                      "parked": len(server.broker.registry.parked),
                                      "rss_per_queue": (after_rss - before_rss) / queues}
            if trace:
                assert before is not None
                after = tracemalloc.take_snapshot()
                tracemalloc.stop()
                diff = after.compare_to(before, "traceback")
                out["heap_per_queue"] = sum(d.size_diff for d in diff) / queues
                out["blocks_per_queue"] = sum(d.count_diff for d in diff) / queues
                merged: dict[tuple[str, str], list[float]] = {}
                for d in diff:
                    frames = list(d.traceback)  # oldest first
                    site = next((f for f in reversed(frames) if "/queued/" in f.filename),
                                frames[-1])
                    inner = frames[-1]
                    key = (f"{'/'.join(Path(site.filename).parts[-2:])}:{site.lineno}",
                           f"{Path(inner.filename).name}:{inner.lineno}")
                    row = merged.setdefault(key, [0.0, 0.0])
                    row[0] += d.size_diff / queues
                    row[1] += d.count_diff / queues
                rows = sorted(((size, count, *key) for key, (size, count) in merged.items()),
                              key=lambda r: -abs(r[0]))[:top]
                out["rows"] = rows
            server.request_shutdown("measured")
        return out


async def load_cost(loads: int) -> None:
    """One load of a parked queue at the parking limits, `loads` times."""
    with tempfile.TemporaryDirectory(prefix="queued-qmem-") as tmp:
        config = load_config({"data_dir": str(Path(tmp) / "data"), "memcache_port": 0,
                              "text_port": 0, "rpc_port": 0, "http_port": 0,
                              "fsync": "never", "park_after": "1h",
                              "checkpoint_interval": "1h", "expiration_timer": "1h"}, env={})
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            b = server.broker
            await b.put("big", [b"x" * 4000] * 250)
            await b.get_many("big", max_items=250 - 16)
            await b.queues["big"].write_checkpoints()
            print(f"big: {b.queues['big'].journal.total_bytes:,} journal bytes, "
                  f"{b.queues['big'].readers[''].reader.items} items waiting")
            times = []
            for _ in range(loads):
                qs = b.queues["big"]
                qs.used = False
                if not await b.registry.park(qs):
                    raise SystemExit("the queue did not park")
                t = time.perf_counter()
                b.registry.unpark("big")
                times.append(time.perf_counter() - t)
            times.sort()
            print(f"one load at the parking limits: median {times[len(times) // 2] * 1000:.2f} "
                  f"ms, max {times[-1] * 1000:.2f} ms ({loads} loads)")
            server.request_shutdown("measured")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", type=int, default=2000)
    ap.add_argument("--how", choices=(*HOW, "all"), default="all",
                    help="all: empty, item and taken (fanout is slow under tracemalloc)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--parked", action="store_true",
                    help="measure once every queue is parked (park_after 100 ms)")
    ap.add_argument("--load-cost", action="store_true",
                    help="instead: the time one load of a parked queue takes")
    ap.add_argument("--loads", type=int, default=20, help="loads timed with --load-cost")
    ap.add_argument("--child", choices=("trace", "rss"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_cost:
        trio.run(load_cost, args.loads)
        return
    if args.child:
        result = trio.run(measure, args.how, args.queues, args.top, args.child == "trace",
                          args.parked)
        print(json.dumps(result))
        return
    for how in HOW[:3] if args.how == "all" else (args.how,):
        runs = {}
        for child in ("trace", "rss"):
            out = subprocess.run([sys.executable, __file__, "--how", how, "--queues",
                                  str(args.queues), "--top", str(args.top), "--child", child,
                                  *(["--parked"] if args.parked else [])],
                                 check=True, capture_output=True, text=True,
                                 env={**os.environ, "QUEUED_BENCH_RESULTS": "off"}).stdout
            runs[child] = json.loads(out.strip().splitlines()[-1])
        t = runs["trace"]
        print(f"\n{how}: {t['queues']} queues ({t['parked']} parked); per queue: "
              f"heap {t['heap_per_queue']:.0f} B in "
              f"{t['blocks_per_queue']:.1f} blocks, RSS {runs['rss']['rss_per_queue']:.0f} B")
        print(f"{'B/queue':>8} {'blocks':>6}  site (innermost)")
        for size, count, site, inner in t["rows"]:
            if abs(size) >= 1:
                print(f"{size:>8.0f} {count:>6.2f}  {site} ({inner})")


if __name__ == "__main__":
    with recording("queue_mem"):
        main()
