"""What a retry_backoff costs a get+confirm loop that never fails: nothing, it should.

Starts two `queued serve` (fsync never, temp data dirs, 127.0.0.1 on free ports), one
with `retry_backoff = ["1s", "10s", "1m", "10m"]` on every queue and one without, fills
queue `q` of each, then runs the same loop on each in turn, --pairs times (alternating
which server goes first): a memcache connection sending `get q/close/open` (confirm the
last, open the next), one request at a time. Prints items/s and server CPU (user +
system) per item for each run, and the median ratios of with / without items/s and of
without / with CPU per item (>= 1.0: no slower, no costlier).

    python bench/backoff_bench.py [--items 20000] [--pairs 5] [--in-process]

--in-process runs the loop on two brokers in this process instead (`Broker.get` open,
then `confirm`, one item at a time) and times it in CPU seconds of the process: no
sockets, no scheduling between client and server, and time spent descheduled does not
count, so far less noise on a shared machine; it prints the CPU-per-item ratio.
"""

from __future__ import annotations

import argparse
import math
import shutil
import socket
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio
from benchlib import proc_cpu_s
from fuzz_rss import HOST, start_server

from queued.broker.upkeep import open_broker
from queued.client import Client
from queued.config import load_config
from queued.reader.open_reads import OpenReads

BACKOFF = '[default]\nretry_backoff = ["1s", "10s", "1m", "10m"]\n'


def loop(port: int, n: int) -> float:
    """Seconds for n `get q/close/open` round trips (each answers one item)."""
    with socket.create_connection((HOST, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = b"get q/close/open\r\n"
        t0 = time.perf_counter()
        for _ in range(n):
            s.sendall(req)
            buf = b""
            while not buf.endswith(b"END\r\n"):
                buf += s.recv(65536)
        took = time.perf_counter() - t0
        s.sendall(b"get q/close\r\n")
        s.recv(65536)
    return took


async def broker_rounds(data: Path, items: int, pairs: int) -> list[float]:
    """--in-process: the same loop on two brokers in this process (no sockets, no
    scheduler between client and server): per pair, CPU seconds without / with (the
    process's, all threads), alternating which goes first."""
    brokers = {}
    async with AsyncExitStack() as stack:
        for name, toml in (("without", None), ("with", BACKOFF)):
            flags: dict[str, object] = {"data_dir": str(data / name), "fsync": "never"}
            if toml is not None:
                (data / "backoff.toml").write_text(toml)
                flags["config"] = str(data / "backoff.toml")
            brokers[name] = await stack.enter_async_context(open_broker(load_config(
                flags, env={})))
        ratios = []
        for pair in range(pairs):
            took = {}
            order = list(brokers.items())
            for name, b in order if pair % 2 == 0 else order[::-1]:
                await b.put("q", [b"x" * 64] * items)
                client = b.register(OpenReads(name))
                t0 = time.process_time()  # (CPU time: being descheduled does not count)
                for _ in range(items):
                    it = await b.get("q", client=client, open=True, open_timeout_ms=60_000)
                    assert it is not None
                    b.confirm(client, "q", ids=[it.id])
                took[name] = time.process_time() - t0
                print(f"pair {pair} {name:>7} backoff: {took[name] / items * 1e6:6.2f} us of "
                      "CPU per item (in process)", flush=True)
            ratios.append(took["without"] / took["with"])
        return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--in-process", action="store_true",
                    help="the loop on two brokers in this process, without sockets")
    args = ap.parse_args()
    if args.in_process:
        with tempfile.TemporaryDirectory(prefix="backoff-bench-") as tmp:
            ratios = trio.run(broker_rounds, Path(tmp), args.items, args.pairs)
        print(f"in process, without / with, CPU per item: median "
              f"{statistics.median(ratios):.3f} (>= 1.0: with costs no more; pairs "
              f"{', '.join(f'{r:.3f}' for r in ratios)})")
        return
    tmp = Path(tempfile.mkdtemp(prefix="backoff-bench-"))
    servers = {}
    try:
        for name, toml in (("without", None), ("with", BACKOFF)):
            extra: tuple[str, ...] = ()
            if toml is not None:
                (tmp / "backoff.toml").write_text(toml)
                extra = ("--config", str(tmp / "backoff.toml"))
            servers[name] = start_server(tmp / name, tmp / f"{name}.log", extra_args=extra)
        ratios, cpu_ratios = [], []
        for pair in range(args.pairs):
            rate, cpu_per = {}, {}
            # Alternate which runs first (ABBA): on a shared machine the load drifts.
            order = list(servers.items())
            for name, (proc, ports) in order if pair % 2 == 0 else order[::-1]:
                with Client(f"{HOST}:{ports['rpc']}") as c:
                    for start in range(0, args.items + 1, 10_000):
                        c.put("q", [b"x" * 64] * min(10_000, args.items + 1 - start))
                cpu0 = proc_cpu_s(proc.pid)
                took = loop(ports["memcache"], args.items)
                cpu = proc_cpu_s(proc.pid) - cpu0
                rate[name] = args.items / took
                cpu_per[name] = cpu / args.items
                print(f"pair {pair} {name:>7} backoff: {rate[name]:9,.0f} items/s, "
                      f"server CPU {cpu_per[name] * 1e6:6.1f} us/item", flush=True)
            ratios.append(rate["with"] / rate["without"])
            # (nan when a run was too short for the CPU clock's 10 ms ticks to see it)
            cpu_ratios.append(cpu_per["without"] / cpu_per["with"]
                              if cpu_per["with"] and cpu_per["without"] else math.nan)
        print(f"with / without, items/s: median {statistics.median(ratios):.3f} "
              f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
        seen = [r for r in cpu_ratios if not math.isnan(r)]  # (nan: too short to see)
        print(f"without / with, server CPU per item: median "
              f"{statistics.median(seen) if seen else math.nan:.3f} (>= 1.0: with costs no "
              f"more; pairs "
              f"{', '.join(f'{r:.3f}' for r in cpu_ratios)})")
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from benchlib import recording

    with recording("backoff_bench"):
        main()
