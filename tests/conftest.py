"""Fixtures shared by several test files."""

from __future__ import annotations

import ast
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import compiled_util  # first: under make test-compiled, it puts the build on sys.path
import pytest
import trio.testing
from disk_util import tmpfs_mount
from security_util import USERS, Pki, users_toml
from server_util import ServerProcess
from wait_util import held_clock


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test-compiled`, every process of the run (xdist's workers too) checks
    that it imports the compiled build's modules (compiled_util.check)."""
    compiled_util.check()


def pytest_report_header(config: pytest.Config) -> str:
    return compiled_util.check() or "queued: pure Python (the source tree)"


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


# -- how `make test` spreads the suite over its worker processes (pytest-xdist) ---------------

#: Work that takes longest, started first so that it does not end the run alone (measured
#: with --durations; only the order depends on it, never what runs).
LONG_FIRST = ("test_spark_exactly_once", "test_spark_connect", "test_power_loss",
              "test_fleet_nemesis", "test_cli_client_commands", "test_bench",
              "test_client_credentials", "test_server_restart", "test_fleet", "test_crash")


@functools.cache
def spark_session_tests(path: Path) -> frozenset[str]:
    """The test functions of a file that take the `spark` fixture (read from its source:
    xdist's controller sees test ids, not fixtures)."""
    if not path.name.startswith("test_spark") or not path.is_file():
        return frozenset()
    return frozenset(node.name for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and any(arg.arg == "spark" for arg in node.args.args))


def work_group(root: Path, nodeid: str) -> str:
    """The unit of work a test belongs to: "spark" for every test on the shared
    SparkSession (one worker alone starts its JVM), else its file (its module-scoped
    fixtures run once)."""
    path, _, rest = nodeid.partition("::")
    function = rest.split("[")[0].split("::")[-1]
    return "spark" if function in spark_session_tests(root / path) else path


def group_rank(group: str) -> int:
    if group == "spark":
        return 0
    stem = Path(group).stem
    return LONG_FIRST.index(stem) + 1 if stem in LONG_FIRST else len(LONG_FIRST) + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs `-n 2 --dist loadfile`: each file in one worker, as xdist's
    loadfile does, but the Spark session's tests together (work_group). (xdist's own
    loadgroup marks do not group under pytest 9: it renames a test's `_nodeid`, which
    pytest 9 no longer reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndSpark(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_group(config.rootpath, nodeid)

    config.option.loadscopereorder = False  # the order of collection: see below
    return FilesAndSpark(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Spark group first, then LONG_FIRST, then the rest in file order: xdist hands
    the groups out in this order (tests/README.md, "In parallel")."""
    items.sort(key=lambda item: group_rank(work_group(config.rootpath, item.nodeid)))
