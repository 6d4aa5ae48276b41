#!/usr/bin/env python3
"""RPC benchmark: batch put and get+confirm on the MessagePack-RPC port, through queued.client.

Prints numbers, never asserts. For each fsync policy the bench starts a fresh server
(temp data dir, every port 0; the rpc port is read from the server's log line), stops it
by PID (SIGTERM, then SIGKILL) and removes the dir. Client load comes from worker OS
processes (spawned once per server), each with its own blocking `Client`, so 4
connections are 4 processes; they all use the cell's one queue.

Per cell (item size x batch x connections), each worker:

* put: `c.put(q, [item] * batch)` in a loop for `--seconds`;
* get+confirm: `c.get(q, batch, 0, 30000)` then `c.confirm(items)` (reliable read) in a
  loop on the items just put, until `--seconds` pass or the queue is empty;
* get (batch 100 only, after a refill put that is not reported): plain
  `c.get(q, batch, 0, 0)` (removed at once, no confirm).

Latency is per batch (one put call; one get plus its confirm), measured in the worker.
A pipelined variant (64 B, batch 100, the most connections) runs `--tasks` concurrent
trio tasks per worker on one `AsyncClient` connection. Every loop is bounded by time
and by an item count; a worker that does not report in time ends the run for that
server.

`--tls` runs the servers with TLS on (a throwaway trustme CA; the clients verify it);
`--tls both` runs each fsync policy plaintext and then over TLS and prints the TLS /
plaintext ratio of every cell.

`--put-variants N` runs only puts of 64 B in batches of 100 over the most connections,
N rounds of each variant in turn on one server per policy (so each variant's runs are
seconds apart): plain (`idempotent=False`), idempotent (the client's default), and with
2 headers (a `traceparent` and a `tenant`) as one map for the put's items or a map of
its own per item (its own `traceparent`), plain and idempotent; then medians and the
ratio of each to plain.

Usage:  .venv/bin/python bench/rpc_bench.py [--quick] [--seconds S] [--tls [both]] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio
from benchlib import BenchCerts, bucket, percentiles, proc_cpu_s, recording, system_busy_s
from benchlib import QueuedServer as Server  # `queued serve` on a temp dir, stopped by PID

import queued
from queued.client import AsyncClient, Client, Item

REPO = Path(__file__).resolve().parent.parent
IDEMPOTENT_ENV = "QUEUED_BENCH_IDEMPOTENT"
HOST = "127.0.0.1"
KiB = 1 << 10
MiB = 1 << 20
MB = 1_000_000
NS = 1_000_000_000
SIZE_NAMES = {64: "64 B", 1 * KiB: "1 KiB"}
TARGET = 500_000  # items/s: put, and get+confirm, each, 64 B, batch 100, fsync always
AUTO_ABORT_MS = 30_000
READ_TIMEOUT = 30.0  # s, the workers' clients
REPORT_GRACE = 60.0  # s a worker may take past its phase's --seconds to report
IDLE_LIMIT = 600.0  # s a worker waits for its next task before it gives up


def log(msg: str = "") -> None:
    print(msg, flush=True)


def size_name(size: int) -> str:
    return SIZE_NAMES.get(size, f"{size} B")


# -- latency histograms ----------------------------------------------------------------------
# Keys are latencies in ns rounded down to 8 significant bits (< 0.8 % error); values are
# counts: small enough to send back from the workers, and mergeable.


# -- the worker processes --------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    op: str  # "put", "get_confirm" or "get"
    queue: str
    size: int
    batch: int
    seconds: float
    max_items: int  # this worker's share of the phase's item bound
    tasks: int = 0  # > 0: an AsyncClient with this many concurrent tasks on one connection
    idempotent: bool | None = None  # put: the client's idempotent puts (None: as set up)
    headers: str = ""  # put: "" none, "put" 2 headers for all items, "item" 2 per item


@dataclass
class Part:
    """One worker's share of a phase."""

    items: int = 0
    calls: int = 0  # batches: put calls, or get (+ confirm) rounds that returned items
    t0: int = 0  # time.monotonic_ns(): comparable between processes on Linux
    t1: int = 0
    cpu: float = 0.0
    hist: dict[int, int] = field(default_factory=dict)
    empty: bool = False  # a get found the queue empty
    bad: int = 0  # puts not all stored, confirms not all counted, items of the wrong size
    error: str = ""

    def record(self, ns: int) -> None:
        k = bucket(ns)
        self.hist[k] = self.hist.get(k, 0) + 1


