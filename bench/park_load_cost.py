"""What loading parked queues costs the event loop (the parking review).

A parked queue loads synchronously, on the event loop, at its first use. This prints
(never asserts) how long one load of a queue at the parking limits takes (a ~1 MiB
journal, 16 x 4 KB items waiting), and how long one `flush_all` takes when N parked
queues hold items (each is loaded inside that one call).

    .venv/bin/python bench/park_load_cost.py              # 1,000 queues, ~10 s
    .venv/bin/python bench/park_load_cost.py --queues 300
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import trio

from queued.server.listeners import Server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_util import make_config, running


async def park(server: Server, name: str) -> None:
    b = server.broker
    qs = b.queues[name]
    qs.used = False
    if not await b.registry.park(qs):
        raise SystemExit(f"{name} did not park")


async def main(queues: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        cfg = make_config(Path(d) / "data", None, park_after="1h", checkpoint_interval="1h",
                          expiration_timer="1h", max_queues=queues + 10)
        async with running(cfg) as server:
            b = server.broker
            await b.put("big", [b"x" * 4000] * 250)
            await b.get_many("big", max_items=250 - 16)
            await b.queues["big"].write_checkpoints()
            print(f"big: {b.queues['big'].journal.total_bytes} journal bytes, "
                  f"{b.queues['big'].readers[''].reader.items} items waiting")
            times = []
            for _ in range(20):
                await park(server, "big")
                t = time.perf_counter()
                b.registry.unpark("big")
                times.append(time.perf_counter() - t)
            times.sort()
            print(f"one load at the parking limits: median {times[10] * 1000:.2f} ms, "
                  f"max {times[-1] * 1000:.2f} ms (20 loads)")
            for i in range(queues):
                await b.put(f"q{i}", [b"x" * 1000] * 64)
                await park(server, f"q{i}")
            t = time.perf_counter()
            n = b.flush_all()
            took = time.perf_counter() - t
            print(f"flush_all over {queues} parked queues of 64 x 1 KB: {n} items, one "
                  f"synchronous call of {took * 1000:.0f} ms "
                  f"({took / queues * 1000:.2f} ms a queue); loaded after: {len(b.queues)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queues", type=int, default=1000)
    trio.run(main, ap.parse_args().queues)
