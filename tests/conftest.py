"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio.testing
from disk_util import tmpfs_mount
from security_util import USERS, Pki, users_toml
from server_util import ServerProcess
from wait_util import held_clock


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 2 MiB tmpfs (skips the test where it cannot be mounted)."""
    yield from tmpfs_mount(tmp_path)


@pytest.fixture
def trio_clock() -> trio.testing.MockClock:
    """trio time for the test that asks for it (pytest-trio runs the test on it): it
    stands still until the test jumps it or lets it jump (wait_util.autojumping)."""
    return held_clock()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA and a server certificate for 127.0.0.1 in tmp_path (security_util.Pki)."""
    return Pki(tmp_path)


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    """A users file of test_security's USERS (alice, bob, root), with cheap hashes."""
    path = tmp_path / "users.toml"
    path.write_text(users_toml(**USERS))
    return path


@pytest.fixture
def server_proc(tmp_path: Path) -> Iterator[ServerProcess]:
    """A `queued serve` subprocess on tmp_path/data (not started yet), killed at the end."""
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] SparkSession (UI off) for every Spark test of the run. No register():
    the Spark tests go through PySpark's auto-registration of the `queued` source."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master("local[2]").appName("queued-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "1g")
               # Short-lived JVM on two shared cores: C1 only (no C2 compiler threads
               # competing with the tests) and one GC thread.
               .config("spark.driver.extraJavaOptions",
                       "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xss4m")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
