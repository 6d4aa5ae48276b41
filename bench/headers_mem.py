#!/usr/bin/env python3
"""Memory per item held in a queue, with and without headers, and per header.

For each mode a fresh `queued serve` (fsync never, max_memory_size 1 GiB so every item
stays in memory) takes N items of 64 B over raw MessagePack-RPC in puts of 1,000; its
VmRSS is read before and after (once the puts are answered and the server is idle), and
the growth divided by N is the memory per held item. Modes: `none` (no headers), `2` (a
W3C `traceparent` of its own per item and a `tenant`), `8` (those and six short ones).
Per header: (mode - none) / N / headers. Prints numbers, asserts nothing.

`--queued-tree DIR` runs the server from another checkout (PYTHONPATH), for a
before/after comparison of items without headers (servers before headers do `none` only).

Usage:  .venv/bin/python bench/headers_mem.py [--items 200000] [--modes none,2,8]
                                              [--queued-tree DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
from benchlib import QueuedServer, recording

HOST = "127.0.0.1"
BATCH = 1000


def headers_for(mode: str, i: int) -> dict[str, str] | None:
    if mode == "none":
        return None
    trace = f"00-{i:032x}-{i * 7919 % 2**64:016x}-01"  # one per item, as tracing makes them
    h = {"traceparent": trace, "tenant": "acme"}
    if mode == "8":
        h.update({f"x-{k}": f"v{k}" for k in range(6)})
    return h


class Rpc:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=60)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0

    def call(self, method: str, *params: Any) -> Any:
        self.msgid += 1
        self.sock.sendall(msgpack.packb([0, self.msgid, method, list(params)]))
        while True:
            for msg in self.unpacker:
                if msg[2] is not None:
                    raise RuntimeError(f"{method}: {msg[2]}")
                return msg[3]
            data = self.sock.recv(1 << 20)
            if not data:
                raise RuntimeError("closed")
            self.unpacker.feed(data)


def measure(mode: str, n: int, tree: Path | None) -> tuple[float, float]:
    """(KiB of RSS before, bytes per held item)."""
    with tempfile.TemporaryDirectory(prefix="headers-mem-") as where, \
            QueuedServer(where, "never", config='[queues.held]\nmax_memory_size = "1GiB"\n',
                         tree=tree) as server:
        c = Rpc(server.ports["rpc"])
        for _ in range(3):  # warm up: code paths, the reactor's buffers
            c.call("put", "warm", [b"x" * 64] * BATCH)
            c.call("get", "warm", BATCH)
        time.sleep(1.0)
        before = server.rss_kib() or 0
        item = b"x" * 64
        for start_at in range(0, n, BATCH):
            k = min(BATCH, n - start_at)
            if mode == "none":
                c.call("put", "held", [item] * k)
            else:
                c.call("put", "held", [item] * k, 0, 0, 0, None, 0, None,
                       [headers_for(mode, start_at + j) for j in range(k)])
        time.sleep(2.0)  # idle: the checkpoint round and packing are done
        after = server.rss_kib() or 0
        stats = c.call("stats")["queues"]["held"]
        assert stats["items"] == n, stats
        server.stop(kill=True)
    return before, (after - before) * 1024 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--modes", default="none,2,8")
    ap.add_argument("--queued-tree", type=Path, default=None)
    a = ap.parse_args()
    tree = a.queued_tree.resolve() if a.queued_tree is not None else None
    print(f"# headers_mem: {a.items} items of 64 B held, server from "
          f"{tree or 'this tree'}; load average {os.getloadavg()[0]:.2f}")
    per: dict[str, float] = {}
    for mode in a.modes.split(","):
        base, per[mode] = measure(mode, a.items, tree)
        print(f"{mode:>5} headers: RSS idle {base / 1024:.1f} MiB, {per[mode]:.1f} B per held item",
              flush=True)
    for mode, b in per.items():
        if mode != "none" and "none" in per:
            print(f"{mode:>5} headers: +{b - per['none']:.1f} B per item, "
                  f"{(b - per['none']) / int(mode):.1f} B per header")


if __name__ == "__main__":
    with recording("headers_mem"):
        main()
