#!/usr/bin/env python3
"""Side-by-side benchmark: queued against darner (C++, Kestrel's memcache protocol).

Prints numbers, never asserts; what it prints and a JSON of every row are kept outside git
(bench/results/; see benchlib/results.py). The same load client
(bench/load.py: client OS processes driving non-blocking sockets under epoll, requests
pipelined, latency histograms) runs the same workloads against each target, started one
at a time on a fresh temp data dir and a free 127.0.0.1 port, stopped by PID afterwards:

* queued-never   (``queued serve --fsync never``; the fair match for darner)
* queued-always  (``--fsync always``, queued's default: group commit)
* queued-base-never, queued-base-always: the same, of another build given by --base-cmd
  (an earlier commit's venv, say), for before/after ratios in one run. Not in the default
  --targets.
* darner         (``darner -p PORT -d DIR``; no fsync unless ``set q/sync``)

Every (workload, payload, run) gets a fresh server, so each server's CPU seconds
(/proc/<pid>/stat, all threads) and peak RSS (VmHWM) belong to that workload alone. The
targets alternate within a workload (run r starts at target r mod the number of targets),
so drift on this shared machine hits every side of a ratio alike; the report gives medians
of --runs runs.

Workloads (payload 64 B and 1 KiB unless said; "C x P" = connections x requests in
flight per connection; every phase is bounded by an item count and by wall-clock time):

* drain: enqueue N items (4 x 8 ``set q 0 0 n``), then dequeue them all (4 x 8 ``get q``);
* steady: 4 x 8 producers and 4 x 8 consumers at once for --seconds (or N items each);
  put rate, get rate, the final backlog, and end-to-end latency: a put's payload starts
  with its send time (perf_counter_ns, CLOCK_MONOTONIC, shared by the client processes),
  read back by the consumer that gets it; a consumer's empty reply (a miss) waits
  --miss-backoff-ms before its next get; with --steady-rate R the producers offer R
  items/s together, paced from the start (unpaced, the faster server saturates and a
  backlog grows if its consumers answer a little slower than its producers);
* steady-lp: steady with consumers long-polling as Kestrel's do, ``get q/t=MS``
  (--long-poll-ms, 100): a poll that times out empty is a miss, polled again at once, and
  does not extend the get window (the rate is up to the last item got);
* fanin (64 B): 100 queues, each producer connection rotating over all of them (enqueue);
* fanin-lp (64 B): fanin's 4 x 8 producers and 4 x 8 long-polling consumers at once for
  --seconds; consumer connection i owns a share of the queues (queues 25i..25i+24,
  disjoint) and rotates its polls over them; put rate, get rate, backlog over the 100
  queues, end-to-end latency;
* fairness (64 B): one connection pipelines N sets into queue A (1024 in flight) while
  another, in the other client process, does single ``get B`` requests one at a time
  (B filled with N/2 items first, untimed) until the flood is done: the flood's items/s
  and the probe gets' p50/p99/max latency;
* reliable (64 B): enqueue N, then consumers chain ``get q/close/open`` (each get
  confirms the previous open read and opens the next; a last ``get q/close`` per
  connection, untimed, confirms the final one);
* big (64 KiB): enqueue then dequeue, 4 x 8;
* many: 64 connections x pipeline 1, enqueue then dequeue;
* latency: 1 connection x pipeline 1, enqueue then dequeue (p50/p99 per request).

Per target and run: items/s (first send to last reply of the phase), per-request latency
p50/p99 (send to reply parsed), the server's CPU seconds over the phase and items per
server CPU-second, the server's peak RSS, client and other processes' CPU. The report's
ratio table gives every queued target's items/s over darner's, always/never per build and
now/base per fsync mode. It also prints this machine's fdatasync latency (200 x 4 KiB
appended + os.fdatasync beside the data dirs, at the start and the end) and compares each
queued-*-always latency p50 with darner's p50 + one fdatasync p50.

``--memory`` runs only the memory workload (slow; once, not medians), queued fsync never
(``--memory-fsync``) and darner: (a) hold --memory-gb GiB of 64 KiB items with queued's
default config: idle RSS, peak RSS, RSS with the items held, after draining, data-dir size
(du) after the drain; (b) --memory-items 64 B items held, queued with max_memory_size big
enough to keep them all in memory: (RSS with items - idle RSS) / items = bytes per item.

Usage:
    .venv/bin/python bench/vs_darner.py --quick            # smoke run, < 3 minutes
    .venv/bin/python bench/vs_darner.py                    # full run, ~15 minutes
    .venv/bin/python bench/vs_darner.py --memory           # memory workload, ~5 minutes
    .venv/bin/python bench/vs_darner.py --memory --memory-cases b --targets queued-never
                                           # 64 B items' B/item, queued alone, ~1 minute
    .venv/bin/python bench/vs_darner.py --workloads drain,latency --runs 5
    .venv/bin/python bench/vs_darner.py --quick --workloads steady-lp,fanin-lp,fairness \
        --targets queued-never,queued-base-never,darner \
        --base-cmd "/path/to/old/.venv/bin/queued serve --data-dir {data_dir} --host 127.0.0.1 \
        --memcache-port {memcache_port} --text-port {text_port} --rpc-port {rpc_port} \
        --http-port {http_port} --fsync {fsync}"                # against an earlier build
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    DARNER,
    DARNER_BUILD,
    QUEUED_CMD,
    DarnerServer,
    MemcacheServer,
    QueuedServer,
    bucket,
    ensure_darner,
    hwm_kib,
    percentiles,
    recording,
    result_file,
    rss_kib,
    stop_all,
    system_busy_s,
    tree_commit,
)
from load import (
    NS,
    ConnSpec,
    GiB,
    KiB,
    MiB,
    Phase,
    RoleResult,
    log,
    run_conns,
    size_name,
    split,
)

# queued-base-*: another build of queued (--base-cmd), for before/after ratios in one run
TARGETS = ("queued-never", "queued-always", "queued-base-never", "queued-base-always",
           "darner")
DEFAULT_TARGETS = ("queued-never", "queued-always", "darner")
QUEUED_TARGETS = tuple(t for t in TARGETS if t != "darner")
SHORT = {"queued-never": "never", "queued-always": "always",
         "queued-base-never": "base never", "queued-base-always": "base always"}
# (numerator, denominator, label) of the ratio columns between queued targets
PAIRS = (("queued-always", "queued-never", "always/never"),
         ("queued-base-always", "queued-base-never", "base always/never"),
         ("queued-never", "queued-base-never", "now/base never"),
         ("queued-always", "queued-base-always", "now/base always"))
FANIN_QUEUES = 100
FLOOD_WINDOW = 1024  # fairness: sets in flight on the flooding connection
FDATASYNC_N = 200  # fdatasync probe: writes of 4 KiB, each followed by os.fdatasync
MEMORY_MAX = "4GiB"  # queued's max_memory_size for memory test (b): keep every item in RAM

# workload -> (payloads, items per phase: full run, --quick)
WORKLOADS: dict[str, tuple[tuple[int, ...], int, int]] = {
    "drain": ((64, 1 * KiB), 300_000, 20_000),
    "steady": ((64, 1 * KiB), 300_000, 30_000),  # bound by --seconds first
    "steady-lp": ((64, 1 * KiB), 300_000, 30_000),  # the same, consumers long-poll
    "fanin": ((64,), 100_000, 10_000),
    "fanin-lp": ((64,), 300_000, 30_000),  # bound by --seconds first
    "fairness": ((64,), 100_000, 20_000),  # the flood; B holds half of that
    "reliable": ((64,), 100_000, 10_000),
    "big": ((64 * KiB,), 10_000, 500),
    "many": ((64, 1 * KiB), 100_000, 5_000),
    "latency": ((64, 1 * KiB), 20_000, 1_000),
}

RSS_INTERVAL = 0.2  # s between the servers' VmRSS samples (the memory workload's phases)


def du_bytes(path: Path) -> int:
    """Disk usage of a tree, as `du` counts it (allocated blocks)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


