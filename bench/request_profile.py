"""Where a request's server time goes: py-spy samples of a server under one workload,
grouped by layer, with the server's CPU per request.

Starts `queued serve` (a temp data dir, 127.0.0.1, free ports), runs one workload from
this process over plain sockets (no client library in the way), records the server with
py-spy (`--gil`: only the samples in which a thread of the server holds the GIL, i.e.
its Python work, not the time it spends in syscalls with the GIL released) and prints
the share of each layer (by the innermost Python frame of each sample) and the
server's user and system CPU per request (from /proc, without py-spy attached: the
workload runs twice, once measured, once profiled).

    python bench/request_profile.py [--workload set] [--conns 32] [--requests N]
        [--fsync never] [--top 25] [--raw FILE] [--no-profile] [--queued-cmd CMD]

--no-profile: the CPU per request only, without py-spy. --queued-cmd: start another build
(QUEUED_CMD's placeholders, as vs_darner.py's): the compiled one is
`env PYTHONPATH=build/compiled .venv/bin/queued serve ...` (docs/development.md).

Workloads (64 B items, queue `q`; every connection has one request in flight):

  set             memcache `set`, one item per request
  fanin           memcache `set`s, 8 pipelined per connection, each to the next of 100
                  queues (`f0`..`f99`): vs_darner's fan-in shape
  get             memcache `get` (the queue is filled first)
  rpc-put         MessagePack-RPC `put` of 100 items per request
  rpc-put-idem    the same put as the client sends it by default (idempotent): a producer
                  id per connection and the next sequence
  rpc-getconfirm  RPC `get` of 100 items (auto_abort 30 s) then `confirm` of them

py-spy (https://github.com/benfred/py-spy) must be on PATH or beside this Python:
`pip install py-spy`. It reads the server's memory through ptrace: run as root or with
ptrace allowed.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgpack
from benchlib import QUEUED_CMD, CpuWindow, QueuedServer, recording

HOST = "127.0.0.1"
ITEM = b"x" * 64
RPC_BATCH = 100

#: (layer, path fragments of the innermost frame's file); the first match wins
LAYERS = [
    ("socket I/O: transport, trio's epoll and sockets",
     ["queued/server/transport.py", "trio/_core/_io_epoll.py", "trio/_socket.py",
      "trio/_highlevel_socket.py", "socket.py"]),
    ("trio: scheduler, cancel scopes, events", ["trio/", "outcome/", "contextlib.py"]),
    ("protocol: parse requests, encode replies",
     ["queued/wire/parsing.py", "queued/wire/memcache_", "queued/wire/rpc_",
      "queued/wire/commands.py", "queued/wire/text_protocol.py", "msgpack/"]),
    ("session: batches, replies, auth", ["queued/server/"]),
    ("broker: queues, reliable reads, limits", ["queued/broker/"]),
    ("queue: readers, held items, open reads",
     ["queued/reader/state.py", "queued/reader/packed_items.py", "queued/reader/open_reads.py"]),
    ("journal and writer: records, writes, fsync rounds",
     ["queued/storage/", "queued/journal/"]),
]


def layer_of(frame: str) -> str:
    for name, parts in LAYERS:
        if any(p in frame for p in parts):
            return name
    return "other: stats, dataclass inits, builtins' callers"


# -- the workloads ---------------------------------------------------------------------------


class Conn:
    """One connection with one request in flight at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0
        self.producer = secrets.token_bytes(16)  # rpc-put-idem: its producer id
        self.sequence = 0  # and its last sequence

    def until(self, end: bytes) -> bytes:
        while not self.buf.endswith(end):
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        out, self.buf = self.buf, b""
        return out

    def call(self, method: str, params: list[object]) -> None:
        self.msgid += 1
        self.sock.sendall(msgpack.packb([0, self.msgid, method, params]))

    def reply(self) -> object:
        while True:
            for msg in self.unpacker:
                if msg[2] is not None:
                    raise RuntimeError(f"server error: {msg[2]}")
                return msg[3]
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.unpacker.feed(chunk)