def run_blocking(c: Client, t: Task, p: Part) -> None:
    clock = time.monotonic_ns
    p.t0 = clock()
    deadline = p.t0 + int(t.seconds * NS)
    try:
        if t.op == "put":
            payload = [b"x" * t.size] * t.batch
            if t.idempotent is not None:
                c.idempotent = t.idempotent
            while p.items < t.max_items and clock() < deadline:
                s = clock()
                n = c.put(t.queue, payload, headers=bench_headers(t.headers, t.batch, p.calls))
                p.record(clock() - s)
                p.calls += 1
                p.items += n
                p.bad += t.batch - n
        else:
            abort_ms = AUTO_ABORT_MS if t.op == "get_confirm" else 0
            while p.items < t.max_items and clock() < deadline:
                s = clock()
                items = c.get(t.queue, t.batch, 0, abort_ms)
                if not items:
                    p.empty = True
                    break
                if abort_ms:
                    p.bad += len(items) - c.confirm(items)
                p.record(clock() - s)
                p.calls += 1
                p.items += len(items)
                p.bad += len(items[0].data) != t.size
    finally:
        p.t1 = clock()


def bench_headers(how: str, batch: int, call: int) -> Any:
    """A put's headers: none, 2 for all its items, or 2 per item (its own traceparent)."""
    if not how:
        return None
    if how == "put":
        return {"traceparent": f"00-{call:032x}-{call:016x}-01", "tenant": "acme"}
    return [{"traceparent": f"00-{call:024x}{k:08x}-{k:016x}-01", "tenant": "acme"}
            for k in range(batch)]


def client_options(ca: str | None) -> dict[str, Any]:
    """The clients' TLS argument: verify the bench's CA (a context does not pickle, so each
    process makes its own from the file); and idempotent puts on or off (--idempotent,
    through the environment, which the workers inherit)."""
    opts: dict[str, Any] = {"idempotent": os.environ.get(IDEMPOTENT_ENV, "on") == "on"}
    if ca:
        opts["tls"] = ssl.create_default_context(cafile=ca)
    return opts


async def run_async(address: str, ca: str | None, t: Task, p: Part) -> None:
    clock = time.monotonic_ns
    p.t0 = clock()
    deadline = p.t0 + int(t.seconds * NS)
    abort_ms = AUTO_ABORT_MS if t.op == "get_confirm" else 0
    payload = [b"x" * t.size] * t.batch

    async def one(c: AsyncClient) -> None:
        while p.items < t.max_items and clock() < deadline and not p.empty:
            s = clock()
            if t.op == "put":
                n = await c.put(t.queue, payload)
                p.bad += t.batch - n
            else:
                items: list[Item] = await c.get(t.queue, t.batch, 0, abort_ms)
                if not items:
                    p.empty = True
                    return
                if abort_ms:
                    p.bad += len(items) - await c.confirm(items)
                n = len(items)
                p.bad += len(items[0].data) != t.size
            p.record(clock() - s)
            p.calls += 1
            p.items += n

    try:
        async with AsyncClient(address, read_timeout=READ_TIMEOUT, **client_options(ca)) as c, \
                trio.open_nursery() as nursery:
            for _ in range(t.tasks):
                nursery.start_soon(one, c)
    finally:
        p.t1 = clock()


def worker_main(address: str, ca: str | None,
                pipe: multiprocessing.connection.Connection) -> None:
    client: Client | None = None
    try:
        client = Client(address, read_timeout=READ_TIMEOUT, **client_options(ca))
        client.version()  # connect now, not inside the first timed call
        pipe.send({"ready": True})
        while pipe.poll(IDLE_LIMIT):
            task = pipe.recv()
            if task is None:
                return
            part = Part()
            cpu0 = time.process_time()
            try:
                if task.tasks:
                    trio.run(run_async, address, ca, task, part)
                else:
                    if client is None:
                        client = Client(address, read_timeout=READ_TIMEOUT, **client_options(ca))
                    run_blocking(client, task, part)
            except Exception as exc:  # report it; a fresh client for the next task
                part.error = f"{exc!r}"
                if client is not None:
                    client.close()
                client = None
            part.cpu = time.process_time() - cpu0
            pipe.send(asdict(part))
    except BaseException as exc:  # never leave the parent waiting without a word
        with contextlib.suppress(Exception):
            pipe.send({"error": f"{exc!r}\n{traceback.format_exc()}"})
    finally:
        if client is not None:
            client.close()


