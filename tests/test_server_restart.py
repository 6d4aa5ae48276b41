"""Restart tests: `queued serve` as a subprocess, killed (SIGKILL) or stopped, then restarted.

Acknowledged items must survive a kill -9; open reads come back after any restart;
confirmed items do not, provided a checkpoint was written after the confirm (delivery
is at-least-once: the tests wait several checkpoint intervals before killing).
SIGTERM, SIGINT and the `shutdown` command stop the server cleanly with exit code 0.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_util import (
    ServerProcess,
    data_files,
    gets_until_dry,
    http_get,
    killed_at_end,
    pymc,
    send_lines,
)

pytestmark = pytest.mark.slow

CHECKPOINT_MS = 100
CONFIG = f"""
[server]
checkpoint_interval = "{CHECKPOINT_MS}ms"

[default]
fsync = "always"

[queues.p]
max_memory_size = "1KiB"  # the restarted backlog is mostly read back from disk
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A ServerProcess (not yet started) that is always SIGKILLed by PID at the end."""
    yield from killed_at_end(tmp_path, CONFIG)


def wait_past_checkpoints() -> None:
    """Long enough for several checkpoint rounds (checkpoint_interval is 100 ms)."""
    time.sleep(CHECKPOINT_MS * 5 / 1000)


def items(n: int) -> list[bytes]:
    return [b"item-%03d" % i for i in range(n)]


def test_kill_9_keeps_unconfirmed_and_open_items(server: ServerProcess) -> None:
    server.start()
    values = items(20)
    main = pymc(server.memcache)
    holders = [pymc(server.memcache) for _ in range(4)]
    try:
        for v in values:
            assert main.set("q", v)
        assert [main.get("q") for _ in range(5)] == values[:5]  # consumed for good
        # Three open reads, each on its own connection (one open read per queue each).
        assert [h.get("q/open") for h in holders[:3]] == values[5:8]
        # Confirmed out of order, while lower ids are still open (READ_DONE).
        assert holders[3].get("q/open") == values[8]
        assert holders[3].get("q/close") is None
        wait_past_checkpoints()
        server.kill()
    finally:
        for c in [main, *holders]:
            c.close()
    server.start()
    after = pymc(server.memcache)
    try:
        stats = after.stats()
        assert stats[b"queue_q_items"] == 14
        assert gets_until_dry(after, "q") == values[5:8] + values[9:]
    finally:
        after.close()
    log = server.log()
    assert b"queue q: 14 items" in log
    found = re.search(rb"recovered (\d+) queues: (\d+) items waiting", log)
    assert found is not None, log
    assert (int(found[1]), int(found[2])) == (1, 14)


def test_kill_9_keeps_every_acknowledged_pipelined_put(server: ServerProcess) -> None:
    server.start()
    n = 300
    batch = b"".join(b"set p 0 0 7\r\np-%05d\r\n" % i for i in range(n))
    replies = send_lines(server.memcache, batch, until=b"STORED\r\n" * n)
    assert replies == b"STORED\r\n" * n
    server.kill()  # at once: no checkpoint, no clean close
    server.start()
    client = pymc(server.memcache)
    try:
        assert gets_until_dry(client, "p") == [b"p-%05d" % i for i in range(n)]
    finally:
        client.close()


def test_kill_9_keeps_puts_fanned_over_many_queues(server: ServerProcess) -> None:
    # Sets to eight queues in one write: a pass that appends to eight segment files has
    # one durable point, the intent log's fsync; a kill leaves its records for the next
    # start to write back (the same bytes, SIGKILL keeps the page cache: what this shows
    # is that writing them back, at their offsets, spoils nothing).
    server.start()
    queues = [f"fan{i}" for i in range(8)]
    rounds = 40
    def item(q: str, n: int) -> bytes:
        return b"%s-%03d" % (q.encode(), n)

    batch = b"".join(b"set %s 0 0 %d\r\n%s\r\n" % (q.encode(), len(item(q, n)), item(q, n))
                     for n in range(rounds) for q in queues)
    total = rounds * len(queues)
    assert send_lines(server.memcache, batch, until=b"STORED\r\n" * total) == (
        b"STORED\r\n" * total)
    assert "queued-intents" in data_files(server.data_dir)
    assert metric(server, "queued_intent_log_appends_total") >= 1
    server.kill()
    server.start()
    assert metric(server, "queued_recovery_intents_replayed") >= len(queues)  # (recovered)
    assert re.search(rb"intent log: \d+ records \(\d+ bytes\) written back into 8 segment",
                     server.log())
    client = pymc(server.memcache)
    try:
        for q in queues:
            assert gets_until_dry(client, q) == [item(q, n) for n in range(rounds)]
    finally:
        client.close()
    server.signal(signal.SIGTERM)
    assert server.wait() == 0
    assert "queued-intents" not in data_files(server.data_dir)  # a clean stop settles it


def metric(server: ServerProcess, name: str, wait: float = 10.0) -> float:
    """One unlabelled series of the server's /metrics (there once its recovery is done:
    tried for up to `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        status, _, body = http_get(server.http, "/metrics")
        assert status == 200
        found = re.search(rb"^%s (\S+)$" % name.encode(), body, re.M)
        if found is not None:
            return float(found[1])
        assert time.monotonic() < deadline, f"{name} not in /metrics"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "shutdown"])
def test_clean_stop_exits_0_and_open_reads_come_back(server: ServerProcess, how: str) -> None:
    server.start()
    values = items(5)
    main = pymc(server.memcache)
    holder = pymc(server.memcache)
    try:
        for v in values:
            assert main.set("q", v)
        assert main.get("q") == values[0]  # confirmed: must not come back
        assert holder.get("q/open") == values[1]  # left open: must come back, first
        assert holder.get("q/peek") == values[2]
        if how == "shutdown":
            main.shutdown()
        else:
            server.signal(getattr(signal, how))
        assert server.wait(20) == 0
    finally:
        for c in (main, holder):
            c.close()
    log = server.log()
    assert b"stopped cleanly" in log, log
    server.start()
    after = pymc(server.memcache)
    try:
        assert gets_until_dry(after, "q") == values[1:]
    finally:
        after.close()
    assert b"queue q: 4 items" in server.log()


def test_fanout_readers_and_deletes_survive_restart(server: ServerProcess) -> None:
    data = server.data_dir
    server.start()
    client = pymc(server.memcache)
    try:
        assert client.set("q", b"0")
        assert client.get("q+a") == b"0"  # takes over the default reader
        assert client.get("q+b") is None  # starts at the tail
        for v in (b"1", b"2", b"3"):
            assert client.set("q", v)
        assert client.get("q+a") == b"1"
        assert [client.get("q+b") for _ in range(2)] == [b"1", b"2"]
        assert client.set("gone", b"x")
        assert client.delete("gone")
        wait_past_checkpoints()
        server.kill()
    finally:
        client.close()
    assert {"q.read.a", "q.read.b"} <= set(data_files(data))
    assert not any(f.startswith("gone.") for f in data_files(data))
    server.start()
    client = pymc(server.memcache)
    try:
        assert gets_until_dry(client, "q+a") == [b"2", b"3"]
        assert gets_until_dry(client, "q+b") == [b"3"]
        stats = client.stats()
        assert b"queue_gone_items" not in stats
        assert b"queue_q_items" not in stats  # no default reader any more
        assert client.set("q", b"4")
        assert client.get("q+a") == b"4"
        assert client.get("q+b") == b"4"
    finally:
        client.close()


def test_text_protocol_open_reads_survive_a_kill(server: ServerProcess) -> None:
    server.start()
    reply = send_lines(server.text, b"put t:\nA\nB\nC\n\n", until=b"\n")
    assert reply == b"+3\n"
    with socket.create_connection(("127.0.0.1", server.text), timeout=10) as s:
        s.sendall(b"get t\nmonitor t 100 1\n")  # A taken for good; B open, never confirmed
        got = b""
        while got.count(b"\n") < 2:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b":A\n:B\n"), got
        wait_past_checkpoints()
        server.kill()
    server.start()
    client = pymc(server.memcache)
    try:
        assert gets_until_dry(client, "t") == [b"B", b"C"]
    finally:
        client.close()


def test_a_busy_port_is_a_clear_error_before_recovery(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "queued.cli", "serve", "--data-dir", str(tmp_path / "d"),
             "--memcache-port", str(port), "--text-port", "0"],
            capture_output=True, timeout=30, check=False,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot listen for memcache on 127.0.0.1:{port}".encode() in proc.stderr
    assert b"Traceback" not in proc.stderr
    # It failed before recovery: the start-up probe made the directory (and proved it
    # writable, leaving nothing), no journal was touched.
    assert list((tmp_path / "d").iterdir()) == []
