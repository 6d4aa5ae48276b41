"""Delayed delivery: memory held by 1M delayed items, and how late due items arrive.

Starts `queued serve` (fsync never, a temp data dir, 127.0.0.1 on free ports) with queue
`d`'s max_memory_size set by --mem, puts N (default 1,000,000) items of 64 bytes with a
delay of an hour over MessagePack-RPC, and prints the server's RSS before and after, per
item. Then it restarts the server on the same directory (after a restart no delayed
item's data is in memory: only its key in the due-time heap) and prints RSS again. Last,
on a second queue, it puts --late-items items due 200 ms from now and then 20 ms apart,
long-polls them one by one and prints how late each came (ms past its due time).

    python bench/delay_bench.py [--items 1000000] [--mem 128MiB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from benchlib import HOST, kib_field, recording, start_server

from queued.client import Client


def rss_mib(pid: int) -> float:
    return (kib_field(f"/proc/{pid}/status", "VmRSS") or 0) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--mem", default="128MiB", help="queue d's max_memory_size")
    ap.add_argument("--late-items", type=int, default=100)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="delay-bench-"))
    config = tmp / "queued.toml"
    config.write_text(f'[queues.d]\nmax_memory_size = "{args.mem}"\n')
    extra = ("--config", str(config))
    data = tmp / "data"
    proc, ports = start_server(data, tmp / "server.log", extra_args=extra)
    try:
        addr = f"{HOST}:{ports['rpc']}"
        with Client(addr, read_timeout=120) as client:
            client.put("warm", [b"x"])
            client.get("warm", 1)
            base = rss_mib(proc.pid)
            item = b"x" * 64
            batch = 10_000
            t0 = time.perf_counter()
            for start in range(0, args.items, batch):
                client.put("d", [item] * min(batch, args.items - start), delay_ms=3_600_000)
            took = time.perf_counter() - t0
            after = rss_mib(proc.pid)
            stats = client.peek("d").stats
        per_item = (after - base) * 2**20 / args.items
        print(f"put {args.items} delayed items of 64 B in {took:.1f} s "
              f"({args.items / took:,.0f}/s); max_memory_size {args.mem}")
        print(f"RSS before {base:.1f} MiB, after {after:.1f} MiB: "
              f"{per_item:.0f} bytes per delayed item (64 B of data each)")
        print(f"stats: items {stats.get('items')} delayed {stats.get('delayed')} "
              f"mem_bytes {stats.get('mem_bytes')}")
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        t0 = time.perf_counter()
        proc, ports = start_server(data, tmp / "server2.log", extra_args=extra)
        with Client(f"{HOST}:{ports['rpc']}", read_timeout=120) as client:
            client.put("warm", [b"x"])
            client.get("warm", 1)
            started = time.perf_counter() - t0
            again = rss_mib(proc.pid)
            stats = client.peek("d").stats
            print(f"after a restart ({started:.1f} s to serve): RSS {again:.1f} MiB, "
                  f"delayed {stats.get('delayed')}, mem_bytes {stats.get('mem_bytes')} "
                  f"(data on disk: {(again - base) * 2**20 / args.items:.0f} bytes per item)")
            lateness = []
            due = {}
            for k in range(args.late_items):
                # The server's due time is its clock in whole ms at the put + the delay:
                # at least this (the client's clock in whole ms before the put + 200).
                delay = 200 + 20 * k  # 20 ms apart: each get waits for its own item
                due[b"%d" % k] = time.time_ns() // 1_000_000 + delay
                client.put("late", [b"%d" % k], delay_ms=delay)
            for _ in range(args.late_items):
                (it,) = client.get("late", 1, 5000)
                lateness.append(time.time_ns() / 1e6 - due[it.data])
        lateness.sort()
        n = len(lateness)
        print(f"lateness of {n} items due 200 ms + 20 ms apart (ms past due, from the "
              f"client's clock before each put, a get's round trip included): "
              f"min {lateness[0]:.1f} p50 {lateness[n // 2]:.1f} "
              f"p99 {lateness[int(n * 0.99) - 1]:.1f} max {lateness[-1]:.1f}")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recording("delay_bench"):
        main()