class WorkerStuck(Exception):
    pass


class Workers:
    """`n` spawned worker processes, each with its own connection to the server."""

    def __init__(self, address: str, ca: str | None, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[tuple[Any, multiprocessing.connection.Connection]] = []
        try:
            for _ in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(address, ca, child), daemon=True)
                p.start()
                child.close()
                self.procs.append((p, parent))
            for _, pipe in self.procs:
                if not pipe.poll(60):
                    raise WorkerStuck("a worker process did not connect within 60 s")
                msg = pipe.recv()
                if "error" in msg:
                    raise WorkerStuck(f"a worker process failed to start: {msg['error']}")
        except BaseException:
            self.close()
            raise

    def run(self, tasks: list[Task]) -> list[Part]:
        """Tasks go to workers 0..len-1 at once; their parts come back in the same order."""
        assert len(tasks) <= len(self.procs)
        for (_, pipe), task in zip(self.procs, tasks, strict=False):
            pipe.send(task)
        deadline = time.monotonic() + max(t.seconds for t in tasks) + REPORT_GRACE
        parts: list[Part] = []
        for _, pipe in self.procs[: len(tasks)]:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise WorkerStuck("a worker did not report before the deadline")
            msg = pipe.recv()
            if "error" in msg and "items" not in msg:
                raise WorkerStuck(f"a worker process died: {msg['error']}")
            parts.append(Part(**msg))
        return parts

    def close(self) -> None:
        for _, pipe in self.procs:
            with contextlib.suppress(OSError, ValueError):
                pipe.send(None)
        for p, pipe in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
            pipe.close()
        self.procs = []


# -- phases and cells ------------------------------------------------------------------------


@dataclass
class Row:
    fsync: str
    size: int
    batch: int
    conns: int
    op: str
    items: int
    seconds: float
    items_per_s: float
    mb_per_s: float  # payload bytes, 10^6
    p50_ms: float
    p99_ms: float
    batches: int
    server_cpu: float  # fraction of one core
    client_cpu: float
    other_cpu: float  # everything else on the machine meanwhile
    note: str = ""
    errors: list[str] = field(default_factory=list)
    tls: bool = False
    server_us: float = 0.0  # server CPU per item, microseconds
    client_us: float = 0.0  # the clients' CPU per item, microseconds