# -- the queued tree under test -----------------------------------------------------------


@dataclass
class Tree:
    path: str | None
    commit: str  # short hash, "-dirty" appended if queued/ has uncommitted changes
    dirty_files: list[str]
    fingerprint: str  # sha1 of queued/**/*.py: tells whether the code changed mid-run


def queued_tree(cmd: str, cwd: Path) -> Path | None:
    """The source tree `cmd` runs: `[env VAR=x ...] <queued script or python> ...`; the
    package is imported with the script's interpreter and environment, from `cwd`."""
    toks = cmd.split()
    env = dict(os.environ)
    i = 0
    if toks and Path(toks[0]).name == "env":
        i = 1
        while i < len(toks) and "=" in toks[i] and not toks[i].startswith("-"):
            k, _, v = toks[i].partition("=")
            env[k] = v
            i += 1
    if i >= len(toks):
        return None
    exe = shutil.which(toks[i]) or toks[i]
    python = exe
    try:
        with open(exe, "rb") as f:
            first = f.readline()
        if first.startswith(b"#!"):
            python = first[2:].decode().split()[0]
    except OSError:
        return None
    code = ("import os, queued; "
            "print(os.path.dirname(os.path.dirname(os.path.abspath(queued.__file__))))")
    try:
        p = subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    out = p.stdout.strip()
    return Path(out) if p.returncode == 0 and out else None


def tree_state(path: Path | None) -> Tree:
    if path is None:
        return Tree(None, "unknown", [], "")
    h = hashlib.sha1()
    for f in sorted((path / "queued").rglob("*.py")):
        with contextlib.suppress(OSError):
            h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    commit, dirty = "unknown", []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        st = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", "queued"],
                            capture_output=True, text=True, timeout=10).stdout
        dirty = [line[3:] for line in st.splitlines() if line.strip()]
    return Tree(str(path), (commit or "unknown") + ("-dirty" if dirty else ""), dirty,
                h.hexdigest()[:12])


# -- results ------------------------------------------------------------------------------


@dataclass
class Row:
    target: str  # one of TARGETS
    workload: str
    payload: int
    op: str  # enqueue / dequeue / put / get / get/close/open
    run: int
    requested: int  # items the phase was to move
    items: int  # items moved (replies that were ok)
    errors: int
    misses: int  # empty gets
    seconds: float  # this op's first send to last reply
    items_per_s: float
    p50_ms: float
    p99_ms: float
    e2e_p50_ms: float | None  # steady only: put send -> get reply of the same item
    e2e_p99_ms: float | None
    server_cpu_s: float  # over the whole phase
    items_per_cpu_s: float  # items / server_cpu_s (steady: gets / CPU of puts + gets)
    client_cpu: float  # fraction of one core, over the phase
    other_cpu: float  # the rest of the machine, fraction of one core
    peak_rss_mib: float | None = None  # the server's VmHWM over the whole cell
    backlog: int | None = None  # items left in the queue after the phase
    code: str = ""  # queued source fingerprint at the server's start
    busy_before: float | None = None  # CPUs busy just before the cell (other users' work)
    notes: list[str] = field(default_factory=list)
    max_ms: float | None = None  # the slowest request (histogram bucket: < 0.8 % low)


def finite(x: float | None) -> float | None:
    return x if x is not None and not math.isnan(x) else None


def phase_row(target: str, workload: str, payload: int, op: str, run: int, role: str,
              ph: Phase, requested: int, cpu_items: int | None = None) -> Row:
    rr = ph.roles.get(role) or RoleResult()
    window = (rr.last_ns - rr.first_ns) / NS if rr.last_ns > rr.first_ns else ph.seconds
    p50, p99, pmax = percentiles(rr.hist, (50, 99, 100))
    e50: float | None = None
    e99: float | None = None
    if rr.e2e:
        e50, e99 = percentiles(rr.e2e, (50, 99))
    n = rr.ok if cpu_items is None else cpu_items
    notes = list(ph.errors)
    if rr.errors:
        notes.append(f"{rr.errors} error replies")
    if rr.unanswered:
        notes.append(f"{rr.unanswered} requests unanswered at the deadline")
    if rr.ok < requested:
        notes.append(f"{rr.ok:,} of {requested:,} items (time bound or server gave up)")
    return Row(target, workload, payload, op, run, requested, rr.ok, rr.errors, rr.misses,
               window, rr.ok / window if window > 0 else 0.0, p50, p99, e50, e99,
               ph.server_cpu, n / ph.server_cpu if ph.server_cpu > 0 else float("nan"),
               ph.client_cpu / ph.seconds, ph.other_cpu / ph.seconds, notes=notes,
               max_ms=pmax)


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(vals) if vals else None


# -- the workloads -------------------------------------------------------------------------


@dataclass
class Ctx:
    """One workload on one freshly started target."""

    a: argparse.Namespace
    target: str
    server: MemcacheServer
    workload: str
    payload: int
    run: int
    items: int

    def opts(self, conns: int, pipeline: int, procs: int | None = None) -> argparse.Namespace:
        ns = argparse.Namespace(**vars(self.a))
        ns.conns, ns.pipeline = conns, pipeline
        if procs is not None:
            ns.procs = procs
        return ns

    def row(self, op: str, role: str, ph: Phase, requested: int,
            cpu_items: int | None = None) -> Row:
        return phase_row(self.target, self.workload, self.payload, op, self.run, role, ph,
                         requested, cpu_items)

    def phase(self, role: str, count: int, conns: int = 4, pipeline: int = 8,
              queue: str = "q", procs: int | None = None, seconds: float | None = None,
              **kw: Any) -> Phase:
        specs = [ConnSpec(role, n) for n in split(count, conns)]
        return run_conns(self.server, queue, self.payload, specs,
                         self.opts(conns, pipeline, procs), seconds or self.a.timeout,
                         fill=self.a.fill, **kw)

    def drain(self, conns: int = 4, pipeline: int = 8, procs: int | None = None) -> list[Row]:
        put = self.phase("put", self.items, conns, pipeline, procs=procs)
        stored = put.roles["put"].ok if "put" in put.roles else 0
        rows = [self.row("enqueue", "put", put, self.items)]
        get = self.phase("get", stored, conns, pipeline, procs=procs)
        rows.append(self.row("dequeue", "get", get, stored))
        rows[-1].backlog = self.server.backlog("q")
        if rows[-1].backlog:
            rows[-1].notes.append(f"{rows[-1].backlog:,} items left after the drain")
        return rows


