#!/usr/bin/env python3
"""What a deduplication key costs a memcache set: plain sets against keyed ones.

Prints numbers, never asserts. Per fsync policy the bench starts a fresh server;
`--conns` client OS processes each keep `--window` sets in flight on one connection for
`--seconds`, in rounds alternating the variants (each round its own queue, flushed after
it):

* plain: `set q 0 0 64` (pipelined sets are joined into one append);
* unjoined: `set q 0 <exptime> 64`, each set another (relative) exptime: no key, but
  one append per set, never joined (what a keyed set costs beyond this is the key's);
* keyed: `set q/key=<unique> 0 0 64` (each its own append and DEDUP record; once a queue
  holds max_dedup_keys the oldest key goes for each new one);
* resent: every keyed set sent twice in a row (half are duplicates: nothing stored).

Reported: sets a second (every set answered STORED counts, duplicates too) and the
server's CPU time per set (/proc), medians over the rounds, and each variant against
plain.

Usage:  .venv/bin/python bench/dedup_bench.py [--seconds S] [--rounds N] [--conns N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import QueuedServer, proc_cpu_s, recording

HOST = "127.0.0.1"
DATA = b"x" * 64
VARIANTS = ("plain", "unjoined", "keyed", "resent")


def worker(port: int, queue: str, variant: str, seconds: float, window: int, who: int,
           out: multiprocessing.Queue[int]) -> None:
    """Sets for `seconds` with `window` in flight; puts the number answered on `out`."""
    sock = socket.create_connection((HOST, port), timeout=30)
    q = queue.encode()
    n = sent = answered = 0
    pending = b""

    def request() -> bytes:
        nonlocal n
        if variant == "plain":
            line = b"set %s 0 0 64\r\n" % q
        elif variant == "unjoined":  # an expiry of its own: one append each, no key
            line = b"set %s 0 %d 64\r\n" % (q, 100_000 + n % 800_000)
        else:
            k = n // 2 if variant == "resent" else n
            line = b"set %s/key=w%d-%d 0 0 64\r\n" % (q, who, k)
        n += 1
        return line + DATA + b"\r\n"

    end = time.monotonic() + seconds
    while time.monotonic() < end and sent < 50_000_000:  # (bounded by time and count)
        want = window - (sent - answered)
        if want > 0:
            sock.sendall(b"".join(request() for _ in range(want)))
            sent += want
        pending += sock.recv(1 << 16)
        got = pending.count(b"\r\n")
        if got:
            assert pending.count(b"STORED\r\n") == got, pending[:80]
            answered += got
            pending = pending[pending.rfind(b"\r\n") + 2:]
    while answered < sent:
        pending += sock.recv(1 << 16)
        got = pending.count(b"\r\n")
        answered += got
        pending = pending[pending.rfind(b"\r\n") + 2:] if got else pending
    sock.close()
    out.put(answered)


def flush(port: int, queue: str) -> None:
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(b"flush %s\r\n" % queue.encode())
        got = b""
        while not got.endswith(b"END\r\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk


def one_round(proc: subprocess.Popen[bytes], port: int, queue: str, variant: str,
              args: argparse.Namespace) -> tuple[float, float]:
    """(sets a second, server CPU µs per set) of one round."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[int] = ctx.Queue()
    workers = [ctx.Process(target=worker, args=(port, queue, variant, args.seconds,
                                                args.window, i, out))
               for i in range(args.conns)]
    for w in workers:
        w.start()
    time.sleep(0.5)  # (the spawned interpreters start; their sets have not begun yet)
    cpu0, t0 = proc_cpu_s(proc.pid), time.monotonic()
    total = sum(out.get(timeout=args.seconds + 60) for _ in workers)
    cpu1, t1 = proc_cpu_s(proc.pid), time.monotonic()
    for w in workers:
        w.join(30)
    flush(port, queue)
    return total / (t1 - t0), (cpu1 - cpu0) / total * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--fsync", nargs="+", default=["never", "always"])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dedup-bench-"))
    print(f"{args.conns} connections, {args.window} sets in flight each, 64 B items, "
          f"{args.seconds} s per round, {args.rounds} rounds per variant (alternated)")
    try:
        for fsync in args.fsync:
            with QueuedServer(root, fsync) as server:
                assert server.proc is not None
                results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
                for r in range(args.rounds):
                    for v in VARIANTS:
                        results[v].append(one_round(server.proc, server.port, f"{v}{r}", v,
                                                    args))
            base = statistics.median(rate for rate, _ in results["plain"])
            print(f"\nfsync {fsync}:")
            print(f"  {'variant':8} {'sets/s':>10} {'vs plain':>9} {'server us/set':>14}")
            for v in VARIANTS:
                rate = statistics.median(x for x, _ in results[v])
                cpu = statistics.median(c for _, c in results[v])
                print(f"  {v:8} {rate:10.0f} {rate / base:9.2f} {cpu:14.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    with recording("dedup_bench"):
        main()
