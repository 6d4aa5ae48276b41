"""The `queued` source and sink from a Spark Connect client (`SparkSession.builder.remote`):
batch and stream reads of a journal directory, batch and stream writes into a server,
against a Spark Connect server the test starts (PySpark's own, `spark-submit --class
org.apache.spark.sql.connect.service.SparkConnectServer`, on 127.0.0.1 port 0) with
`PYSPARK_PYTHON` pointing at this Python, whose workers import `queued`.

Skips only when what it needs is not installed: PySpark's Connect plugin jar, or the
client's libraries (`pip install -e '.[spark]'` brings `pyspark[connect]`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from server_util import ServerProcess, drain_queue

from queued.storage.opening import open_data_dir

try:
    import pyspark
    import pyspark.sql.connect.session
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"the Spark Connect client is not installed ({exc}); pip install -e "
                "'.[spark]'", allow_module_level=True)

SPARK_HOME = Path(pyspark.__file__).parent
if not list((SPARK_HOME / "jars").glob("spark-connect_*.jar")):  # pragma: no cover
    pytest.skip(f"PySpark's Spark Connect server jar is not in {SPARK_HOME / 'jars'}",
                allow_module_level=True)

T0 = 1_700_000_000_000
STARTED = re.compile(rb"Spark Connect server started at: 127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def connect_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A Spark Connect server (local[2]) for the module; killed by its process group."""
    root = tmp_path_factory.mktemp("spark-connect")
    log = root / "server.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_HOME": str(SPARK_HOME)}
    cmd = [str(SPARK_HOME / "bin" / "spark-submit"),
           "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
           "--name", "queued-tests-connect", "--master", "local[2]",
           "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
           "--conf", "spark.connect.grpc.binding.port=0",
           "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
           "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=2",
           "--conf", "spark.driver.memory=512m",
           # a short-lived JVM (as the suite's session, tests/conftest.py): C1 only
           "--conf", "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
           "--conf", f"spark.sql.warehouse.dir={root / 'warehouse'}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=env, cwd=root, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (m := STARTED.search(log.read_bytes())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the Spark Connect server did not start:\n"
                                     + log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        yield int(m.group(1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its JVM and Python workers
        proc.wait(30)


@pytest.fixture(scope="module")
def remote(connect_port: int) -> Iterator[Any]:
    """A Spark Connect client session. Through Connect's own builder: PySpark's
    `SparkSession.builder.remote(...)` refuses while this process runs the classic session
    of the other Spark tests (a user with Connect alone calls that one), and sets
    SPARK_CONNECT_MODE_ENABLED, which would make PySpark build Connect plans everywhere here
    (put back afterwards, in case)."""
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    saved = {k: os.environ.get(k) for k in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
    session = RemoteSession.builder.remote(f"sc://127.0.0.1:{connect_port}").getOrCreate()
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory: queue `jobs` with ids 1..600, items b"job-<id>"."""
    path = tmp_path_factory.mktemp("connect-journal") / "data"

    async def write() -> None:
        async with open_data_dir(path) as dd:
            for i in range(1, 601, 100):
                await dd.queue("jobs").append([b"job-%d" % k for k in range(i, i + 100)], T0)

    trio.run(write)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("connect-server")
    proc = ServerProcess(root / "data", root / "server.log").start()
    try:
        yield proc
    finally:
        proc.kill()


def test_a_batch_read_through_connect(remote: Any, journal: Path) -> None:
    df = remote.read.format("queued").load(str(journal))
    assert type(df).__module__.startswith("pyspark.sql.connect")  # a Connect plan
    rows = df.where("id > 590").orderBy("id").collect()
    assert [(r.queue, r.id, r.data) for r in rows] == [
        ("jobs", i, b"job-%d" % i) for i in range(591, 601)]
    assert df.count() == 600


def test_a_stream_read_through_connect(remote: Any, journal: Path, tmp_path: Path) -> None:
    q = (remote.readStream.format("queued").option("maxOffsetsPerTrigger", 250)
         .load(str(journal)).writeStream.format("memory").queryName("connect_stream")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start())
    assert q.awaitTermination(180)
    ids = sorted(r.id for r in remote.sql("select id from connect_stream").collect())
    assert ids == list(range(1, 601))


def test_a_batch_write_through_connect(remote: Any, server: ServerProcess) -> None:
    addr = f"127.0.0.1:{server.rpc}"
    df = remote.range(500).selectExpr("cast(concat('w-', cast(id as string)) as binary) as data")
    (df.write.format("queued").mode("append").option("server", addr).option("queue", "cw")
     .option("idempotency_key", "connect-batch").save())
    assert sorted(drain_queue(addr, "cw")) == sorted(b"w-%d" % i for i in range(500))


def test_a_stream_write_through_connect_stores_each_row_once(
        remote: Any, server: ServerProcess, journal: Path, tmp_path: Path) -> None:
    addr = f"127.0.0.1:{server.rpc}"
    q = (remote.readStream.format("queued").option("maxOffsetsPerTrigger", 200)
         .load(str(journal)).select("data")
         .writeStream.format("queued").option("server", addr).option("queue", "cs")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    got = Counter(drain_queue(addr, "cs"))
    assert set(got) == {b"job-%d" % i for i in range(1, 601)} and set(got.values()) == {1}