#: (connections, requests in flight on each) of the workloads whose clients put: many
#: and latency their own, the others load.py's 4 x 8 (`Ctx.phase`, `Ctx.drain`, fan-in)
SHAPES: dict[str, tuple[int, int]] = {"drain": (4, 8), "big": (4, 8), "reliable": (4, 8),
                                      "fanin": (4, 8), "many": (64, 1), "latency": (1, 1)}


def w_drain(c: Ctx) -> list[Row]:
    return c.drain()


def w_big(c: Ctx) -> list[Row]:
    return c.drain()


def w_many(c: Ctx) -> list[Row]:
    return c.drain(*SHAPES["many"])


def w_latency(c: Ctx) -> list[Row]:
    return c.drain(*SHAPES["latency"], procs=1)


def mixed(c: Ctx, specs: list[ConnSpec], queues: list[str], long_poll_ms: int = 0
          ) -> list[Row]:
    """Producers and consumers (`specs`, 8 in flight each) at once for --seconds (or their
    quotas): put and get rows, end-to-end latency (stamped puts), the backlog over
    `queues` afterwards; server CPU per item got."""
    ph = run_conns(c.server, queues[0], c.payload, specs, c.opts(4, 8), c.a.seconds,
                   stamp=True, fill=c.a.fill, long_poll_ms=long_poll_ms)
    backlog = c.server.total_items(queues)
    gets = ph.roles["get"].ok if "get" in ph.roles else 0
    rows = [c.row("put", "put", ph, c.items, gets), c.row("get", "get", ph, c.items, gets)]
    for r in rows:
        r.backlog = backlog
        r.notes = [n for n in r.notes if "time bound" not in n]  # time-bound by design
    return rows


def steady_specs(c: Ctx) -> list[ConnSpec]:
    """4 producers and 4 consumers; with --steady-rate the producers are paced."""
    rate = c.a.steady_rate / 4
    return [ConnSpec(role, n, rate=rate if role == "put" else 0.0)
            for role in ("put", "get") for n in split(c.items, 4)]


def w_steady(c: Ctx) -> list[Row]:
    return mixed(c, steady_specs(c), ["q"])


def w_steady_lp(c: Ctx) -> list[Row]:
    return mixed(c, steady_specs(c), ["q"], c.a.long_poll_ms)


def fanin_producers(c: Ctx, names: list[str], conns: int = 4) -> list[ConnSpec]:
    """`conns` producers rotating over every queue of `names`, each from its own start."""
    specs = []
    for i, n in enumerate(split(c.items, conns)):
        at = i * len(names) // conns
        specs.append(ConnSpec("put", n, names[at:] + names[:at]))
    return specs


def fanin_queues() -> list[str]:
    return [f"fanin_{i:03d}" for i in range(FANIN_QUEUES)]  # one length: puts can be stamped


def w_fanin(c: Ctx) -> list[Row]:
    names = fanin_queues()
    ph = run_conns(c.server, names[0], c.payload, fanin_producers(c, names), c.opts(4, 8),
                   c.a.timeout, fill=c.a.fill)
    return [c.row("enqueue", "put", ph, c.items)]


def w_fanin_lp(c: Ctx) -> list[Row]:
    """fanin's producers with consumers at once: consumer connection i long-polls its own
    share of the queues (4 x 25 queues, disjoint), rotating over them, 8 polls in flight."""
    names = fanin_queues()
    share = len(names) // 4
    gets = [ConnSpec("get", n, names[i * share:(i + 1) * share])
            for i, n in enumerate(split(c.items, 4))]
    return mixed(c, fanin_producers(c, names) + gets, names, c.a.long_poll_ms)


