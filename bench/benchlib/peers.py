"""The peers queued is measured against, on servers.py's base class: darner (C++,
Kestrel's memcache protocol; built from /work/shared/peers when missing) and Debian's
redis-server. Each gets a free port chosen beforehand and is ready when it accepts.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from .servers import HOST, MemcacheServer, Server, free_port

PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
DARNER = PEERS / "darner" / "build" / "darner"
DARNER_BUILD = Path("/work/shared/peers/build-darner.sh")


def resp_command(*args: bytes) -> bytes:
    """One redis command in RESP."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class RedisServer(Server):
    """redis-server (Debian's package) with its AOF: fsync `always` is appendfsync always,
    anything else appendfsync no."""

    name = "redis"
    protocol = "resp"

    def command(self) -> list[str]:
        self.port = free_port()
        return ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "",
                "--appendonly", "yes",
                "--appendfsync", "always" if self.fsync == "always" else "no",
                "--dir", str(self.dir), "--daemonize", "no"]

    def request(self, data: bytes) -> bytes:
        with socket.create_connection((HOST, self.port), timeout=10) as s:
            s.sendall(data)
            buf = b""
            while b"\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            return buf

    def backlog(self, queue: str) -> int | None:
        reply = self.request(resp_command(b"LLEN", queue.encode()))
        return int(reply[1:reply.index(b"\r\n")]) if reply.startswith(b":") else None

    def delete(self, queue: str) -> None:
        self.request(resp_command(b"DEL", queue.encode()))


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


class DarnerServer(MemcacheServer):
    """darner (C++, Kestrel's memcache protocol; never fsyncs a plain set)."""

    name = "darner"

    def __init__(self, root: Path | str | None = None, binary: Path = DARNER,
                 **kw: Any) -> None:
        super().__init__(root, "none", **kw)
        self.binary = binary

    def command(self) -> list[str]:
        self.port = free_port()
        return [str(self.binary), "-p", str(self.port), "-d", str(self.dir)]


def ensure_darner(binary: Path = DARNER, script: Path = DARNER_BUILD) -> str:
    """Builds darner with the peers script if the binary is missing; returns its version."""
    if not binary.exists():
        print(f"darner not found at {binary}: building it with {script} (PEERS={PEERS})",
              flush=True)
        subprocess.run(["bash", str(script)], env={**os.environ, "PEERS": str(PEERS)},
                       check=True, timeout=1800)
    p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10)
    return (p.stdout or p.stderr).strip() or "?"
