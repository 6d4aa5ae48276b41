"""Hostile input and memory: does RSS level off under a stream of fuzzed requests?

Starts `queued serve` (fsync never, a temp data dir, 127.0.0.1 on free ports) and
sends N fuzzed inputs (default 1,000,000) over many short connections to the memcache,
text and RPC ports: valid commands with random queue names and options, mutated ones
(wrong sizes, bad flags, binary garbage, over-long lines, huge declared items, half
lines, truncated MessagePack frames), never `shutdown`. Prints the server's RSS after
every 10% and the figure issue 16 asks for: RSS after all N against RSS after N/10
(target: within 10%), with the queue count and data dir size.

    python bench/fuzz_rss.py [--inputs 1000000] [--per-conn 200] [--seed 1] [--users]
                             [--park-after MS] [--idle S]

Each RSS figure that counts is read after --idle seconds without input; by default that
is the server's park_after (30 s unless --park-after) plus 20 s, so every queue the fuzz
left idle has been parked by then (the parker looks at each queue every few seconds)
and the heap trim has run.

With --users the server has a users file and the fuzzer never logs in: the exposed
server's case (a hostile network that holds no password). Refused logins are answered
after a delay, so the batches then go over 32 connections at a time.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import shutil
import socket
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
from benchlib import HOST, kib_field, recording, start_server

VERBS = [b"get", b"set", b"delete", b"flush", b"stats", b"dump_stats", b"version",
         b"monitor", b"confirm", b"flush_expired", b"add", b"cas", b"gets", b"incr",
         b"", b"\x00\xff", b"GET", b"quit"]
OPTIONS = [b"", b"/open", b"/close", b"/abort", b"/peek", b"/t=1", b"/t=abc", b"/close/open",
           b"/t=-1", b"/open/open", b"/" * 40]


def rand_name(r: random.Random) -> bytes:
    """Mostly names from a large space (each may create a queue), sometimes bad ones."""
    k = r.random()
    if k < 0.7:
        return b"fz%d" % r.randrange(1_000_000)
    if k < 0.8:
        return b"fz%d+r%d" % (r.randrange(1000), r.randrange(50))
    if k < 0.9:
        return bytes(r.randrange(256) for _ in range(r.randrange(1, 30)))
    return b"x" * r.randrange(200, 400)


def memcache_input(r: random.Random) -> bytes:
    k = r.random()
    if k < 0.35:
        data = os.urandom(r.randrange(0, 200))
        n = len(data) if r.random() < 0.8 else r.randrange(0, 300)
        flags = r.choice([b"0", b"1", b"-1", b"99999999999", b"x"])
        return b"set %s %s 0 %d\r\n%s\r\n" % (rand_name(r), flags, n, data)
    if k < 0.65:
        return b"get %s%s\r\n" % (rand_name(r), r.choice(OPTIONS))
    if k < 0.75:
        return b"set %s 0 0 %d\r\n" % (rand_name(r), r.choice([10**9, 2**31, 17 * 2**20]))
    if k < 0.85:
        return b" ".join([r.choice(VERBS), rand_name(r), b"%d" % r.randrange(-5, 5)]) + b"\r\n"
    if k < 0.95:
        return os.urandom(r.randrange(1, 64))
    return b"g" * r.randrange(1000, 5000) + b"\r\n"  # over max_line


def text_input(r: random.Random) -> bytes:
    k = r.random()
    if k < 0.4:
        return b"put %s:\n%s\n\n" % (rand_name(r), os.urandom(8).hex().encode())
    if k < 0.7:
        return b"%s %s %d\n" % (r.choice([b"get", b"peek", b"confirm", b"flush", b"monitor"]),
                                rand_name(r), r.randrange(-2, 3))
    return os.urandom(r.randrange(1, 64)) + b"\n"


def rpc_input(r: random.Random) -> bytes:
    k = r.random()
    name = rand_name(r).decode("latin-1")
    if k < 0.4:
        frame = msgpack.packb([0, r.randrange(2**32), "put", [name, [os.urandom(16)]]])
    elif k < 0.7:
        frame = msgpack.packb([0, r.randrange(2**32), r.choice(
            ["get", "peek", "confirm", "abort", "stats", "nope"]), [name, r.randrange(5)]])
    elif k < 0.85:
        frame = msgpack.packb([0, 1, "put", [name, [b"x" * 100]]])[:r.randrange(1, 20)]
    else:
        frame = os.urandom(r.randrange(1, 64))
    return frame


GENERATORS = {"memcache": memcache_input, "text": text_input, "rpc": rpc_input}


def send_batch(port: int, payload: bytes) -> None:
    """One connection: send everything, read what comes back for a moment, close."""
    s = socket.create_connection((HOST, port), timeout=5)
    try:
        s.settimeout(0.5)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # closed on us: a refusal, fine
    finally:
        s.close()


def dir_size(path: Path) -> int:
    """Bytes of the files in `path` (a file may go while we look: the server rewrites)."""
    total = 0
    for p in path.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def idle_rss(pid: int, seconds: float) -> int:
    """RSS (KiB) after `seconds` without input."""
    time.sleep(seconds)
    return kib_field(f"/proc/{pid}/status", "VmRSS") or 0


def queue_count(http_port: int, login: str | None) -> int:
    """Queues and readers the server holds (from /stats.json; `login`: "user:password")."""
    request = urllib.request.Request(f"http://{HOST}:{http_port}/stats.json")
    if login:
        request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            request, timeout=30) as reply:
        return len(json.load(reply)["queues"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--per-conn", type=int, default=200, help="inputs per connection")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", type=int, default=None,
                    help="inputs after which the first idle reading is taken (default a tenth)")
    ap.add_argument("--park-after", type=int, default=None,
                    help="the server's park_after in ms (default: its own, 30000; 0 = never)")
    ap.add_argument("--idle", type=float, default=None,
                    help="seconds without input before each idle reading (default: "
                         "park_after + 20 s)")
    ap.add_argument("--max-queues", type=int, default=None,
                    help="the server's max_queues (default: its own, 10000)")
    ap.add_argument("--users", action="store_true",
                    help="the server has a users file; the fuzzer never logs in")
    args = ap.parse_args()
    if args.idle is None:
        from queued.config import ServerConfig
        park_after = ServerConfig().park_after if args.park_after is None else args.park_after
        args.idle = park_after / 1000 + 20
    r = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="queued-fuzz-"))
    login, users_file = None, None
    if args.users:
        from queued.config.users import hash_password
        password = os.urandom(12).hex()
        login, users_file = f"admin:{password}", tmp / "users.toml"
        users_file.write_text(f'[users.admin]\npassword = "{hash_password(password)}"\n'
                              'put = ["*"]\nget = ["*"]\nadmin = true\n')
    parallel = 32 if args.users else 1
    pool = ThreadPoolExecutor(parallel)
    proc, ports = start_server(tmp / "data", tmp / "server.log", args.max_queues,
                               users_file=users_file, park_after=args.park_after)
    try:
        rss0 = kib_field(f"/proc/{proc.pid}/status", "VmRSS") or 0
        print(f"server pid {proc.pid}, RSS at start {rss0 / 1024:.1f} MiB")
        print(f"{'inputs':>9} {'RSS MiB':>8} {'queues':>7} {'data dir MiB':>12} {'s':>6}")
        started = time.monotonic()
        marks = {args.inputs * i // 10 for i in range(1, 11)}
        baseline = args.baseline or min(marks)
        marks.add(baseline)
        at: dict[int, int] = {}
        idle_first = 0
        sent = 0
        while sent < args.inputs:
            before = sent
            batches = []
            while sent < args.inputs and len(batches) < parallel:
                proto = r.choices(["memcache", "text", "rpc"], [6, 2, 2])[0]
                n = min(args.per_conn, args.inputs - sent)
                gen = GENERATORS[proto]
                batches.append((ports[proto], b"".join(gen(r) for _ in range(n))))
                sent += n
            list(pool.map(lambda b: send_batch(*b), batches))
            for m in sorted(marks):
                if before < m <= sent:
                    rss = kib_field(f"/proc/{proc.pid}/status", "VmRSS") or 0
                    at[m] = rss
                    queues = queue_count(ports["http"], login)
                    size = dir_size(tmp / "data")
                    print(f"{m:>9} {rss / 1024:>8.1f} {queues:>7} {size / 2**20:>12.1f} "
                          f"{time.monotonic() - started:>6.0f}", flush=True)
                    if m == baseline:
                        idle_first = idle_rss(proc.pid, args.idle)
        if proc.poll() is not None:
            raise SystemExit(f"the server died: {(tmp / 'server.log').read_text()[-2000:]}")
        first, last = at[baseline], at[max(at)]
        print(f"RSS after {max(at)} inputs / after {baseline}, as read: {last / first:.3f} "
              f"({last / 1024:.1f} / {first / 1024:.1f} MiB)")
        idle_last = idle_rss(proc.pid, args.idle)
        print(f"after {args.idle:g} s idle (the heap trim has run; transient peaks, e.g. a "
              f"`stats` reply of every queue, are gone): {idle_first / 1024:.1f} MiB after "
              f"{baseline} inputs, {idle_last / 1024:.1f} MiB after {max(at)}: "
              f"{idle_last / idle_first:.3f} (target <= 1.10)")
    finally:
        pool.shutdown()
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recording("fuzz_rss"):
        main()