def w_fairness(c: Ctx) -> list[Row]:
    """One connection floods queue A with c.items sets (FLOOD_WINDOW in flight) while a
    connection in the other client process gets from B, one request at a time, for as long
    as the flood lasts (or until B is empty); B is filled first with c.items / 2 items (not
    timed: enough for a probe at 50,000 gets/s to outlast a flood at 100,000 sets/s)."""
    fill = c.phase("put", max(1, c.items // 2), queue="fair_b")
    stored = fill.roles["put"].ok if "put" in fill.roles else 0
    specs = [ConnSpec("put", c.items, ["fair_a"], pipeline=FLOOD_WINDOW),
             ConnSpec("get", stored, ["fair_b"], pipeline=1, background=True)]
    ph = run_conns(c.server, "fair_a", c.payload, specs, c.opts(1, 1, procs=2), c.a.timeout,
                   fill=c.a.fill)
    flood = c.row("flood", "put", ph, c.items)
    probe = c.row("probe get", "get", ph, stored)
    probe.notes = [n for n in probe.notes if "time bound" not in n]  # ends with the flood
    if probe.misses:
        probe.notes.append(f"{probe.misses:,} probe gets found B empty")
    return [flood, probe]


def w_reliable(c: Ctx) -> list[Row]:
    put = c.phase("put", c.items)
    stored = put.roles["put"].ok if "put" in put.roles else 0
    rows = [c.row("enqueue", "put", put, c.items)]
    get = c.phase("get", stored, get_options="/close/open", final_get="/close")
    rows.append(c.row("get/close/open", "get", get, stored))
    rows[-1].backlog = c.server.backlog("q")
    if rows[-1].backlog:
        rows[-1].notes.append(f"{rows[-1].backlog:,} items left (unconfirmed?) after the "
                              "chain")
    return rows


RUNNERS: dict[str, Callable[[Ctx], list[Row]]] = {
    "drain": w_drain, "steady": w_steady, "steady-lp": w_steady_lp, "fanin": w_fanin,
    "fanin-lp": w_fanin_lp, "reliable": w_reliable, "big": w_big, "many": w_many,
    "latency": w_latency, "fairness": w_fairness,
}


# -- the bench ----------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace, tree: Tree) -> None:
        self.a = a
        self.tree = tree
        self.root = Path(tempfile.mkdtemp(prefix="vs-darner-", dir=a.dir))
        self.rows: list[Row] = []
        self.memory: list[dict[str, Any]] = []
        self.caveats: list[str] = []
        self.fingerprints: set[str] = set()
        self.idle_budget = a.wait_budget  # seconds left for waiting on other users' work
        self.fdatasync: dict[str, dict[str, float]] = {}  # "start"/"end" -> n, p50, p99 ms

    def wait_idle(self, label: str) -> float | None:
        """Waits (at most --wait-idle s per cell, --wait-budget s in all) until the rest of
        the machine uses < 25 % of a CPU; returns that share at the last look (None: not
        looked, --wait-idle 0)."""
        if self.a.wait_idle <= 0:
            return None
        t0 = time.monotonic()
        while True:
            b0 = system_busy_s()
            time.sleep(0.25)
            busy = (system_busy_s() - b0) / 0.25
            waited = time.monotonic() - t0
            if (busy < 0.25 or waited >= self.a.wait_idle
                    or waited >= self.idle_budget):
                break
        self.idle_budget -= waited
        if waited >= 1.0:
            log(f"  (waited {waited:.0f} s for other work before {label}; machine "
                f"{busy:.0%} busy then)")
        return busy

    def make_server(self, target: str, config: str | None = None) -> MemcacheServer:
        if target == "darner":
            return DarnerServer(self.root, self.a.darner, rss_interval=RSS_INTERVAL)
        fsync = target.rsplit("-", 1)[1]  # queued-never, queued-base-always, ...
        cmd = self.a.queued_cmd
        if "-base-" in target:
            if not self.a.base_cmd:
                raise SystemExit(f"{target} needs --base-cmd")
            cmd = self.a.base_cmd
        return QueuedServer(self.root, fsync, cmd=cmd, config=config, name=target,
                            rss_interval=RSS_INTERVAL)

    def fingerprint(self) -> str:
        fp = tree_state(Path(self.tree.path)).fingerprint if self.tree.path else ""
        if fp and fp not in self.fingerprints and self.fingerprints:
            self.caveats.append(f"the queued source changed during the run (fingerprint "
                                f"{fp} after {', '.join(sorted(self.fingerprints))}): "
                                "later rows measure other code")
        self.fingerprints.add(fp)
        return fp

    def cell(self, target: str, workload: str, payload: int, run: int, items: int) -> None:
        label = f"{workload} {size_name(payload)} run {run + 1} {target}"
        code = self.fingerprint() if target != "darner" else ""
        busy = self.wait_idle(label)
        server = self.make_server(target)
        rows: list[Row] = []
        t0 = time.monotonic()
        try:
            with server:
                try:
                    rows = RUNNERS[workload](Ctx(self.a, target, server, workload, payload,
                                                 run, items))
                except Exception as exc:
                    log(f"  !! {label} failed: {exc!r}")
                    traceback.print_exc(file=sys.stdout)
                    self.caveats.append(f"{label} FAILED: {type(exc).__name__}: "
                                        f"{(str(exc).splitlines() or [''])[0]}")
                peak = hwm_kib(server.pid)
                if not server.alive():
                    rc = server.proc.poll() if server.proc else None
                    msg = f"{target} exited (code {rc}) during {label}"
                    log(f"  !! {msg}; log tail:\n{server.log_tail()}")
                    self.caveats.append(msg)
                    for r in rows:
                        r.notes.append(f"server exited, code {rc}")
        except Exception as exc:  # did not start (or did not stop)
            log(f"  !! {label}: {exc}")
            self.caveats.append(f"{label}: server failed: {exc!r}"[:300])
            return
        for r in rows:
            r.peak_rss_mib = peak / KiB if peak else None
            r.code = code
            r.busy_before = busy
            log("  " + describe(r))
        log(f"  ({label}: {time.monotonic() - t0:.1f} s)")
        self.rows += rows

    def probe_fdatasync(self, when: str) -> None:
        """FDATASYNC_N x (4 KiB appended + os.fdatasync) in a temp file beside the data
        dirs (bounded by 10 s): p50/p99 ms, kept for the report."""
        hist: dict[int, int] = {}
        fd, path = tempfile.mkstemp(prefix="fdatasync-", dir=self.root)
        data = os.urandom(4 * KiB)
        deadline = time.monotonic() + 10.0
        try:
            for _ in range(FDATASYNC_N):
                t = time.perf_counter_ns()
                os.write(fd, data)
                os.fdatasync(fd)
                key = bucket(time.perf_counter_ns() - t)
                hist[key] = hist.get(key, 0) + 1
                if time.monotonic() > deadline:
                    break
        finally:
            os.close(fd)
            os.unlink(path)
        p50, p99 = percentiles(hist, (50, 99))
        self.fdatasync[when] = {"n": sum(hist.values()), "p50_ms": p50, "p99_ms": p99}
        log(f"fdatasync ({when}; {sum(hist.values())} x 4 KiB write + fdatasync in "
            f"{self.root}): p50 {p50:.3f} ms, p99 {p99:.3f} ms")

    def run_workloads(self) -> None:
        a = self.a
        self.probe_fdatasync("start")
        for workload in a.workloads:
            payloads, full, quick = WORKLOADS[workload]
            items = max(1, int((quick if a.quick else full) * a.scale))
            for payload in payloads:
                log(f"## {workload} {size_name(payload)}: {items:,} items per phase")
                for run in range(a.runs):
                    k = run % len(a.targets)  # alternate: each run starts at another target
                    for target in a.targets[k:] + a.targets[:k]:
                        self.cell(target, workload, payload, run, items)
                log()
        self.probe_fdatasync("end")

    # -- memory --------------------------------------------------------------------------

    def run_memory(self) -> None:
        a = self.a
        big = 64 * KiB
        n_big = max(1, int(a.memory_gb * GiB) // big)
        targets = [f"queued-{a.memory_fsync}"] + (["darner"] if "darner" in a.targets else [])
        if "a" in a.memory_cases:
            log(f"## memory (a): hold {n_big:,} x 64 KiB = {n_big * big / GiB:.2f} GiB, "
                "queued with its default config")
            for t in targets:
                self.memory_case("a", t, big, n_big, None, drain=True)
        if "b" in a.memory_cases:
            log(f"## memory (b): {a.memory_items:,} x 64 B held, queued with "
                f'[default] max_memory_size = "{MEMORY_MAX}"')
            cfg = f'[default]\nmax_memory_size = "{MEMORY_MAX}"\n'
            for t in targets:
                self.memory_case("b", t, 64, a.memory_items, cfg, drain=True)
        log()

    def memory_case(self, case: str, target: str, payload: int, n: int, config: str | None,
                    drain: bool) -> None:
        a = self.a
        self.wait_idle(f"memory ({case}) {target}")
        server = self.make_server(target, config if target != "darner" else None)
        rec: dict[str, Any] = {"case": case, "target": target, "payload": payload, "items": n,
                               "config": config if target != "darner" else None}
        label = f"memory ({case}) {target}"
        try:
            with server:
                time.sleep(1.0)
                smp = server.sampler
                assert smp is not None
                idle = rss_kib(server.pid) or 0
                rec["idle_rss_mib"] = idle / KiB
                smp.phase = "enqueue"
                ctx = Ctx(a, target, server, "memory", payload, 0, n)
                bound = max(a.timeout, 300.0)  # a slow target still gets to hold it all
                put = ctx.phase("put", n, seconds=bound)
                row = ctx.row("enqueue", "put", put, n)
                rec["enqueue"] = asdict(row)
                stored = row.items
                smp.phase = "held"
                time.sleep(2.0)
                held = rss_kib(server.pid) or 0
                rec["held_rss_mib"] = held / KiB
                rec["stored"] = stored
                rec["bytes_per_item"] = (held - idle) * KiB / stored if stored else None
                st = server.queue_stats("q")
                rec["queue_stats"] = st
                rec["datadir_held_mib"] = du_bytes(server.dir) / MiB
                log(f"  {label}: {stored:,} items stored at {row.items_per_s:,.0f}/s; RSS idle "
                    f"{idle / KiB:.1f} MiB, with the items {held / KiB:.1f} MiB "
                    f"(+{(held - idle) / KiB:.1f}; {rec['bytes_per_item'] or 0:,.0f} B/item); "
                    f"data dir {rec['datadir_held_mib']:.0f} MiB; queue stats "
                    + ", ".join(f"{k} {v}" for k, v in st.items()
                                if k in ("items", "mem_items", "mem_bytes", "logsize")))
                if drain:
                    smp.phase = "dequeue"
                    get = ctx.phase("get", stored, seconds=bound)
                    grow = ctx.row("dequeue", "get", get, stored)
                    rec["dequeue"] = asdict(grow)
                    smp.phase = "after"
                    time.sleep(2.0)
                    rec["drained_rss_mib"] = (rss_kib(server.pid) or 0) / KiB
                    rec["left"] = server.backlog("q")
                    rec["datadir_drained_mib"] = du_bytes(server.dir) / MiB
                    time.sleep(10.0)
                    rec["idle10_rss_mib"] = (rss_kib(server.pid) or 0) / KiB
                    rec["datadir_idle10_mib"] = du_bytes(server.dir) / MiB
                    log(f"  {label}: drained at {grow.items_per_s:,.0f}/s, {rec['left']} left; "
                        f"RSS after the drain {rec['drained_rss_mib']:.1f} MiB "
                        f"({rec['idle10_rss_mib']:.1f} 10 s later); data dir "
                        f"{rec['datadir_drained_mib']:.1f} MiB "
                        f"({rec['datadir_idle10_mib']:.1f} 10 s later)")
                hwm = hwm_kib(server.pid) or 0
                rec["peak_rss_mib"] = max(hwm, smp.max_kib) / KiB
                rec["alive"] = server.alive()
                log(f"  {label}: peak RSS {rec['peak_rss_mib']:.1f} MiB")
                for r in (rec.get("enqueue"), rec.get("dequeue")):
                    for note in (r or {}).get("notes", []):
                        self.caveats.append(f"{label}: {note}")
        except Exception as exc:
            log(f"  !! {label} failed: {exc!r}")
            traceback.print_exc(file=sys.stdout)
            rec["error"] = repr(exc)
            self.caveats.append(f"{label} FAILED: {exc!r}"[:300])
        self.memory.append(rec)


def describe(r: Row) -> str:
    e2e = (f", e2e p50 {r.e2e_p50_ms:.2f} p99 {r.e2e_p99_ms:.2f} ms"
           if r.e2e_p50_ms is not None and r.e2e_p99_ms is not None else "")
    if r.workload == "fairness" and r.max_ms is not None:
        e2e += f", max {r.max_ms:.2f} ms"
    bl = f", backlog {r.backlog:,}" if r.backlog is not None else ""
    notes = ("; " + "; ".join(r.notes)) if r.notes else ""
    return (f"{r.target:21s} {r.op:14s} {r.items_per_s:10,.0f}/s p50 {r.p50_ms:6.2f} "
            f"p99 {r.p99_ms:6.2f} ms{e2e}; server CPU {r.server_cpu_s:.2f} s "
            f"({r.items_per_cpu_s:,.0f} items/CPU-s), clients {r.client_cpu:.0%}, "
            f"other {r.other_cpu:.0%}; {r.items:,} items, {r.misses:,} misses{bl}{notes}")


# -- the report ---------------------------------------------------------------------------


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    """Medians over runs per (workload, payload, op, target)."""
    groups: dict[tuple[str, int, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.payload, r.op, r.target), []).append(r)
    out = []
    for (workload, payload, op, target), rs in groups.items():
        out.append({
            "workload": workload, "payload": payload, "op": op, "target": target,
            "runs": len(rs),
            "items": median([r.items for r in rs]),
            "items_per_s": median([r.items_per_s for r in rs]),
            "items_per_s_all": [round(r.items_per_s) for r in rs],
            "p50_ms": median([r.p50_ms for r in rs]),
            "p99_ms": median([r.p99_ms for r in rs]),
            "max_ms": median([r.max_ms for r in rs]),
            "e2e_p50_ms": median([r.e2e_p50_ms for r in rs]),
            "e2e_p99_ms": median([r.e2e_p99_ms for r in rs]),
            "server_cpu_s": median([r.server_cpu_s for r in rs]),
            "items_per_cpu_s": median([r.items_per_cpu_s for r in rs]),
            "client_cpu": median([r.client_cpu for r in rs]),
            "other_cpu_max": max(r.other_cpu for r in rs),
            "peak_rss_mib": median([r.peak_rss_mib for r in rs]),
            "backlog": median([r.backlog for r in rs if r.backlog is not None]),
            "notes": sorted({n for r in rs for n in r.notes}),
        })
    return out


def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def us_per_item(s: dict[str, Any] | None) -> float | None:
    ipc = s["items_per_cpu_s"] if s else None
    return 1e6 / ipc if ipc else None


def report(bench: Bench, meta: dict[str, Any]) -> str:
    """The markdown report (also printed)."""
    a = bench.a
    summary = summarize(bench.rows)
    index = {(s["workload"], s["payload"], s["op"], s["target"]): s for s in summary}
    lines = [f"# queued vs darner ({'quick' if a.quick else 'full'}"
             f"{', memory' if a.memory else ''})", ""]
    lines += [f"- when: {meta['started']} to {meta['ended']} ({meta['seconds']:.0f} s)",
              f"- queued: tree {meta['tree']['path']} at `{meta['tree']['commit']}` "
              f"(command `{a.queued_cmd.split()[0]} ...`)",
              f"- darner: {meta['darner_version']} ({a.darner})",
              f"- machine: {meta['machine']}; load average at the start "
              f"{meta['loadavg_start']:.2f}, CPU busy before the start "
              f"{meta['busy_before']:.0%} of one CPU",
              f"- client: load.py's epoll client, {a.procs} processes, payloads "
              f"{'random (incompressible)' if a.fill == 'random' else 'all x'}; "
              + (f"memory workload, once, queued-{a.memory_fsync} and darner; "
                 if a.memory else f"medians of {a.runs} run(s), targets alternating; ")
              + f"every phase bounded by its item count and {a.timeout:g} s"
              + ("" if a.memory else f" (steady: {a.seconds:g} s"
                 + (f", producers paced to {a.steady_rate:,.0f} items/s" if a.steady_rate
                    else "") + ")"), ""]
    ops: list[tuple[str, int, str]] = []
    for s in summary:
        key = (s["workload"], s["payload"], s["op"])
        if key not in ops:
            ops.append(key)
    if ops:
        lines += ratio_table(a.targets, ops, index)
        lines += ["", "## Per target (medians)", "",
                  "p50/p99: per-request latency, send to reply parsed; e2e: steady, steady-lp and "
                  "fanin-lp only, "
                  "put sent to the same item's get reply parsed; CPU s: server CPU over the "
                  "phase; items/CPU-s: items per server CPU-second (steady: gets over the "
                  "CPU of puts and gets); clients: client processes' CPU (1 = one core); "
                  "other: the rest of the machine's CPU, highest of the runs (should be ~0; "
                  "another user's work when not); "
                  "RSS: server peak (VmHWM) over the workload; backlog: items left after "
                  "the phase; runs: items/s of each run.", "",
                  "| workload | payload | op | target | items/s | p50 ms | p99 ms | e2e p50 "
                  "| e2e p99 | CPU s | items/CPU-s | clients | other | RSS MiB | backlog | runs |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for w, p, op in ops:
            for t in a.targets:
                sm = index.get((w, p, op, t))
                if sm is None:
                    continue
                lines.append(
                    f"| {w} | {size_name(p)} | {op} | {t} | {fmt(sm['items_per_s'])} | "
                    f"{fmt(sm['p50_ms'], '.2f')} | {fmt(sm['p99_ms'], '.2f')} | "
                    f"{fmt(sm['e2e_p50_ms'], '.2f')} | {fmt(sm['e2e_p99_ms'], '.2f')} | "
                    f"{fmt(sm['server_cpu_s'], '.2f')} | {fmt(sm['items_per_cpu_s'])} | "
                    f"{fmt(sm['client_cpu'], '.2f')} | {fmt(sm['other_cpu_max'], '.2f')} | "
                    f"{fmt(sm['peak_rss_mib'], '.0f')} | "
                    f"{fmt(sm['backlog'])} | {' / '.join(f'{v:,}' for v in sm['items_per_s_all'])}"
                    " |")
        lines.append("")
        lines += fairness_table(a.targets, index)
    if bench.fdatasync:
        lines += fdatasync_lines(bench.fdatasync, a.targets, ops, index)
    if bench.memory:
        lines += memory_tables(bench.memory)
    notes = sorted({f"{s['workload']} {size_name(s['payload'])} {s['op']} {s['target']}: {n}"
                    for s in summary for n in s["notes"]})
    busy = [r for r in bench.rows if r.other_cpu > 0.2 and r.seconds >= 0.5]  # 10 ms ticks
    if busy:
        cells = sorted({f"{r.workload} {size_name(r.payload)}" for r in busy})
        notes.insert(0, f"{len(busy)} of {len(bench.rows)} measurements had other processes "
                     f"using > 20 % of a CPU meanwhile (up to "
                     f"{max(r.other_cpu for r in busy):.0%}; see the 'other' column), in: "
                     + ", ".join(cells))
    cav = list(dict.fromkeys(bench.caveats)) + notes
    if cav:
        lines += ["## Caveats and notes", ""] + [f"- {c}" for c in cav] + [""]
    return "\n".join(lines)


def ratio_table(targets: list[str], ops: list[tuple[str, int, str]],
                index: dict[tuple[str, int, str, str], dict[str, Any]]) -> list[str]:
    """items/s of darner and of each queued target, each queued target's ratio to darner,
    the PAIRS' ratios, server CPU per item, and CPU per item over darner's (fsync never)."""
    qs = [t for t in QUEUED_TARGETS if t in targets]
    pairs = [pr for pr in PAIRS if pr[0] in targets and pr[1] in targets]
    nevers = [t for t in qs if t.endswith("-never")]
    head = (["darner items/s"] + [SHORT[t] for t in qs] + [f"{SHORT[t]}/darner" for t in qs]
            + [label for _, _, label in pairs] + ["CPU µs/item darner"] + [SHORT[t] for t in qs]
            + [f"CPU {SHORT[t]}/darner" for t in nevers])
    lines = ["## Ratios (medians)", "",
             "items/s: higher is better; never, always: queued with fsync never / always; "
             "base never, base always: the build of --base-cmd. x/darner: queued's items/s "
             "over darner's; always/never: fsync always over never on one build; now/base: "
             "this build over the base one at one fsync. CPU µs/item: server CPU per item (lower "
             "is better); CPU x/darner: that (fsync never) over darner's.", "",
             "| workload | payload | op | " + " | ".join(head) + " |",
             "|---|---|---|" + "---:|" * len(head)]
    for w, p, op in ops:
        sm = {t: index.get((w, p, op, t)) for t in ["darner", *qs]}
        ips = {t: (v["items_per_s"] if v else None) for t, v in sm.items()}
        cpu = {t: us_per_item(v) for t, v in sm.items()}
        cells = ([fmt(ips["darner"])] + [fmt(ips[t]) for t in qs]
                 + [ratio(ips[t], ips["darner"]) for t in qs]
                 + [ratio(ips[x], ips[y]) for x, y, _ in pairs]
                 + [fmt(cpu[t], ".1f") for t in ["darner", *qs]]
                 + [ratio(cpu[t], cpu["darner"]) for t in nevers])
        lines.append(f"| {w} | {size_name(p)} | {op} | " + " | ".join(cells) + " |")
    return lines


def fairness_table(targets: list[str],
                   index: dict[tuple[str, int, str, str], dict[str, Any]]) -> list[str]:
    """The fairness workload: the flood's rate and the probe gets' latency, per target."""
    rows = [(t, index.get(("fairness", 64, "flood", t)), index.get(("fairness", 64,
                                                                     "probe get", t)))
            for t in targets]
    rows = [r for r in rows if r[1] or r[2]]
    if not rows:
        return []
    dark = next((pr for t, _, pr in rows if t == "darner" and pr), None)
    lines = ["## Fairness (medians)", "",
             f"One connection pipelines sets of 64 B into queue A ({FLOOD_WINDOW} in flight) "
             "while another, in the other client process, gets from queue B (which has "
             "items) one request at a time until the flood ends. probe ms: latency of those "
             "gets, send to reply parsed (max: the slowest, median over runs); p99/darner: "
             "the probe p99 over darner's (> 1: queued serves the quiet connection later).", "",
             "| target | flood items/s | probe gets | probe p50 ms | p99 ms | max ms "
             "| p99/darner |", "|---|---:|---:|---:|---:|---:|---:|"]
    for t, fl, pr in rows:
        lines.append(f"| {t} | {fmt(fl['items_per_s'] if fl else None)} | "
                     f"{fmt(pr['items'] if pr else None)} | "
                     f"{fmt(pr['p50_ms'] if pr else None, '.2f')} | "
                     f"{fmt(pr['p99_ms'] if pr else None, '.2f')} | "
                     f"{fmt(pr['max_ms'] if pr else None, '.2f')} | "
                     f"{ratio(pr['p99_ms'] if pr else None, dark['p99_ms'] if dark else None)} |")
    lines.append("")
    return lines


def fdatasync_lines(fds: dict[str, dict[str, float]], targets: list[str],
                    ops: list[tuple[str, int, str]],
                    index: dict[tuple[str, int, str, str], dict[str, Any]]) -> list[str]:
    """The measured fdatasync latency, and each queued-*-always latency p50 against the
    target "at most darner's p50 plus one fdatasync" (latency workload, 1 x 1)."""
    lines = ["## fdatasync on this machine", "",
             f"{FDATASYNC_N} x (4 KiB appended + os.fdatasync) in a temp file beside the data "
             "dirs, at the start and at the end of the run:", ""]
    lines += [f"- {when}: p50 {v['p50_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms ({v['n']:.0f} "
              "syncs)" for when, v in fds.items()]
    sync = fds.get("start", next(iter(fds.values())))["p50_ms"]
    always = [t for t in QUEUED_TARGETS if t in targets and t.endswith("-always")]
    lat = [(w, p, op) for w, p, op in ops if w == "latency"]
    if not lat or not always or "darner" not in targets:
        lines += ["", "(no latency-workload cells of darner and a queued-*-always target: "
                  "no comparison with darner p50 + fdatasync p50)", ""]
        return lines + always_ceiling_lines(sync, always, ops, index)
    lines += ["", f"Target: latency 1 x 1 under fsync always, p50 <= darner's p50 + one "
              f"fdatasync p50 ({sync:.3f} ms, the start's):", ""]
    for w, p, op in lat:
        d = index.get((w, p, op, "darner"))
        for t in always:
            q = index.get((w, p, op, t))
            if not d or not q or d["p50_ms"] is None or q["p50_ms"] is None:
                continue
            bound = d["p50_ms"] + sync
            lines.append(f"- latency {size_name(p)} {op}: {t} p50 {q['p50_ms']:.3f} ms vs "
                         f"darner p50 {d['p50_ms']:.3f} + fdatasync p50 {sync:.3f} = "
                         f"{bound:.3f} ms: {q['p50_ms'] / bound:.2f}x the bound ("
                         + ("met)" if q["p50_ms"] <= bound else "**not met**)"))
    lines.append("")
    lines += always_ceiling_lines(sync, always, ops, index)
    return lines


#: Puts in flight in each enqueue workload (its connections x their pipeline).
ENQUEUE_IN_FLIGHT: dict[str, int] = {w: conns * depth for w, (conns, depth) in SHAPES.items()}


def always_ceiling_lines(sync: float, always: list[str], ops: list[tuple[str, int, str]],
                         index: dict[tuple[str, int, str, str], dict[str, Any]]) -> list[str]:
    """What fsync always can be expected to reach against darner where the load's clients
    keep a fixed number of puts in flight and wait for the replies (items/s = puts in
    flight / round trip): darner's mean round trip (in flight / its items/s) with one
    fdatasync p50 added, so darner's items/s x rt / (rt + fdatasync). An estimate, not a
    bound: a server that batches can answer sooner than darner's round trip, which holds
    darner's own queueing."""
    rows = []
    for w, p, op in ops:
        if op != "enqueue" or w not in ENQUEUE_IN_FLIGHT:
            continue
        d = index.get((w, p, op, "darner"))
        if not d or not d["items_per_s"]:
            continue
        rt = ENQUEUE_IN_FLIGHT[w] / d["items_per_s"] * 1000  # ms
        ceiling = rt / (rt + sync)
        cells = []
        for t in always:
            q = index.get((w, p, op, t))
            if q and q["items_per_s"]:
                got = q["items_per_s"] / d["items_per_s"]
                cells.append(f"{t} {got:.2f} ({got / ceiling:.2f} of the ceiling)")
        rows.append(f"- {w} {size_name(p)} {op}: darner's round trip {rt:.3f} ms, ceiling "
                    f"{ceiling:.2f} of darner" + (": " + ", ".join(cells) if cells else ""))
    if not rows:
        return []
    return ["The ceiling of fsync always against darner, puts with a fixed number in flight: "
            "darner's mean round trip (puts in flight / its items/s) / (that + fdatasync p50 "
            f"{sync:.3f} ms). An estimate (a batching server can answer sooner than darner's "
            "round trip, which holds darner's own queueing): a target of 0.8x darner well "
            "above it cannot be met on this machine's disk:", "",
            *rows, ""]


def memory_tables(mem: list[dict[str, Any]]) -> list[str]:
    lines = ["## Memory", "",
             "(a) hold 64 KiB items, queued with its default config (max_memory_size "
             "128MiB); (b) hold 64 B items, queued with max_memory_size = "
             f'"{MEMORY_MAX}" so every item stays in memory. RSS in MiB (VmRSS; peak = '
             "VmHWM); held = 2 s after the enqueue; drained = 2 s after the dequeue, +10 s = "
             "10 s later; data dir = du of the data dir; B/item = (held - idle) / items. "
             "darner keeps its items in LevelDB files (page cache, not its RSS), so its "
             "B/item is its memtable and caches, not a cost per item held.", "",
             "| case | target | items | enqueue/s | dequeue/s | idle RSS | peak RSS | held RSS "
             "| B/item | drained RSS | +10 s | data dir held | drained | +10 s | queue stats |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in mem:
        if "error" in m and "held_rss_mib" not in m:
            lines.append(f"| {m['case']} | {m['target']} | {m['items']:,} | FAILED: "
                         f"{m['error'][:80]} |")
            continue
        st = m.get("queue_stats", {})
        stats = ", ".join(f"{k} {st[k]}" for k in ("items", "mem_items", "mem_bytes",
                                                    "logsize") if k in st)
        enq = m.get("enqueue", {}).get("items_per_s")
        deq = m.get("dequeue", {}).get("items_per_s")
        lines.append(
            f"| {m['case']} | {m['target']} | {m.get('stored', 0):,} x "
            f"{size_name(m['payload'])} | {fmt(enq)} | {fmt(deq)} | "
            f"{fmt(m.get('idle_rss_mib'), '.1f')} | {fmt(m.get('peak_rss_mib'), '.1f')} | "
            f"{fmt(m.get('held_rss_mib'), '.1f')} | {fmt(m.get('bytes_per_item'), ',.0f')} | "
            f"{fmt(m.get('drained_rss_mib'), '.1f')} | {fmt(m.get('idle10_rss_mib'), '.1f')} | "
            f"{fmt(m.get('datadir_held_mib'), '.1f')} | "
            f"{fmt(m.get('datadir_drained_mib'), '.1f')} | "
            f"{fmt(m.get('datadir_idle10_mib'), '.1f')} | {stats} |")
    lines.append("")
    return lines


def clean(x: Any) -> Any:
    """JSON-safe: NaN -> None, recursively."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def machine() -> str:
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
    return (f"{os.cpu_count()} CPUs, {mem} MiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


# -- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts: < 3 minutes")
    ap.add_argument("--runs", type=int, default=3,
                    help="runs per target (default 3); the report gives medians")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"subset of {','.join(WORKLOADS)} (default all)")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help=f"subset of {','.join(TARGETS)}, run in this order (alternating) "
                         f"(default {','.join(DEFAULT_TARGETS)}); queued-base-* run --base-cmd")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every item count")
    ap.add_argument("--seconds", type=float, default=None,
                    help="steady workload duration (default 5, --quick 1)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="wall-clock bound of every other phase (default 30, --quick 10)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="wait for replies in flight after a time bound (default 5 s)")
    ap.add_argument("--miss-backoff-ms", type=float, default=1.0,
                    help="a consumer that got an empty reply waits this long (default 1)")
    ap.add_argument("--long-poll-ms", type=int, default=100,
                    help="the long poll of steady-lp and fanin-lp consumers: get q/t=MS "
                         "(default 100)")
    ap.add_argument("--steady-rate", type=float, default=0.0,
                    help="steady and steady-lp: the producers together offer at most this "
                         "many items/s, paced from the start (end-to-end latency at a load "
                         "below both servers' capacity); default 0: as fast as they can")
    ap.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    ap.add_argument("--fill", choices=("random", "x"), default="random",
                    help="payload bytes: random (distinct, incompressible; default) or x "
                         "(all b'x', as load.py: darner's LevelDB snappy-compresses it away)")
    ap.add_argument("--wait-idle", type=float, default=None,
                    help="before each cell wait up to this long for the machine to be idle "
                         "(< 25 %% of a CPU busy; default 20 s, --quick 0 = never)")
    ap.add_argument("--wait-budget", type=float, default=None,
                    help="total seconds of such waits (default 240)")
    ap.add_argument("--memory", action="store_true",
                    help="run only the memory workload (slow)")
    ap.add_argument("--memory-gb", type=float, default=1.0,
                    help="memory test (a): GiB of 64 KiB items to hold (default 1)")
    ap.add_argument("--memory-items", type=int, default=1_000_000,
                    help="memory test (b): 64 B items to hold (default 1,000,000)")
    ap.add_argument("--memory-cases", default="a,b",
                    help="memory cases to run: a, b or a,b (default a,b); darner runs them "
                         "too unless --targets leaves it out")
    ap.add_argument("--memory-fsync", choices=("never", "always"), default="never",
                    help="queued's fsync in the memory test (default never, like darner)")
    ap.add_argument("--queued-cmd", default=QUEUED_CMD,
                    help="command starting queued; placeholders {data_dir} {memcache_port} "
                         "{text_port} {rpc_port} {http_port} {fsync} (default: the `queued` "
                         "beside this Python, i.e. its venv's tree)")
    ap.add_argument("--base-cmd", default=None,
                    help="command starting another build of queued for the queued-base-* "
                         "targets (same placeholders as --queued-cmd)")
    ap.add_argument("--queued-tree", default=None,
                    help="the queued source tree measured (default: found by importing "
                         "queued the way --queued-cmd runs it)")
    ap.add_argument("--darner", type=Path, default=DARNER, help=f"darner binary ({DARNER})")
    ap.add_argument("--darner-build", type=Path, default=DARNER_BUILD,
                    help=f"script building darner when the binary is missing ({DARNER_BUILD})")
    ap.add_argument("--dir", default="/tmp", help="parent of the temp dirs (default /tmp)")
    a = ap.parse_args()
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    a.targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    a.memory_cases = [c.strip() for c in a.memory_cases.split(",") if c.strip()]
    for c in a.memory_cases:
        if c not in ("a", "b"):
            ap.error(f"unknown memory case {c!r}; known: a, b")
    for w in a.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    for t in a.targets:
        if t not in TARGETS:
            ap.error(f"unknown target {t!r}; known: {', '.join(TARGETS)}")
    if a.wait_idle is None:
        a.wait_idle = 0.0 if a.quick else 20.0
    if a.wait_budget is None:
        a.wait_budget = 240.0
    if a.seconds is None:
        a.seconds = 1.0 if a.quick else 5.0
    if a.timeout is None:
        a.timeout = 10.0 if a.quick else 30.0
    if a.quick and a.memory:
        a.memory_gb = min(a.memory_gb, 0.125)
        a.memory_items = min(a.memory_items, 100_000)
    a.pipeline_mode = "window"
    a.conns, a.pipeline = 4, 8
    return a


def main() -> None:
    a = parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    started = time.time()
    t0 = time.monotonic()
    darner_version = "not used"
    if "darner" in a.targets:
        darner_version = ensure_darner(a.darner, a.darner_build)
    root_probe = Path(tempfile.mkdtemp(prefix="vs-darner-probe-", dir=a.dir))
    try:
        path = Path(a.queued_tree) if a.queued_tree else queued_tree(a.queued_cmd, root_probe)
    finally:
        shutil.rmtree(root_probe, ignore_errors=True)
    tree = tree_state(path)
    busy0 = system_busy_s()
    time.sleep(1.0)
    busy = system_busy_s() - busy0
    load0 = os.getloadavg()[0]
    log(f"# queued vs darner, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    log(f"queued tree {tree.path} at {tree.commit} (fingerprint {tree.fingerprint}"
        + (f"; uncommitted: {', '.join(tree.dirty_files)}" if tree.dirty_files else "") + ")")
    log(f"darner {darner_version} ({a.darner}); {machine()}; load average {load0:.2f}, "
        f"CPU busy before the start {busy:.0%} of one CPU")
    log(f"memory workload: queued-{a.memory_fsync}, darner; once" if a.memory else
        f"targets {', '.join(a.targets)}; runs {a.runs}; workloads {', '.join(a.workloads)}")
    log()
    bench = Bench(a, tree)
    if busy > 0.2:
        bench.caveats.append(f"the machine was not idle at the start ({busy:.0%} of a CPU "
                             "busy)")
    try:
        if a.memory:
            bench.run_memory()
        else:
            bench.run_workloads()
    except KeyboardInterrupt:
        log("interrupted: reporting what ran")
        bench.caveats.append("interrupted (Ctrl-C): incomplete")
    finally:
        stop_all()
        shutil.rmtree(bench.root, ignore_errors=True)
    end_tree = tree_state(path)
    if end_tree.commit != tree.commit:
        bench.caveats.append(f"the queued tree moved from {tree.commit} to {end_tree.commit} "
                             "during the run")
    if len(bench.fingerprints - {""}) > 1 or (end_tree.fingerprint != tree.fingerprint):
        bench.caveats.append(f"queued sources changed during the run (fingerprints "
                             f"{tree.fingerprint} at the start, {end_tree.fingerprint} at "
                             "the end)")
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "ended": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": time.monotonic() - t0,
            "tree": asdict(tree), "tree_at_end": asdict(end_tree),
            "darner_version": darner_version, "machine": machine(),
            "loadavg_start": load0, "busy_before": busy,
            "bench_commit": tree_commit(Path(__file__).resolve().parent.parent)}
    md = report(bench, meta)
    log(md)
    path = result_file(".json")
    if path is None:
        return
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    out = {"meta": meta, "args": args, "summary": summarize(bench.rows),
           "rows": [asdict(r) for r in bench.rows], "memory": bench.memory,
           "fdatasync": bench.fdatasync,
           "caveats": list(dict.fromkeys(bench.caveats))}
    path.write_text(json.dumps(clean(out), indent=1, default=str))
    log(f"results written to {path}")


if __name__ == "__main__":
    with recording("vs_darner"):
        main()
