"""The Spark sink's throughput: df.write.format("queued") into a `queued serve` subprocess,
against the bare client doing the same puts without Spark (the ceiling).

    .venv/bin/python bench/spark_write_bench.py [--rows 400000] [--item 200]
        [--batch-size 5000] [--batch-bytes N] [--option key=value ...] [--fsync never]
        [--repeat 3] [--exactly-once] [--skip-spark] [--skip-bare] [--py-spy-server out.txt]

Prints numbers, never asserts. Spark runs local[2] (UI off) on 2 partitions of a cached
DataFrame of `--rows` rows of `--item` bytes, written with the `queue` option and with a
`queue` column (`--queues` queues). The first write (20k rows) starts the Python workers
and is reported apart, and so is the fixed cost of a job (a 10-row write). Each timed
phase prints rows/s, MB/s of item payload (MB = 10^6 B),
the server's CPU (utime+stime of its process, /proc) as seconds and as a share of one core,
the machine's busy CPU over the phase (2 cores = 200 %), and how many items the server
holds afterwards (a sanity check; every queue is flushed between phases).

Bare client phases (the ceiling, no Spark): `Client.put` in a loop of `--batch-size`
puts, each waiting for its reply, in one process and in two at once (as two Spark tasks).
The processes build their items and connect before the clock starts. The sink's
batch_size is set to `--batch-size` too.

`--exactly-once`: each Spark phase also with exactly-once puts (a new `idempotency_key`
per write), in turns with the at-least-once one, and the ratio of their medians.

The server is started with the default config (fsync "always") unless `--fsync` is given;
it is stopped by PID (SIGTERM, then SIGKILL) and its temp data dir removed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import QueuedServer as Server  # `queued serve` on a temp dir, stopped by PID
from benchlib import recording, spark_done, spark_session, system_busy_s


def stored_and_flush(address: str, queues: list[str]) -> int:
    from queued.client import Client

    with Client(address, read_timeout=60) as c:
        n = sum(c.peek(q).items for q in queues)
        for q in queues:
            c.flush(q)
    return n


def report(name: str, rows: int, item: int, dt: float, server_cpu: float, busy: float,
           stored: int) -> None:
    print(f"{name:42} {rows / dt:10,.0f} rows/s {rows * item / dt / 1e6:7.1f} MB/s  "
          f"{dt:6.2f} s  server cpu {server_cpu:5.2f} s ({100 * server_cpu / dt:3.0f} %)  "
          f"machine busy {100 * busy / dt:3.0f} %  stored {stored}", flush=True)


def measure(name: str, server: Server, rows: int, item: int, queues: list[str],
            run: Callable[[], None]) -> float:
    c0, b0, t0 = server.cpu_s(), system_busy_s(), time.perf_counter()
    run()
    dt = time.perf_counter() - t0
    c1, b1 = server.cpu_s(), system_busy_s()
    report(name, rows, item, dt, c1 - c0, b1 - b0, stored_and_flush(server.address, queues))
    return rows / dt


def summary(rates: list[float]) -> None:
    rates = sorted(rates)
    print(f"  median {rates[len(rates) // 2]:,.0f} rows/s, best {rates[-1]:,.0f}", flush=True)


def measure_quiet(run: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


# -- bare client -------------------------------------------------------------------------------


def items_for(first: int, n: int, item: int) -> list[bytes]:
    return [b"%012d" % i + b"x" * (item - 12) for i in range(first, first + n)]


def bare_sequential(address: str, queue: str, rows: int, item: int, batch: int,
                    ready: Any, go: Any) -> None:
    """Client.put in a loop, each waiting for its reply (what the sink does per task)."""
    from queued.client import Client

    batches = [items_for(i, min(batch, rows - i), item) for i in range(0, rows, batch)]
    with Client(address, read_timeout=60) as c:
        c.version()  # connected
        ready.set()
        go.wait(60)
        for items in batches:
            c.put(queue, items)


def in_processes(fn: Callable[..., None], procs: int, address: str, rows: int, item: int,
                 batch: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(prepare, run): `procs` processes, rows split between them, one queue each; prepare
    starts them and waits until each has built its items and connected, run lets them go
    and waits for all (so process start-up and item building are not timed)."""
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(procs)]
    share = rows // procs
    ps = [ctx.Process(target=fn, args=(address, f"bare{k}", share, item, batch, r, go))
          for k, r in enumerate(readies)]

    def prepare() -> None:
        for p in ps:
            p.start()
        for r in readies:
            if not r.wait(120):
                raise SystemExit("a bare client process did not get ready")

    def run() -> None:
        go.set()
        for p in ps:
            p.join(600)
            if p.exitcode is None:
                p.kill()
                p.join(10)
            if p.exitcode != 0:
                raise SystemExit(f"bare client process failed ({p.exitcode})")
    return prepare, run