def run_rounds(conns: list[Conn], workload: str, requests: int) -> int:
    """Each round sends one request on every connection, then reads every reply;
    returns the items moved."""
    items = 0
    rounds = max(1, requests // len(conns))
    set_req = b"set q 0 0 %d\r\n%s\r\n" % (len(ITEM), ITEM)
    fan = [b"".join(b"set f%d 0 0 %d\r\n%s\r\n" % ((8 * k + j) % 100, len(ITEM), ITEM)
                    for j in range(8)) for k in range(25)]
    if workload == "fanin":
        rounds = max(1, rounds // 8)
    for r in range(rounds):
        if workload == "fanin":
            for i, c in enumerate(conns):
                c.sock.sendall(fan[(r + i) % 25])
            for c in conns:
                while c.buf.count(b"STORED\r\n") < 8:
                    c.buf += c.sock.recv(65536)
                c.buf = b""
            items += 8 * len(conns)
        elif workload == "set":
            for c in conns:
                c.sock.sendall(set_req)
            for c in conns:
                c.until(b"STORED\r\n")
            items += len(conns)
        elif workload == "get":
            for c in conns:
                c.sock.sendall(b"get q\r\n")
            for c in conns:
                items += c.until(b"END\r\n").startswith(b"VALUE")
        elif workload == "rpc-put":
            for c in conns:
                c.call("put", ["q", [ITEM] * RPC_BATCH])
            for c in conns:
                items += int(c.reply())  # type: ignore[call-overload]
        elif workload == "rpc-put-idem":
            for c in conns:
                c.sequence += 1
                c.call("put", ["q", [ITEM] * RPC_BATCH, 0, 0, 0, c.producer, c.sequence])
            for c in conns:
                count, _first_id, duplicate = c.reply()  # type: ignore[misc]
                if duplicate:
                    raise RuntimeError("a put with a new sequence was taken for a duplicate")
                items += count
        else:
            for c in conns:
                c.call("get", ["q", RPC_BATCH, 0, 30000])
            got = []
            for c in conns:
                got.append(c.reply())
            for c, batch in zip(conns, got, strict=True):
                c.call("confirm", ["q", [i for i, _ in batch]])  # type: ignore[attr-defined]
                items += len(batch)  # type: ignore[arg-type]
            for c in conns:
                c.reply()
    return items


def fill(port: int, n: int) -> None:
    c = Conn(port)
    for _ in range(0, n, 1000):
        c.call("put", ["q", [ITEM] * 1000])
        c.reply()
    c.sock.close()


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        sys.exit("py-spy not found: pip install py-spy")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="set",
                    choices=["set", "fanin", "get", "rpc-put", "rpc-put-idem",
                             "rpc-getconfirm"])
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per phase (default 64,000; RPC 4,000, of 100 items each: "
                         "what a get+confirm phase reads stays within max_memory_size)")
    ap.add_argument("--fsync", default="never")
    ap.add_argument("--top", type=int, default=25, help="functions to list by self time")
    ap.add_argument("--raw", default=None, help="keep py-spy's raw output in this file")
    ap.add_argument("--no-profile", action="store_true",
                    help="only the server's CPU per request: no py-spy run")
    ap.add_argument("--queued-cmd", default=QUEUED_CMD,
                    help="the command that starts queued (placeholders as QUEUED_CMD's)")
    a = ap.parse_args()
    spy = None if a.no_profile else py_spy()
    rpc = a.workload.startswith("rpc")
    if a.requests is None:
        a.requests = 4000 if rpc else 64000
    with tempfile.TemporaryDirectory(prefix="request-profile-") as tmp, \
            QueuedServer(tmp, a.fsync, cmd=a.queued_cmd) as server:
        port = server.ports["rpc"] if rpc else server.port
        items_per_request = RPC_BATCH if rpc else 1
        if a.workload in ("get", "rpc-getconfirm"):  # both phases need items
            fill(server.ports["rpc"], 2 * a.requests * items_per_request + 1000)
        conns = [Conn(port) for _ in range(a.conns)]
        run_rounds(conns, a.workload, min(a.requests, 2000))  # warm up
        cpu = CpuWindow(server.pid)
        items = run_rounds(conns, a.workload, a.requests)
        cpu.stop()
        requests = a.requests // a.conns * a.conns
        print(f"# request_profile: {a.workload}, {a.conns} connections x 1 request in flight, "
              f"fsync {a.fsync}, {requests:,} requests ({items:,} items) in {cpu.wall_s:.2f} s: "
              f"{requests / cpu.wall_s:,.0f} requests/s")
        per = 1e6 / requests
        print(f"server CPU per request: user {cpu.user_s * per:.1f} us, system "
              f"{cpu.sys_s * per:.1f} us"
              + (f" (per item: {cpu.cpu_s * per / RPC_BATCH:.2f} us)" if rpc else ""))
        if spy is None:
            return
        raw = a.raw or str(Path(tmp) / "profile.txt")
        recorder = subprocess.Popen([spy, "record", "--pid", str(server.pid), "--gil",
                                     "--rate", "1000", "--format", "raw", "--output", raw],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
        run_rounds(conns, a.workload, a.requests)
        recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        recorder.wait(timeout=60)
        report(Path(raw), a.top)


def report(raw: Path, top: int) -> None:
    """Shares by layer and the top functions by self time, from py-spy's raw format
    (one line per distinct stack: frames joined by ';', then the sample count)."""
    layers: Counter[str] = Counter()
    funcs: Counter[str] = Counter()
    total = 0
    if not raw.exists():
        print("py-spy recorded no samples (it wrote nothing: may it ptrace the server?)")
        return
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        inner = stack.split(";")[-1]
        total += int(count)
        layers[layer_of(inner)] += int(count)
        func, _, where = inner.partition(" (")
        path = where.rsplit(":", 1)[0]
        if "site-packages/" in path:
            path = path.split("site-packages/", 1)[1]
        elif "/queued/" in path:
            path = "queued/" + path.split("/queued/", 1)[1]
        funcs[f"{func} ({path})"] += int(count)
    if not total:
        print("py-spy recorded no samples")
        return
    print(f"\n{total:,} samples with the GIL held; share by the layer of the innermost frame:\n")
    print("| layer | share |\n|---|---:|")
    for layer, n in layers.most_common():
        print(f"| {layer} | {100 * n / total:.1f} % |")
    print(f"\ntop {top} functions by self time:\n")
    for func, n in funcs.most_common(top):
        print(f"{100 * n / total:5.1f} %  {func}")


if __name__ == "__main__":
    with recording("request_profile"):
        main()
