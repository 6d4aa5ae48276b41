"""Giving memory back to the system (queued.server.memory): after a backlog of large items
drains, once when clients go quiet, and after password checks (scrypt's 16 MiB each).
Real in-process servers on 127.0.0.1 port 0; the scrypt case in a subprocess."""

from __future__ import annotations

import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
from ops_util import cfg
from server_util import (
    WAIT,
    Conn,
    running,
)
from wait_util import wait_until

from queued.server import memory


async def test_memory_is_given_back_once_a_backlog_drains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heap is trimmed once held item bytes fall by TRIM_STEP (glibc): RSS after the
    drain is back near where it started, not at the peak."""
    if not memory.trim():
        pytest.skip("no malloc_trim in this C library")
    monkeypatch.setattr(memory, "TRIM_CHECK_SECONDS", 0.3)
    config = cfg(tmp_path, "[queues.big]\nmax_memory_size = \"256MiB\"\n")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    async with running(config) as server:
        c = await Conn.open(server.ports["memcache"])
        before = rss()
        block = b"m" * (64 << 10)
        n = 1200  # 75 MiB
        for _ in range(0, n, 100):
            await c.send(b"".join(b"set big 0 0 %d\r\n%s\r\n" % (len(block), block)
                                  for _ in range(100)))
            assert [await c.line() for _ in range(100)] == [b"STORED"] * 100
        peak = rss()
        assert peak - before > 60 << 20
        for _ in range(n):
            assert await c.get("big") == block
        await wait_until(lambda: rss() - before <= (peak - before) // 3,
                         timeout=WAIT + memory.TRIM_CHECK_SECONDS, poll=0.2)
        await c.aclose()


async def test_heap_is_trimmed_once_when_clients_go_quiet(monkeypatch: pytest.MonkeyPatch,
                                                          ) -> None:
    """Below TRIM_STEP of growth, a trim still comes once traffic stops (and only once)."""
    if not memory.trim():
        pytest.skip("no malloc_trim in this C library")
    trims: list[float] = []  # one entry per trim
    real_trim = memory.trim

    def counted() -> bool:
        trims.append(1.0)  # (in a worker thread)
        return real_trim()

    monkeypatch.setattr(memory, "trim", counted)
    looks = [0]
    busy = [True]

    def activity() -> int:  # what the trimmer sees: new bytes at every look while busy
        looks[0] += 1
        return looks[0] if busy[0] else -1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(memory.trim_when_drained, lambda: 0, 0.02,
                                   activity=activity))
        await wait_until(lambda: looks[0] >= 10)
        assert trims == []  # busy all along (and no growth of TRIM_STEP meanwhile)
        busy[0] = False
        await wait_until(lambda: bool(trims))
        seen = looks[0]
        await wait_until(lambda: looks[0] >= seen + 10)  # quiet on: no second trim
        assert len(trims) == 1
        busy[0] = True  # busy again, then quiet: one more
        seen = looks[0]
        await wait_until(lambda: looks[0] >= seen + 3)
        busy[0] = False
        await wait_until(lambda: len(trims) >= 2)
        nursery.cancel_scope.cancel()


SCRYPT_IN_THREADS = r"""
import hashlib, sys, threading
from queued.server import memory
if sys.argv[1] == "pinned":
    assert memory.pin_mmap_threshold()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def check():  # what a login's password check costs: scrypt, 16 MiB
    hashlib.scrypt(b"guess", salt=b"s" * 16, n=1 << 14, r=8, p=1, maxmem=64 << 20)
before = rss()
for _ in range(6):  # new threads each round, as trio's thread cache makes them
    threads = [threading.Thread(target=check) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
memory.trim()
print(rss() - before)
"""


def test_password_checks_give_their_memory_back() -> None:
    """scrypt's 16 MiB per check goes back to the system once the check is done when the
    mmap threshold is pinned (as the server does at start). (With glibc's sliding
    threshold the threads' heaps kept it in 5 of 8 runs here, 0 in the others: too
    uneven to serve as a control.)"""
    if not memory.trim():
        pytest.skip("no malloc_trim in this C library")
    out = subprocess.run([sys.executable, "-c", SCRYPT_IN_THREADS, "pinned"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) < 4 << 20