def run_phase(server: Server, workers: Workers, fsync: str, op: str, label: str, size: int,
              batch: int, conns: int, seconds: float, max_items: int, tasks: int = 0,
              idempotent: bool | None = None, headers: str = "") -> Row:
    share = max(batch, max_items // conns)
    jobs = [Task(op, queue_name(size, batch, conns, tasks), size, batch, seconds, share, tasks,
                 idempotent, headers)
            for _ in range(conns)]
    cpu0, busy0, w0 = proc_cpu_s(server.pid), system_busy_s(), time.monotonic()
    parts = workers.run(jobs)
    cpu1, busy1, wall = proc_cpu_s(server.pid), system_busy_s(), time.monotonic() - w0
    items = sum(p.items for p in parts)
    t0 = min(p.t0 for p in parts)
    t1 = max(p.t1 for p in parts)
    secs = max(1e-9, (t1 - t0) / NS)
    hist: dict[int, int] = {}
    for p in parts:
        for k, v in p.hist.items():
            hist[k] = hist.get(k, 0) + v
    p50, p99 = percentiles(hist, (50, 99))
    client_cpu = sum(p.cpu for p in parts)
    srv = cpu1 - cpu0
    other = max(0.0, (busy1 - busy0) - srv - client_cpu)
    notes = []
    if op != "put" and any(p.empty for p in parts):
        notes.append(f"queue emptied after {secs:.2f} s")
    if items >= max_items and op == "put":
        notes.append("item bound reached")
    bad = sum(p.bad for p in parts)
    if bad:
        notes.append(f"{bad} not stored/confirmed/of wrong size")
    errors = [p.error for p in parts if p.error]
    if errors:
        notes.append(f"{len(errors)} worker error(s)")
        if any("got 7" in e for e in errors):
            notes.append("a server older than idempotent puts: run with --idempotent off")
    return Row(fsync, size, batch, conns, label, items, secs, items / secs,
               items * size / secs / MB, p50, p99, sum(p.calls for p in parts),
               srv / wall, client_cpu / wall, other / wall, "; ".join(notes), errors,
               server.certs is not None, srv / max(items, 1) * 1e6,
               client_cpu / max(items, 1) * 1e6)


#: --put-variants: (label, idempotent, headers) in the order each round runs them
PUT_VARIANTS = [("put plain", False, ""), ("put idempotent", True, ""),
                ("put plain, 2 headers per put", False, "put"),
                ("put idempotent, 2 headers per put", True, "put"),
                ("put idempotent, 2 headers per item", True, "item")]


def queue_name(size: int, batch: int, conns: int, tasks: int) -> str:
    return f"rpcbench_{size}_{batch}_{conns}" + (f"_p{tasks}" if tasks else "")


def print_row(r: Row) -> None:
    tls = " tls" if r.tls else ""
    log(f"  {r.fsync:6s}{tls} {size_name(r.size):>6s} batch {r.batch:4d} x{r.conns} "
        f"{r.op:26s} {r.items_per_s:11,.0f} items/s {r.mb_per_s:8.1f} MB/s "
        f"p50 {r.p50_ms:7.2f} ms p99 {r.p99_ms:7.2f} ms  srv {r.server_cpu:4.0%} "
        f"cli {r.client_cpu:4.0%} other {r.other_cpu:4.0%}  cpu/item srv "
        f"{r.server_us:.2f} us cli {r.client_us:.2f} us  ({r.items:,} items, "
        f"{r.seconds:.2f} s){'  ' + r.note if r.note else ''}")
    for e in r.errors[:3]:
        log(f"    !! {e}")


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rows: list[Row] = []
        self.memory: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []

    def cap(self, size: int) -> int:
        cap: int = min(self.a.max_items, self.a.max_bytes // size)
        return max(1, cap)

    def add(self, r: Row) -> None:
        print_row(r)
        self.rows.append(r)

    def server_run(self, fsync: str, certs: BenchCerts | None) -> None:
        a = self.a
        server = Server(a.dir, fsync, certs=certs, tree=a.queued_tree)
        ca = certs.ca if certs is not None else None
        workers: Workers | None = None
        over = " over TLS" if certs is not None else ""
        try:
            server.start()
            log(f"## fsync {fsync}{over}: server pid {server.pid}, "
                f"rpc port {server.ports['rpc']}")
            workers = Workers(server.address, ca, max(a.conns))
            with Client(server.address, read_timeout=READ_TIMEOUT,
                        **client_options(ca)) as control:
                for size in a.sizes:
                    for batch in a.batches:
                        for conns in a.conns:
                            self.cell(server, workers, control, fsync, size, batch, conns)
                if 64 in a.sizes and a.tasks > 0:
                    self.cell(server, workers, control, fsync, 64, 100, max(a.conns),
                              tasks=a.tasks)
            self.memory[fsync + over] = server.memory_kib()
            mem = self.memory[fsync + over]
            log(f"  server memory: VmHWM {mem.get('VmHWM', 0) / KiB:.0f} MiB, "
                f"VmRSS {mem.get('VmRSS', 0) / KiB:.0f} MiB")
        except Exception as exc:  # report, go on with the next policy
            log(f"!! fsync {fsync}{over} run failed: {exc!r}")
            traceback.print_exc(file=sys.stdout)
            self.failures.append(f"fsync {fsync}{over}: {exc!r}")
            if server.proc is not None and not server.alive():
                log(f"server exited with {server.proc.poll()}; log tail:\n{server.log_tail()}")
            if server.proc is not None and server.alive():
                self.memory.setdefault(fsync + over, server.memory_kib())
        finally:
            if workers is not None:
                workers.close()
            server.stop()
        log()

    def paired_run(self, fsync: str, certs: BenchCerts) -> None:
        """`--pairs N`: a plaintext and a TLS server side by side, each cell measured N times
        on each, alternately (plaintext first, then TLS first, ...): the two sides of a
        ratio are seconds apart, not minutes, on a machine whose load comes and goes."""
        a = self.a
        sides = [Server(a.dir, fsync, tree=a.queued_tree),
                 Server(a.dir, fsync, certs=certs, tree=a.queued_tree)]
        pools: list[Workers] = []
        try:
            with contextlib.ExitStack() as stack:
                controls = []
                for server in sides:
                    server.start()
                    ca = certs.ca if server.certs is not None else None
                    log(f"## fsync {fsync}{' over TLS' if ca else ''}: server pid "
                        f"{server.pid}, rpc port {server.ports['rpc']}")
                    pools.append(Workers(server.address, ca, max(a.conns)))
                    controls.append(stack.enter_context(
                        Client(server.address, read_timeout=READ_TIMEOUT, **client_options(ca))))
                for size in a.sizes:
                    for batch in a.batches:
                        for conns in a.conns:
                            for i in range(a.pairs):
                                order = (0, 1) if i % 2 == 0 else (1, 0)
                                for k in order:
                                    self.cell(sides[k], pools[k], controls[k], fsync, size,
                                              batch, conns)
            for server in sides:
                over = " over TLS" if server.certs is not None else ""
                self.memory[fsync + over] = server.memory_kib()
        except Exception as exc:  # report, go on with the next policy
            log(f"!! fsync {fsync} paired run failed: {exc!r}")
            traceback.print_exc(file=sys.stdout)
            self.failures.append(f"fsync {fsync} paired: {exc!r}")
        finally:
            for pool in pools:
                pool.close()
            for server in sides:
                server.stop()
        log()

    def cell(self, server: Server, workers: Workers, control: Client, fsync: str, size: int,
             batch: int, conns: int, tasks: int = 0) -> None:
        a = self.a
        q = queue_name(size, batch, conns, tasks)
        cap = self.cap(size)
        suffix = f" pipelined x{tasks}" if tasks else ""
        try:
            self.add(run_phase(server, workers, fsync, "put", "put" + suffix, size, batch,
                               conns, a.seconds, cap, tasks))
            self.add(run_phase(server, workers, fsync, "get_confirm", "get+confirm" + suffix,
                               size, batch, conns, a.seconds, cap, tasks))
            if batch == a.plain_get_batch and not tasks:
                control.flush(q)
                refill = run_phase(server, workers, fsync, "put", "put (refill)", size, batch,
                                   conns, a.seconds, cap)
                log(f"  (refill for the plain get: {refill.items:,} items, "
                    f"{refill.items_per_s:,.0f} items/s)")
                self.add(run_phase(server, workers, fsync, "get", "get (no confirm)" + suffix,
                                   size, batch, conns, a.seconds, cap))
        finally:
            if server.alive():
                control.flush(q)
                control.delete(q)

    def variants_run(self, fsync: str) -> None:
        """`--put-variants N`: the put variants in turn, N rounds, on one server."""
        a = self.a
        server = Server(a.dir, fsync, tree=a.queued_tree)
        workers: Workers | None = None
        conns = max(a.conns)
        try:
            server.start()
            log(f"## fsync {fsync}: put variants, server pid {server.pid}, rpc port "
                f"{server.ports['rpc']}")
            workers = Workers(server.address, None, conns)
            with Client(server.address, read_timeout=READ_TIMEOUT) as control:
                for _ in range(a.put_variants):
                    for label, idempotent, headers in PUT_VARIANTS:
                        self.add(run_phase(server, workers, fsync, "put", label, 64, 100,
                                           conns, a.seconds, self.cap(64),
                                           idempotent=idempotent, headers=headers))
                        control.flush(queue_name(64, 100, conns, 0))
        finally:
            if workers is not None:
                workers.close()
            server.stop()
        base = [r for r in self.rows if r.fsync == fsync and r.op == PUT_VARIANTS[0][0]]
        log(f"### fsync {fsync}: medians of {a.put_variants} rounds (64 B, batch 100, "
            f"{conns} connections)")
        plain = statistics.median(r.items_per_s for r in base) if base else 0.0
        for label, _, _ in PUT_VARIANTS:
            rs = [r for r in self.rows if r.fsync == fsync and r.op == label]
            if not rs:
                continue
            rate = statistics.median(r.items_per_s for r in rs)
            log(f"  {label:32s} {rate:11,.0f} items/s ({rate / plain:.2f}x plain; runs "
                f"{', '.join(f'{r.items_per_s:,.0f}' for r in rs)}), server "
                f"{statistics.median(r.server_us for r in rs):.2f} us/item, clients "
                f"{statistics.median(r.client_us for r in rs):.2f} us/item")
        log()

    # -- the report ------------------------------------------------------------------------

    def find(self, fsync: str, size: int, batch: int, conns: int, op: str,
             tls: bool | None = None) -> Row | None:
        """The row of that cell; plaintext first when `tls` is None (either will do)."""
        for want in ((False, True) if tls is None else (tls,)):
            for r in self.rows:
                if (r.fsync, r.size, r.batch, r.conns, r.op, r.tls) == (
                        fsync, size, batch, conns, op, want):
                    return r
        return None

    def tls_ratios(self) -> list[dict[str, Any]]:
        """Each cell measured both ways: TLS items/s over plaintext items/s. A cell measured
        several times (`--pairs`) gives medians, and the median of its pairs' ratios."""
        groups: dict[tuple[Any, ...], dict[bool, list[Row]]] = {}
        for r in self.rows:
            key = (r.fsync, r.size, r.batch, r.conns, r.op)
            groups.setdefault(key, {False: [], True: []})[r.tls].append(r)
        out = []
        for (fsync, size, batch, conns, op), by in groups.items():
            pairs = [(p, t) for p, t in zip(by[False], by[True], strict=False)
                     if p.items_per_s > 0]
            if not pairs:
                continue
            med = statistics.median
            out.append({"fsync": fsync, "size": size, "batch": batch, "conns": conns,
                        "op": op, "pairs": len(pairs),
                        "plain": med(p.items_per_s for p, _ in pairs),
                        "tls": med(t.items_per_s for _, t in pairs),
                        "ratio": med(t.items_per_s / p.items_per_s for p, t in pairs),
                        "pair_ratios": [t.items_per_s / p.items_per_s for p, t in pairs],
                        "plain_server_us": med(p.server_us for p, _ in pairs),
                        "tls_server_us": med(t.server_us for _, t in pairs),
                        "plain_client_us": med(p.client_us for p, _ in pairs),
                        "tls_client_us": med(t.client_us for _, t in pairs)})
        return out

    def headline(self) -> list[dict[str, str]]:
        out = []
        # (get+confirm's goal was once "the same order" as puts, 50,000 items/s; the
        # one-pass request path asks for 500,000 of each)
        for op, need, target in (
            ("put", TARGET, f">= {TARGET:,} items/s"),
            ("get+confirm", TARGET, f">= {TARGET:,} items/s"),
        ):
            for conns in sorted({max(self.a.conns), 1}, reverse=True):
                figure = f"{op}, 64 B, batch 100, fsync always, {conns} conn(s)"
                r = self.find("always", 64, 100, conns, op)
                if r is not None and r.tls:
                    figure += " over TLS"
                if r is None:
                    out.append({"figure": figure, "measured": "not measured",
                                "target": target, "met": "-"})
                    continue
                met = "met" if r.items_per_s >= need else "not met"
                out.append({"figure": figure,
                            "measured": f"{r.items_per_s:,.0f} items/s "
                                        f"({r.items_per_s / TARGET:.2f} x {TARGET:,}), "
                                        f"p99 {r.p99_ms:.2f} ms",
                            "target": target, "met": met})
        for r in self.rows:
            if "pipelined" in r.op and r.fsync == "always":
                out.append({"figure": f"{r.op}, 64 B, batch 100, fsync always, {r.conns} "
                                      "conn(s) (for comparison)",
                            "measured": f"{r.items_per_s:,.0f} items/s "
                                        f"({r.items_per_s / TARGET:.2f} x {TARGET:,}), "
                                        f"p99 {r.p99_ms:.2f} ms",
                            "target": "-", "met": "-"})
        return out

    def report(self, started: float) -> dict[str, Any]:
        log("## results (latency per batch: one put call; one get plus its confirm)")
        log()
        log("| fsync | tls | size | batch | conns | op | items/s | MB/s | p50 ms | p99 ms | "
            "server CPU | clients CPU | other CPU | server us/item | clients us/item | note |")
        log("|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in self.rows:
            log(f"| {r.fsync} | {'yes' if r.tls else 'no'} | {size_name(r.size)} | {r.batch} | "
                f"{r.conns} | {r.op} | "
                f"{r.items_per_s:,.0f} | {r.mb_per_s:,.1f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | "
                f"{r.server_cpu:.0%} | {r.client_cpu:.0%} | {r.other_cpu:.0%} | "
                f"{r.server_us:.2f} | {r.client_us:.2f} | {r.note} |")
        log()
        for fsync, mem in self.memory.items():
            log(f"server fsync {fsync}: VmHWM (peak RSS) {mem.get('VmHWM', 0) / KiB:.0f} MiB, "
                f"VmRSS at the end {mem.get('VmRSS', 0) / KiB:.0f} MiB")
        log()
        ratios = self.tls_ratios()
        if ratios:
            log("## TLS / plaintext (items/s of the same cell; the issue wants >= 0.8 for "
                "batch 100)")
            log()
            log("(with --pairs: medians over the pairs; ratio = the median pair's)")
            log()
            log("| fsync | size | batch | conns | op | plaintext | TLS | ratio | pairs' ratios | "
                "server us/item plain / TLS | clients us/item plain / TLS |")
            log("|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|")
            for t in ratios:
                log(f"| {t['fsync']} | {size_name(t['size'])} | {t['batch']} | {t['conns']} | "
                    f"{t['op']} | {t['plain']:,.0f} | {t['tls']:,.0f} | {t['ratio']:.2f} | "
                    f"{' '.join(f'{x:.2f}' for x in t['pair_ratios'])} | "
                    f"{t['plain_server_us']:.2f} / {t['tls_server_us']:.2f} | "
                    f"{t['plain_client_us']:.2f} / {t['tls_client_us']:.2f} |")
            log()
        head = self.headline()
        log("## headline (the issue's target, on this machine)")
        log()
        log("| figure | measured | target | met? |")
        log("|---|---|---|---|")
        for h in head:
            log(f"| {h['figure']} | {h['measured']} | {h['target']} | {h['met']} |")
        log()
        total = time.perf_counter() - started
        log(f"total run time {total:.0f} s; CPUs {os.cpu_count()}; CPU% columns are of one "
            "core over the phase's wall time")
        for f in self.failures:
            log(f"!! {f}")
        return {"rows": [asdict(r) for r in self.rows], "tls_ratios": ratios,
                "server_memory_kib": self.memory,
                "headline": head, "failures": self.failures, "seconds": total,
                "environment": environment(),
                "queued_tree": str(self.a.queued_tree or ""),
                "tree_commit": tree_commit(self.a.queued_tree) if self.a.queued_tree else "",
                "tree_clients": bool(self.a.tree_clients)}


def environment() -> dict[str, Any]:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "queued"],
                           capture_output=True, text=True, check=False).stdout.strip()
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {"commit": commit + ("+dirty" if dirty else ""), "cpus": os.cpu_count(),
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg": load}


def tree_commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()


def ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        t = part.strip().lower()
        if not t:
            continue
        out.append(int(t[:-1]) * KiB if t.endswith("k") else int(t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 s per phase, 64 B, batches 100 and 1000 (~40 s)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="time bound per phase (default 3, --quick 1)")
    ap.add_argument("--fsync", default="always,never", help="policies (default always,never)")
    ap.add_argument("--sizes", default=None, help="item sizes (default 64,1k; --quick 64)")
    ap.add_argument("--batches", default=None,
                    help="batch sizes (default 1,10,100,1000; --quick 100,1000)")
    ap.add_argument("--conns", default="1,4",
                    help="connections = worker processes (default 1,4)")
    ap.add_argument("--tasks", type=int, default=4,
                    help="concurrent tasks per connection in the pipelined variant (default "
                         "4; 0 skips it)")
    ap.add_argument("--plain-get-batch", type=int, default=100,
                    help="batch size that also gets the plain get variant (default 100)")
    ap.add_argument("--max-items", type=int, default=3_000_000,
                    help="item bound per phase (default 3,000,000)")
    ap.add_argument("--max-bytes", type=int, default=1 << 30,
                    help="payload byte bound per phase (default 1 GiB)")
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="parent of the servers' temp data dirs (default the temp dir)")
    ap.add_argument("--tls", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                    help="servers with TLS on (--tls), or each fsync policy plaintext then "
                         "over TLS with their ratio (--tls both)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="with --tls both: a plaintext and a TLS server side by side, each "
                         "cell measured this many times on each, alternately (default 0: "
                         "one server after the other); the pipelined cell is skipped")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--queued-tree", type=Path, default=None,
                    help="run the server from this queued source tree (PYTHONPATH) with this "
                         "venv, e.g. another checkout for a before/after comparison (a tree "
                         "older than idempotent puts, 5803d6e, refuses the default client's "
                         "puts as BAD_PARAMS: give it --idempotent off)")
    ap.add_argument("--tree-clients", action="store_true",
                    help="with --queued-tree: the clients (worker processes) from that tree "
                         "too (the bench runs itself again with PYTHONPATH set to it)")
    ap.add_argument("--idempotent", choices=("on", "off"), default="on",
                    help="the clients' idempotent puts (producer id and sequence; default on, "
                         "as the client's default)")
    ap.add_argument("--put-variants", type=int, default=0, metavar="N",
                    help="only the put variants (plain, idempotent, with 2 headers; 64 B, batch "
                         "100, the most connections), N rounds alternated (default 0: off)")
    a = ap.parse_args()
    os.environ[IDEMPOTENT_ENV] = a.idempotent
    if a.queued_tree is not None:
        a.queued_tree = a.queued_tree.resolve()
        if not (a.queued_tree / "queued" / "__init__.py").is_file():
            ap.error(f"--queued-tree {a.queued_tree}: no queued package there")
        if a.tree_clients and Path(queued.__file__).resolve().parent.parent != a.queued_tree:
            env = dict(os.environ, PYTHONPATH=str(a.queued_tree))
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    elif a.tree_clients:
        ap.error("--tree-clients needs --queued-tree")
    if a.seconds is None:
        a.seconds = 1.0 if a.quick else 3.0
    a.sizes = ints(a.sizes if a.sizes is not None else ("64" if a.quick else "64,1k"))
    a.batches = ints(a.batches if a.batches is not None
                     else ("100,1000" if a.quick else "1,10,100,1000"))
    a.conns = ints(a.conns)
    policies = [p.strip() for p in a.fsync.split(",") if p.strip()]
    if not (a.sizes and a.batches and a.conns and policies) or a.seconds <= 0:
        ap.error("need sizes, batches, conns, fsync policies and seconds > 0")
    if min(a.batches) < 1 or max(a.batches) > 100_000 or min(a.conns) < 1:
        ap.error("batches must be 1..100000 (the server's rpc_max_batch), conns >= 1")

    env = environment()
    log(f"# rpc_bench: queued {env['commit']}, Python {env['python']}, kernel {env['kernel']}, "
        f"{env['cpus']} CPUs, load average {' '.join(env['loadavg'])}")
    log(f"# {a.seconds:g} s per phase; sizes {a.sizes}; batches {a.batches}; conns {a.conns}; "
        f"fsync {policies}; pipelined x{a.tasks}; TLS {a.tls}")
    if a.queued_tree is not None:
        log(f"# server{' and clients' if a.tree_clients else ''} from the tree {a.queued_tree} "
            f"(commit {tree_commit(a.queued_tree)})")
    log()
    started = time.perf_counter()
    bench = Bench(a)
    with tempfile.TemporaryDirectory(prefix="rpc-bench-certs-") as where:
        certs = BenchCerts(where) if a.tls != "off" else None
        modes = {"off": [None], "on": [certs], "both": [None, certs]}[a.tls]
        for fsync in policies:
            if a.put_variants:
                bench.variants_run(fsync)
                continue
            if a.pairs and certs is not None and a.tls == "both":
                bench.paired_run(fsync, certs)
                continue
            for mode in modes:
                bench.server_run(fsync, mode)
    result = bench.report(started)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.json}")


if __name__ == "__main__":
    with recording("rpc_bench"):
        main()
