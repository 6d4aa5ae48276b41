"""Helpers for the tests that drive the broker directly (queued.broker over a real data
directory, no sockets): configs, the two clocks, reading a queue out.

Time is the test's: the wall clock (item add and expiry times) is a FakeClock where
expiry matters, and trio time (long polls, open-read timeouts, the upkeep timers) is a
MockClock that only moves when a test jumps it (`advance`). Not autojump_threshold=0:
the broker's own rounds still go to the writer's thread when they open a file or owe
an fsync, and trio counts a task waiting for that thread as blocked, so an autojump
clock would run ahead while a put is being written and time out the long poll that put
was meant to answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing
from wait_util import held_clock

from queued.broker.broker import Broker
from queued.config import ServerConfig, load_config
from queued.journal import format as jf

T0 = 1_700_000_000_000
HOUR = 3_600_000
def frozen_clock() -> trio.testing.MockClock:
    """trio time that moves only when a test jumps it (wait_util.held_clock: after
    HANG_GUARD_S real seconds with every task blocked it jumps anyway, so a long poll
    nothing answers times out and its test fails instead of hanging)."""
    return held_clock()


async def advance(trio_clock: trio.testing.MockClock, seconds: float) -> None:
    """Once every task waits, `seconds` of trio time pass at once; then every task they
    made due runs."""
    await trio.testing.wait_all_tasks_blocked()
    trio_clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


async def settle(done: Callable[[], bool]) -> None:
    """Run the other tasks until `done()`: for background work that ends in a worker
    thread, which neither trio time nor wait_all_tasks_blocked waits for."""
    for _ in range(1_000_000):
        if done():
            return
        await trio.sleep(0)
    raise AssertionError("background work never finished")


class FakeClock:
    """The broker's wall clock (ms); trio's clock still drives timeouts."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def make_config(
    tmp: Path, toml: str = "", *, fsync: str = "never", **server: Any
) -> ServerConfig:
    """Config for data dir tmp/data; `toml` holds [default] / [queues.x] tables."""
    flags: dict[str, object] = {
        "data_dir": str(tmp / "data"),
        "memcache_port": 0,
        "text_port": 0,
        "rpc_port": 0,
        "http_port": 0,
        "fsync": fsync,
        # Background work only when a test asks for it.
        "checkpoint_interval": HOUR,
        "expiration_timer": HOUR,
    }
    flags.update(server)
    if toml:
        path = tmp / "queued.toml"
        path.write_text(toml)
        flags["config"] = str(path)
    return load_config(flags, env={})


def with_default(cfg: ServerConfig, **kw: Any) -> ServerConfig:
    return dataclasses.replace(cfg, default=dataclasses.replace(cfg.default, **kw))


def stats(broker: Broker, name: str = "q") -> dict[str, int]:
    return dict(broker.queue_stats())[name]


def datas(items: list[jf.Put | None]) -> list[bytes | None]:
    return [None if it is None else it.data for it in items]


async def get_all(broker: Broker, queue: str = "q", reader: str | None = None) -> list[bytes]:
    out = []
    while (it := await broker.get(queue, reader)) is not None:
        out.append(it.data)
    return out
