"""The servers a benchmark runs against, started in one place: `queued serve` (this build or
any other, any config file, flags, environment, TLS) here, and the peers it is compared
with (peers.py) on the same base class.

Each is a process on a fresh temp data dir (or one the caller owns) and 127.0.0.1 ports,
stopped by PID (SIGTERM, then SIGKILL) with its dir and log removed; any still running
when the interpreter exits is stopped then. queued binds port 0 and its ports are read
from its log; a peer gets a free port chosen beforehand and is ready when it accepts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from .measure import RssSampler, hwm_kib, proc_cpu_s, rss_kib

HOST = "127.0.0.1"
QUEUED = Path(sys.executable).with_name("queued")  # the tree of the venv running the bench
#: The command that starts queued; another build's (an older venv, `env PYTHONPATH=...`)
#: has the same placeholders. Every port is 0: the server logs what it bound.
QUEUED_CMD = (f"{QUEUED} serve --data-dir {{data_dir}} --host {HOST} "
              "--memcache-port {memcache_port} --text-port {text_port} --rpc-port {rpc_port} "
              "--http-port {http_port} --fsync {fsync}")
LISTENING = re.compile(rb"listening for (\w+) on [^\s:]+:(\d+)")
READY = re.compile(rb"\bready: \w+ on port \d+")

LIVE: set[Server] = set()  # started and not stopped yet


def stop_all() -> None:
    """Stops every server still running (atexit does it too)."""
    for s in list(LIVE):
        with contextlib.suppress(Exception):
            s.stop()
        LIVE.discard(s)


atexit.register(stop_all)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[bytes], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def tls_connect(sock: socket.socket, ca: str) -> ssl.SSLSocket:
    """`sock` after a blocking client handshake, verifying the server with `ca`."""
    return ssl.create_default_context(cafile=ca).wrap_socket(sock, server_hostname=HOST)


class Server:
    """One server process. `start()` returns once it serves; `stop()` (or leaving the
    `with` block) stops it by PID and removes what it owns."""

    name = "?"
    protocol = "?"
    tls_ca: str | None = None  # the server speaks TLS; clients verify it with this CA

    def __init__(self, root: Path | str | None = None, fsync: str = "none", *,
                 data_dir: Path | None = None, log_path: Path | None = None,
                 env: dict[str, str] | None = None, rss_interval: float | None = None,
                 start_timeout: float = 60.0, stop_timeout: float = 10.0) -> None:
        self.fsync = fsync
        self.root = Path(root or tempfile.gettempdir())
        self.owns_dir = data_dir is None
        self.dir = (Path(tempfile.mkdtemp(prefix=f"{self.name}-{fsync}-", dir=self.root))
                    if data_dir is None else data_dir)
        self.owns_log = log_path is None
        self.log_path = log_path or self.dir.with_suffix(".log")
        self.extra_env = env or {}
        self.rss_interval = rss_interval
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.sampler: RssSampler | None = None
        self.max_rss_kib = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.extra_env}

    def wait_ready(self, cmd: list[str]) -> None:
        assert self.proc is not None
        if not wait_port(self.port, self.proc, self.start_timeout):
            self.fail(cmd, f"did not accept connections on {self.port}")

    def fail(self, cmd: list[str], what: str) -> None:
        rc = self.proc.poll() if self.proc is not None else None
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} {what} within {self.start_timeout:g} s (exit code "
                           f"{rc}); command: {' '.join(cmd)}\nlog tail:\n{tail}")

    def start(self) -> Server:
        cmd = self.command()
        LIVE.add(self)
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.root,
                                         env=self.environ())
        self.wait_ready(cmd)
        if self.rss_interval:
            self.sampler = RssSampler(self.pid, self.rss_interval)
            self.sampler.start()
        return self

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_s(self) -> float:
        """The server's user + system CPU seconds so far (all threads)."""
        return proc_cpu_s(self.pid)

    def rss_kib(self) -> int | None:
        return rss_kib(self.pid)

    def hwm_kib(self) -> int | None:
        """Peak RSS so far (VmHWM)."""
        return hwm_kib(self.pid)

    def memory_kib(self) -> dict[str, int]:
        """VmHWM (peak RSS) and VmRSS of the server, KiB (those there are)."""
        out = {"VmHWM": hwm_kib(self.pid), "VmRSS": rss_kib(self.pid)}
        return {k: v for k, v in out.items() if v is not None}

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + t for t in text[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def stop(self, *, kill: bool = False, keep: bool = False) -> None:
        """SIGTERM and up to stop_timeout s for it to exit, then SIGKILL (`kill`: SIGKILL at
        once). Removes the data dir and log it made, unless `keep` (a restart on it)."""
        if self.sampler is not None:
            self.sampler.stop()
            self.max_rss_kib = max(self.max_rss_kib, self.sampler.max_kib)
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(10)
        LIVE.discard(self)
        if keep:
            return
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.owns_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


class MemcacheServer(Server):
    """A Kestrel-protocol server: `stats` has `queue_<q>_items`, `delete <q>` drops q."""

    protocol = "memcache"

    def request(self, data: bytes, done: Any, seconds: float = 10) -> bytes:
        """One blocking request/reply on a fresh connection, read until done(reply)."""
        with socket.create_connection((HOST, self.port), timeout=seconds) as plain, \
                (plain if self.tls_ca is None else tls_connect(plain, self.tls_ca)) as s:
            s.sendall(data)
            buf = b""
            while not done(buf):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            return buf

    def queue_stats(self, queue: str) -> dict[str, str]:
        reply = self.request(b"stats\r\n", lambda b: b.endswith(b"END\r\n"))
        prefix = f"STAT queue_{queue}_".encode()
        out: dict[str, str] = {}
        for line in reply.split(b"\r\n"):
            if line.startswith(prefix):
                k, _, v = line[len(prefix):].partition(b" ")
                out[k.decode()] = v.decode()
        return out

    def backlog(self, queue: str) -> int | None:
        return self.total_items([queue])

    def total_items(self, queues: list[str]) -> int | None:
        """Items in `queues` together, from one `stats`; None if it lists none of them."""
        reply = self.request(b"stats\r\n", lambda b: b.endswith(b"END\r\n"))
        keys = {f"STAT queue_{q}_items".encode() for q in queues}
        counts = [int(value) for key, _, value in
                  (line.rpartition(b" ") for line in reply.split(b"\r\n")) if key in keys]
        return sum(counts) if counts else None

    def delete(self, queue: str) -> None:
        self.request(b"delete %s\r\n" % queue.encode(), lambda b: b.endswith(b"\r\n"))


class QueuedServer(MemcacheServer):
    """`queued serve`: `cmd` is a command template (QUEUED_CMD's placeholders; default this
    venv's queued), `config` the text of a TOML config file, `args` more flags, `env` more
    environment (QUEUED_* variables of ours are not passed on), `certs` TLS on every
    listener, `tree` a source tree to import queued from (PYTHONPATH). `ports` has every
    listener's port by protocol once started; `port` is memcache's, `address` the RPC one
    (what queued.client takes)."""

    name = "queued"

    def __init__(self, root: Path | str | None = None, fsync: str = "always", *,
                 cmd: str | None = None, config: str | None = None,
                 args: tuple[str, ...] | list[str] = (), certs: BenchCerts | None = None,
                 tree: Path | None = None, name: str | None = None, **kw: Any) -> None:
        if name is not None:
            self.name = name
        elif certs is not None:
            self.name = "queued-tls"
        super().__init__(root, fsync, **kw)
        self.cmd = cmd or QUEUED_CMD
        self.args = list(args)
        self.certs = certs
        self.tls_ca = certs.ca if certs is not None else None
        # (absolute: the server runs in `root`, where a relative PYTHONPATH would miss
        # the build and import the venv's pure Python instead, without a word)
        self.tree = tree.resolve() if tree is not None else None
        self.ports: dict[str, int] = {}
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = self.dir.with_suffix(".toml")
            self.config_path.write_text(config)

    def command(self) -> list[str]:
        cmd = self.cmd.format(data_dir=self.dir, memcache_port=0, text_port=0, rpc_port=0,
                              http_port=0, fsync=self.fsync).split()
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        if self.certs is not None:
            cmd += self.certs.server_args()
        return cmd + self.args

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUED_")}
        if self.tree is not None:  # the venv's `queued` script imports it from there
            env["PYTHONPATH"] = str(self.tree)
        return {**env, **self.extra_env}

    def wait_ready(self, cmd: list[str]) -> None:
        """Until the log says `ready:` (recovery done, every listener accepting)."""
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            log = self.log_path.read_bytes()
            if READY.search(log):
                self.ports = {k.decode(): int(v) for k, v in LISTENING.findall(log)}
                self.port = self.ports.get("memcache", 0)
                return
            time.sleep(0.02)
        self.fail(cmd, "did not log `ready:`")

    @property
    def address(self) -> str:
        return f"{HOST}:{self.ports['rpc']}"

    def stop(self, *, kill: bool = False, keep: bool = False) -> None:
        super().stop(kill=kill, keep=keep)
        if self.config_path is not None and not keep:
            with contextlib.suppress(OSError):
                self.config_path.unlink()


def queued_available(cmd: str = QUEUED_CMD) -> tuple[bool, str]:
    """Whether `cmd` can start queued: (True, "") or (False, why). Only the default command
    is tried (`queued serve --help`)."""
    if cmd != QUEUED_CMD:
        return True, "custom command"
    try:
        p = subprocess.run([str(QUEUED), "serve", "--help"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, repr(exc)
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        return False, lines[-1] if lines else f"exit code {p.returncode}"
    return True, ""


def start_server(data_dir: Path, log: Path, max_queues: int | None = None,
                 extra_args: tuple[str, ...] = (), users_file: Path | None = None,
                 park_after: int | None = None, fsync: str = "never",
                 ) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """queued on `data_dir` (the caller's; `log` its log file), fsync never unless said:
    (its process, its ports by protocol). The caller stops the process."""
    env = {}
    if max_queues is not None:
        env["QUEUED_MAX_QUEUES"] = str(max_queues)
    if users_file is not None:
        env["QUEUED_USERS_FILE"] = str(users_file)
    if park_after is not None:
        env["QUEUED_PARK_AFTER"] = str(park_after)
    server = QueuedServer(data_dir.parent, fsync, data_dir=data_dir, log_path=log,
                          args=extra_args, env=env)
    server.start()
    assert server.proc is not None
    return server.proc, server.ports


class BenchCerts:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, as PEM files in
    `where`, for benchmarks over TLS (trustme, from the test extras; made once per run)."""

    def __init__(self, where: str | Path) -> None:
        import trustme

        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        self.ca = os.path.join(where, "bench-ca.pem")
        self.cert = os.path.join(where, "bench-server.pem")
        self.key = os.path.join(where, "bench-server.key")
        ca.cert_pem.write_to_path(self.ca)
        leaf.private_key_pem.write_to_path(self.key)
        with open(self.cert, "wb") as f:
            f.write(b"".join(p.bytes() for p in leaf.cert_chain_pems))

    def server_args(self) -> list[str]:
        """The `queued serve` flags that turn TLS on for every listener."""
        return ["--tls-cert", self.cert, "--tls-key", self.key]
