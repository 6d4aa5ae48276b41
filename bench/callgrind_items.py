#!/usr/bin/env python3
"""Instructions per item: the server under valgrind's callgrind, counting the instructions
its process runs (every thread, user space; the kernel's share is not counted) while a
load client sends a fixed number of memcache sets. An instruction count does not move
with the machine's speed as CPU time does, so an A/B of two builds shows a change of
about 1 % (the same build measured twice on an idle machine: within 0.2 % at fan-in; run
them on an idle machine, since a busy one changes how many requests a pass holds); it
says nothing of system calls or of the time the server waits.

Each server starts under callgrind (about 50 times slower), takes `--warm` sets (its
queues made, its caches filled), then the counters are zeroed (`callgrind_control -z`),
the `--items` sets are sent, and the counters are dumped (`callgrind_control -d`). Shapes
(`--workload`, several comma-separated):

- `fanin`: 4 connections x 8 sets in flight, each to the next of 100 queues (one item
  per queue a pass touches);
- `many`: 64 connections x 1 in flight, one queue (the server is slow under callgrind,
  so a pass holds more requests than it would at full speed);
- `latency`: 1 connection x 1 in flight (a pass per set: every cost of a pass is in it);
- `rpc-put`: 4 MessagePack-RPC connections x 1 `put` of 100 items in flight, one queue;
- `rpc-getconfirm`: the same, a `get` of 100 (a reliable read) then their `confirm`, on a
  queue filled first by such puts (not counted).

An RPC shape's count is per item (100 a request); `--items` and `--warm` count requests.

`--tree` (repeatable) runs another build: a tree put first on PYTHONPATH
(`build/compiled`, a copy of an older build); the default is this venv's `queued` as it
imports. The dump files are kept with `--keep DIR` (read them with `callgrind_annotate`).
Needs valgrind (`apt-get install valgrind`).

    python bench/callgrind_items.py [--workload fanin,many,latency] [--items 4000]
        [--tree build/compiled --tree /tmp/old-build] [--fsync never]
"""

from __future__ import annotations

import argparse
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import recording
from benchlib.servers import HOST, QUEUED, QueuedServer

#: workload -> (connections, sets in flight on each, queues)
SHAPES = {"fanin": (4, 8, 100), "many": (64, 1, 1), "latency": (1, 1, 1),
          "rpc-put": (4, 1, 1), "rpc-getconfirm": (4, 1, 1)}
TOTALS = re.compile(rb"^(?:summary|totals): (\d+)", re.M)
PAYLOAD = b"x" * 64
LOAD_SECONDS = 600.0  # bound of one load phase (callgrind is slow, not that slow)


def load(port: int, conns: int, depth: int, queues: int, total: int) -> int:
    """`total` sets, `depth` in flight on each of `conns` connections, queue after queue;
    the number answered STORED."""
    socks = [socket.create_connection((HOST, port), timeout=30) for _ in range(conns)]
    ep = select.epoll()
    sent = done = 0
    pending: dict[int, bytes] = {}
    by_fd: dict[int, socket.socket] = {}

    def requests(n: int) -> bytes:
        nonlocal sent
        out = []
        for _ in range(n):
            sent += 1
            out.append(b"set bench_%d 0 0 64\r\n%s\r\n" % (sent % queues, PAYLOAD))
        return b"".join(out)

    try:
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            ep.register(s.fileno(), select.EPOLLIN)
            by_fd[s.fileno()] = s
            pending[s.fileno()] = b""
            s.sendall(requests(min(depth, total - sent)))
        end = time.monotonic() + LOAD_SECONDS
        while done < total and time.monotonic() < end:
            for fd, _ in ep.poll(1.0):
                s = by_fd[fd]
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("the server closed a connection")
                buf = pending[fd] + chunk
                k = buf.count(b"STORED\r\n")
                if k:
                    cut = buf.rfind(b"STORED\r\n") + 8
                    if buf[:cut].replace(b"STORED\r\n", b""):
                        raise RuntimeError(f"unexpected reply: {buf[:cut][:80]!r}")
                    buf = buf[cut:]
                    done += k
                    more = min(k, total - sent)
                    if more > 0:
                        s.setblocking(True)
                        s.sendall(requests(more))
                        s.setblocking(False)
                pending[fd] = buf
    finally:
        ep.close()
        for s in socks:
            s.close()
    return done


def control(flag: str, pid: int) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True,
                   timeout=60)


