"""What a retry_backoff costs a get+confirm loop that never fails: nothing, it should.

Starts two `queued serve` (fsync never, temp data dirs, 127.0.0.1 on free ports), one
with `retry_backoff = ["1s", "10s", "1m", "10m"]` on every queue and one without, fills
queue `q` of each, then runs the same loop on each in turn, --pairs times: a memcache
connection sending `get q/close/open` (confirm the last, open the next), one request at a
time. Prints items/s and server CPU (user + system) per item for each run, and the median
ratio of with / without (>= 1.0: no slower).

    python bench/backoff_bench.py [--items 20000] [--pairs 5]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchlib import proc_cpu_s
from fuzz_rss import HOST, start_server

from queued.client import Client

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="backoff-bench-"))
    servers = {}
    try:
        for name, toml in (("without", None), ("with", BACKOFF)):
            extra: tuple[str, ...] = ()
            if toml is not None:
                (tmp / "backoff.toml").write_text(toml)
                extra = ("--config", str(tmp / "backoff.toml"))
            servers[name] = start_server(tmp / name, tmp / f"{name}.log", extra_args=extra)
        ratios = []
        for pair in range(args.pairs):
            rate = {}
            for name, (proc, ports) in servers.items():
                with Client(f"{HOST}:{ports['rpc']}") as c:
                    for start in range(0, args.items + 1, 10_000):
                        c.put("q", [b"x" * 64] * min(10_000, args.items + 1 - start))
                cpu0 = proc_cpu_s(proc.pid)
                took = loop(ports["memcache"], args.items)
                cpu = proc_cpu_s(proc.pid) - cpu0
                rate[name] = args.items / took
                print(f"pair {pair} {name:>7} backoff: {rate[name]:9,.0f} items/s, "
                      f"server CPU {cpu / args.items * 1e6:6.1f} us/item")
            ratios.append(rate["with"] / rate["without"])
        print(f"with / without, items/s: median {statistics.median(ratios):.3f} "
              f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from benchlib import recording

    with recording("backoff_bench"):
        main()