def bench_bare(server: Server, a: argparse.Namespace) -> None:
    kinds: list[tuple[str, Callable[..., None]]] = [("Client.put loop", bare_sequential)]
    queues = ["bare0", "bare1"]
    for label, fn in kinds:
        for procs in (1, 2):
            rates = []
            for _ in range(a.repeat):
                prepare, run = in_processes(fn, procs, server.address, a.rows, a.item,
                                            a.batch_size)
                prepare()
                rates.append(measure(f"bare {label}, {procs} proc, batch {a.batch_size}",
                                     server, a.rows, a.item, queues, run))
            summary(rates)


# -- Spark ------------------------------------------------------------------------------------


def bench_spark(server: Server, a: argparse.Namespace) -> None:
    spark = spark_session()
    try:
        data = (f"cast(concat(lpad(cast(id as string), 12, '0'), repeat('y', {a.item - 12}))"
                " as binary) as data")
        plain = spark.range(a.rows, numPartitions=2).selectExpr(data)
        routed = spark.range(a.rows, numPartitions=2).selectExpr(
            f"concat('r', cast(id % {a.queues} as string)) as queue", data)
        for df in (plain, routed):
            df.cache().count()
        options = {"server": server.address, "batch_size": str(a.batch_size)}
        if a.batch_bytes:
            options["batch_bytes"] = str(a.batch_bytes)
        for kv in a.option:
            k, _, v = kv.partition("=")
            options[k] = v
        routed_queues = [f"r{k}" for k in range(a.queues)]

        def write(df: Any, queue: str | None, exactly_once: bool = False) -> Callable[[], None]:
            def run() -> None:
                w = df.write.format("queued").mode("append").options(**options)
                if queue:
                    w = w.option("queue", queue)
                if exactly_once:  # a new key each time: a repeated key stores nothing
                    w = w.option("idempotency_key", uuid.uuid4().hex)
                w.save()
            return run

        opts = " ".join(f"{k}={v}" for k, v in options.items() if k != "server")
        print(f"spark local[2], 2 partitions, {opts}", flush=True)
        # The first write starts the Python workers: timed apart from the rest.
        measure("spark, first write (cold), 20k rows", server, 20_000, a.item, ["w"],
                write(plain.limit(20_000), "w"))
        tiny = plain.limit(10)
        fixed = min(measure_quiet(write(tiny, "w")) for _ in range(3))
        stored_and_flush(server.address, ["w"])
        print(f"spark, a write of 10 rows (fixed cost of a job): {fixed:.3f} s", flush=True)
        modes = (False, True) if a.exactly_once else (False,)
        for label, df, queue, queues in (
                ("spark, option queue", plain, "w", ["w"]),
                (f"spark, queue column ({a.queues} queues)", routed, None, routed_queues)):
            rates: dict[bool, list[float]] = {m: [] for m in modes}
            for _ in range(a.repeat):  # on and off in turns, so that load drifts hit both
                for mode in modes:
                    name = label + (", exactly-once" if mode else "")
                    rates[mode].append(measure(name, server, a.rows, a.item, queues,
                                               write(df, queue, mode)))
            for mode in modes:
                print(label + (", exactly-once" if mode else ", at-least-once") + ":",
                      end="")
                summary(rates[mode])
            if a.exactly_once:
                med = {m: sorted(r)[len(r) // 2] for m, r in rates.items()}
                print(f"  exactly-once / at-least-once (medians): {med[True] / med[False]:.2f}",
                      flush=True)
    finally:
        spark_done(spark)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--item", type=int, default=200, help="bytes per item (>= 12)")
    ap.add_argument("--batch-size", type=int, default=5000)
    ap.add_argument("--batch-bytes", type=int, default=0, help="0 = the sink's default")
    ap.add_argument("--queues", type=int, default=4, help="queues of the queue column")
    ap.add_argument("--option", action="append", default=[], help="extra sink option k=v")
    ap.add_argument("--fsync", default=None, help="server --fsync (default: its default)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--exactly-once", action="store_true",
                    help="also time each Spark write with exactly-once puts (idempotency_key)")
    ap.add_argument("--skip-spark", action="store_true")
    ap.add_argument("--skip-bare", action="store_true")
    ap.add_argument("--py-spy-server", default=None,
                    help="record the server with py-spy during the run into this file")
    a = ap.parse_args()
    if a.item < 12:
        raise SystemExit("--item must be >= 12")
    root = Path(tempfile.mkdtemp(prefix="queued-spark-write-bench-"))
    spy: subprocess.Popen[bytes] | None = None
    server: Server | None = None
    try:
        server = Server(root, a.fsync or "always", stop_timeout=30)
        server.start()
        print(f"server pid {server.proc.pid} on {server.address}, "
              f"fsync {a.fsync or 'default (always)'}; {a.rows} rows of {a.item} B; "
              f"{os.cpu_count()} cpus", flush=True)
        if a.py_spy_server:
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw",
                 "-o", a.py_spy_server, "--pid", str(server.proc.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not a.skip_bare:
            bench_bare(server, a)
        if not a.skip_spark:
            bench_spark(server, a)
    finally:
        if spy is not None and spy.poll() is None:
            os.kill(spy.pid, signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(spy.pid, signal.SIGKILL)
                spy.wait(10)
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    with recording("spark_write_bench"):
        main()
