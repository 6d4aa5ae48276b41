"""What lease heartbeats cost the server: many items held by `reserve(..., heartbeat=True)`.

Starts one `queued serve` (fsync never, a temp data dir, 127.0.0.1 on free ports), puts
--leases items (default 1,000) into queue `q`, and holds each in a reserve block of the
async client with heartbeat=True, as a long job would: --conns clients (connections,
default 10) share them evenly, and each item's heartbeat extends its read to
auto_abort_ms from now every auto_abort_ms / 3 (the client's default; the beats of one
client that fall due together go out as one RPC `extend` per connection). While only
heartbeats flow, the server's CPU time (user + system, /proc/<pid>/stat) is read over a
window of --intervals heartbeat intervals (default 3), placed so that each item beats
exactly that many times in it. The same window is first measured with
the server idle (no connection, nothing held), and again with the items held but no
heartbeat: what the server spends anyway. Prints the share of one core for each, the
extend calls the server counted (`queued_commands_total{protocol="rpc",command="extend"}`),
and the heartbeats' own cost: (with heartbeats - held without) per second and per item
beat.

    python bench/heartbeat_bench.py [--leases 1000] [--conns 10] [--lease-ms 60000,6000]
                                    [--intervals 3]

Every --lease-ms value (the reserve's auto_abort_ms; 60,000 is the client's default) is
one run; a shorter lease means more heartbeats a second (leases * 3 / lease seconds).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path

import trio
from benchlib import proc_cpu_s
from fuzz_rss import HOST, start_server

from queued.client import AsyncClient, Client

QUEUE = "q"


def extends(http_port: int) -> int:
    """The extends the server has run (its RPC command counter)."""
    with urllib.request.urlopen(f"http://{HOST}:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^queued_commands_total\{(?=[^}]*protocol="rpc")(?=[^}]*command="extend")'
                  r'[^}]*\} ([0-9.e+]+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def cpu_over(pid: int, seconds: float) -> float:
    """The process's CPU seconds (user + system) over the next `seconds` of wall time."""
    cpu0 = proc_cpu_s(pid)
    time.sleep(seconds)
    return proc_cpu_s(pid) - cpu0


async def hold_leases(rpc_port: int, leases: int, conns: int, lease_ms: int,
                      heartbeat: bool, measure: float, pid: int) -> tuple[float, int]:
    """Reserve `leases` items over `conns` connections and hold them; measure the server's
    CPU over `measure` s starting lease/6 after the last reserve (so each item beats a whole
    number of times in it: at lease/3, 2*lease/3, ...). (CPU seconds, items still held at
    the end of the window)."""
    clients = [AsyncClient(f"{HOST}:{rpc_port}", read_timeout=30.0) for _ in range(conns)]
    held = 0
    all_held = trio.Event()
    release = trio.Event()
    result: list[float] = []

    # Without heartbeats a lease longer than the window keeps the items held through it.
    ms = lease_ms if heartbeat else 10 * lease_ms + int(2000 * measure)
    still: list[int] = []

    async def hold(c: AsyncClient) -> None:
        nonlocal held
        async with c.reserve(QUEUE, timeout_ms=10_000, auto_abort_ms=ms,
                             heartbeat=heartbeat) as item:
            if item is None:
                raise SystemExit("a reserve got nothing: the queue ran dry")
            held += 1
            if held == leases:
                all_held.set()
            await release.wait()

    async def measurer() -> None:
        await all_held.wait()
        await trio.sleep(lease_ms / 6000)
        result.append(await trio.to_thread.run_sync(cpu_over, pid, measure))
        stats = (await clients[0].stats())[f"{HOST}:{rpc_port}"]["queues"][QUEUE]
        still.append(int(stats["open_transactions"]))
        release.set()

    async with AsyncExitStack() as stack:
        for c in clients:
            await stack.enter_async_context(c)
        async with trio.open_nursery() as nursery:
            for i in range(leases):
                nursery.start_soon(hold, clients[i % conns])
            nursery.start_soon(measurer)
            with trio.fail_after(60):
                await all_held.wait()
    return result[0], still[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=1000)
    ap.add_argument("--conns", type=int, default=10)
    ap.add_argument("--lease-ms", default="60000,6000",
                    help="comma-separated auto_abort_ms values, one run each")
    ap.add_argument("--intervals", type=int, default=3,
                    help="the window, in heartbeat intervals (lease / 3 each)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="heartbeat-bench-"))
    proc, ports = start_server(tmp / "data", tmp / "server.log")
    try:
        for lease_ms in (int(v) for v in args.lease_ms.split(",")):
            window = args.intervals * lease_ms / 3000
            with Client(f"{HOST}:{ports['rpc']}") as c:
                c.put(QUEUE, [b"x" * 64] * args.leases)
            idle = cpu_over(proc.pid, window)
            rows = {"idle": (idle, 0, 0)}
            for heartbeat in (False, True):
                before = extends(ports["http"])
                cpu, still = trio.run(hold_leases, ports["rpc"], args.leases, args.conns,
                                      lease_ms, heartbeat, window, proc.pid)
                # (the reserve blocks confirmed their items on the way out: the queue is
                # empty again; refill it for the next run)
                with Client(f"{HOST}:{ports['rpc']}") as c:
                    c.put(QUEUE, [b"x" * 64] * args.leases)
                name = "heartbeats" if heartbeat else "held, no heartbeat"
                rows[name] = (cpu, extends(ports["http"]) - before, still)
            with Client(f"{HOST}:{ports['rpc']}") as c:
                c.flush(QUEUE)
            print(f"\n{args.leases} leases of {lease_ms:,} ms over {args.conns} connections; "
                  f"window {window:.0f} s ({args.intervals} heartbeat intervals)")
            print(f"{'':>20} {'server CPU':>10} {'% of a core':>11} {'extend calls':>12} "
                  f"{'held at end':>11}")
            for name, (cpu, n, still) in rows.items():
                print(f"{name:>20} {cpu:9.2f}s {100 * cpu / window:10.2f}% {n:12,} {still:11,}")
            beat_cpu = rows["heartbeats"][0] - rows["held, no heartbeat"][0]
            n = rows["heartbeats"][1]
            beats = args.leases * args.intervals  # each item beats once an interval
            print(f"heartbeats alone: {100 * beat_cpu / window:.2f} % of a core "
                  f"({beats / window:,.0f} item beats/s in {n / window:,.1f} extend calls/s; "
                  f"{beat_cpu / beats * 1e6:.1f} us of server CPU per item beat)")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from benchlib import recording

    with recording("heartbeat_bench"):
        main()