def rpc_load(server: QueuedServer, workload: str, warm: int, requests: int) -> int:
    """An RPC shape's warm-up and counted requests (request_profile.py's clients); the
    items the counted requests moved."""
    from request_profile import RPC_BATCH, Conn, run_rounds

    n = SHAPES[workload][0]
    conns = [Conn(server.ports["rpc"]) for _ in range(n)]

    def moves(count: int) -> int:  # (run_rounds sends whole rounds, one per connection)
        return max(1, count // n) * n * RPC_BATCH

    try:
        if workload == "rpc-getconfirm":  # items to take: the warm-up's and the count's
            run_rounds(conns, "rpc-put", warm + requests + n)
        if run_rounds(conns, workload, warm) != moves(warm):
            raise RuntimeError("the warm-up's requests did not all move their items")
        control("-z", server.pid)
        moved = run_rounds(conns, workload, requests)
        control("-d", server.pid)
    finally:
        for c in conns:
            c.sock.close()
    if moved != moves(requests):
        raise RuntimeError(f"{moved} of {moves(requests)} items moved")
    return moved


def measure(tree: Path | None, workload: str, items: int, warm: int, fsync: str,
            root: Path, keep: Path | None) -> int:
    """Instructions per set of `workload` for the build in `tree` (None: this venv's)."""
    conns, depth, queues = SHAPES[workload]
    out = root / f"cg-{workload}-{int(time.time() * 1000)}.out"
    cmd = (f"valgrind --tool=callgrind --callgrind-out-file={out} {sys.executable} {QUEUED} "
           "serve --data-dir {data_dir} --host 127.0.0.1 --memcache-port 0 --text-port 0 "
           "--rpc-port 0 --http-port 0 --fsync {fsync}")
    server = QueuedServer(root, fsync, cmd=cmd, tree=tree, start_timeout=300)
    with server:
        pid = server.pid
        if workload.startswith("rpc-"):
            items = rpc_load(server, workload, warm, items)
        else:
            if load(server.port, conns, depth, queues, warm) != warm:
                raise RuntimeError("the warm-up's sets were not all stored")
            control("-z", pid)
            stored = load(server.port, conns, depth, queues, items)
            control("-d", pid)
            if stored != items:
                raise RuntimeError(f"{stored} of {items} sets stored")
        dumps = sorted(root.glob(out.name + ".*"))
        deadline = time.monotonic() + 60
        while not dumps and time.monotonic() < deadline:
            time.sleep(0.2)
            dumps = sorted(root.glob(out.name + ".*"))
        counts = [int(m[1]) for d in dumps for m in [TOTALS.search(d.read_bytes())] if m]
    if not counts:
        raise RuntimeError(f"callgrind wrote no dump with totals ({out}.*)")
    for path in root.glob(out.name + "*"):
        if keep is not None:
            shutil.copy(path, keep / path.name)
        path.unlink()
    return sum(counts) // items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="fanin,many,latency",
                    help=f"comma-separated, of {','.join(SHAPES)}")
    ap.add_argument("--items", type=int, default=4000, help="sets counted (default 4000)")
    ap.add_argument("--warm", type=int, default=400, help="sets before the count")
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="a build to run (PYTHONPATH); repeat for an A/B; default: this venv's")
    ap.add_argument("--fsync", default="never")
    ap.add_argument("--runs", type=int, default=1, help="runs per build and workload")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the run's temp dir goes (data dirs, dumps; default /tmp)")
    ap.add_argument("--keep", type=Path, default=None, help="copy the dumps here")
    a = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("callgrind_items: needs valgrind (apt-get install valgrind)")
    workloads = [w for w in a.workload.split(",") if w]
    unknown = set(workloads) - set(SHAPES)
    if unknown:
        raise SystemExit(f"unknown workload(s): {', '.join(sorted(unknown))}")
    trees: list[Path | None] = list(a.tree) or [None]
    if a.keep is not None:
        a.keep.mkdir(parents=True, exist_ok=True)
    with recording("callgrind_items"), tempfile.TemporaryDirectory(
            prefix="callgrind-items-", dir=a.dir) as tmp:
        root = Path(tmp)
        print(f"instructions per set (callgrind, user space, every thread), fsync {a.fsync}, "
              f"{a.items} sets counted after {a.warm} (RPC shapes: requests; per item)")
        print("| build | workload | connections x in flight, queues | instructions per set |")
        print("|---|---|---|---:|")
        for workload in workloads:
            conns, depth, queues = SHAPES[workload]
            for tree in trees:
                for _ in range(a.runs):
                    per = measure(tree, workload, a.items, a.warm, a.fsync, root, a.keep)
                    print(f"| {tree or 'this venv'} | {workload} | {conns} x {depth}, {queues} "
                          f"| {per:,} |", flush=True)


if __name__ == "__main__":
    main()
