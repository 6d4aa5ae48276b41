"""Fixtures of the browser tests: a `queued serve` subprocess (with and without users,
served.py) and a headless Chromium (browser_util.py, imported only inside its fixture:
plain `make test` has no Selenium)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from served import Served, serve


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    """A server without users: the console is read-only."""
    yield from serve(tmp_path, users=False)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Served]:
    """A server with users `viewer` (get on every queue) and `root` (admin)."""
    yield from serve(tmp_path, users=True)


@pytest.fixture
def small_memory(tmp_path: Path) -> Iterator[Served]:
    """A server without users whose readers keep 1 KiB of items in memory: the rest of a
    backlog waits on disk (read-behind)."""
    yield from serve(tmp_path, users=False, toml='[default]\nmax_memory_size = "1KiB"\n')


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from browser_util import Browser, available

    why = available()
    if why is not None:
        pytest.skip(why)
    b = Browser(tmp_path / "chromium-profile")
    try:
        yield b
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            b.close()
