"""What a Prometheus scrape costs: /metrics latency and size, and the stall it causes.

Starts `queued serve` (fsync never, metrics_max_queues = --queues), creates `--queues`
queues with one item each, then:

1. scrapes /metrics `--scrapes` times in a row (text format, and gzipped as
   Prometheus asks for it) and prints latency percentiles and body sizes;
2. runs a ping loop (RPC `version` calls, one at a time) alone, then while a
   second thread scrapes back to back, and prints the ping latency of both: how
   much a scrape delays the queue traffic sharing the event loop.

Usage: python bench/metrics_bench.py [--queues 1000] [--scrapes 50] [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from typing import Any

from benchlib import QueuedServer, bucket, percentiles, recording

from queued.client import Client

PS = (50.0, 90.0, 99.0, 100.0)


def scrape(conn: http.client.HTTPConnection, gzip: bool) -> int:
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if gzip else {})
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise SystemExit(f"/metrics answered {resp.status}")
    return len(body)


def scrape_series(port: int, n: int, gzip: bool) -> dict[str, Any]:
    hist: dict[int, int] = {}
    size = 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            size = scrape(conn, gzip)
            b = bucket(time.perf_counter_ns() - t0)
            hist[b] = hist.get(b, 0) + 1
    finally:
        conn.close()
    p = percentiles(hist, PS)
    return {"gzip": gzip, "bytes": size,
            **{f"p{int(k)}_ms": round(v, 2) for k, v in zip(PS, p, strict=True)}}


def ping_series(rpc_port: int, seconds: float, scraper_port: int | None) -> dict[str, Any]:
    stop = threading.Event()
    scrapes = 0

    def scrape_loop() -> None:
        nonlocal scrapes
        assert scraper_port is not None
        conn = http.client.HTTPConnection("127.0.0.1", scraper_port, timeout=60)
        try:
            while not stop.is_set():
                scrape(conn, True)
                scrapes += 1
        finally:
            conn.close()

    thread = threading.Thread(target=scrape_loop) if scraper_port else None
    if thread:
        thread.start()
    hist: dict[int, int] = {}
    n = 0
    with Client([f"127.0.0.1:{rpc_port}"]) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter_ns()
            c.version()
            b = bucket(time.perf_counter_ns() - t0)
            hist[b] = hist.get(b, 0) + 1
            n += 1
    stop.set()
    if thread:
        thread.join(60)
    p = percentiles(hist, PS)
    return {"scraping": scraper_port is not None, "pings": n, "scrapes": scrapes,
            **{f"p{int(k)}_ms": round(v, 3) for k, v in zip(PS, p, strict=True)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queues", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", action="store_true", help="print one JSON document at the end")
    a = ap.parse_args()
    config = f"[server]\nmetrics_max_queues = {a.queues}\nmin_free_disk = 0\n"
    with QueuedServer(fsync="never", config=config) as server:
        ports = server.ports
        with Client([f"127.0.0.1:{ports['rpc']}"]) as c:
            for i in range(a.queues):
                c.put(f"q{i:05d}", [b"x" * 64])
        cpu0 = server.cpu_s()
        scrapes = [scrape_series(ports["http"], a.scrapes, gz) for gz in (False, True)]
        cpu = (server.cpu_s() - cpu0) / (2 * a.scrapes)
        pings = [ping_series(ports["rpc"], a.seconds, None),
                 ping_series(ports["rpc"], a.seconds, ports["http"])]
        rss = server.hwm_kib() or 0
    result = {"queues": a.queues, "scrapes": scrapes,
              "server_cpu_ms_per_scrape": round(cpu * 1000, 1), "pings": pings,
              "server_peak_rss_mib": round(rss / 1024, 1)}
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{a.queues} queues, {a.scrapes} scrapes each way; server CPU "
          f"{result['server_cpu_ms_per_scrape']} ms per scrape; peak RSS "
          f"{result['server_peak_rss_mib']} MiB")
    for s in scrapes:
        print(f"  /metrics {'gzip' if s['gzip'] else 'text'}: {s['bytes']:>9} bytes  "
              f"p50 {s['p50_ms']} ms  p90 {s['p90_ms']} ms  p99 {s['p99_ms']} ms  "
              f"max {s['p100_ms']} ms")
    for p in pings:
        what = f"while scraping ({p['scrapes']} scrapes)" if p["scraping"] else "alone"
        print(f"  RPC version ping {what}: {p['pings']} pings  p50 {p['p50_ms']} ms  "
              f"p99 {p['p99_ms']} ms  max {p['p100_ms']} ms")

if __name__ == "__main__":
    with recording("metrics_bench"):
        main()
